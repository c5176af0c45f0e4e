"""Text corpora -> packed token windows -> batches; tokenizers; sliding-window eval windows."""
