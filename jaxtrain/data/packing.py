"""DataConfig, raw corpus files, and the train/eval batch makers every run uses.

Training reads `TokenSource`s (jaxtrain/data/store/): raw `.txt`/`.jsonl`/`save_to_disk` files
tokenized in memory (`[bos] + tokens + [eos]` per document), token stores, or Megatron-LM
prefixes. Packing into windows of `seq_len + 1` tokens is jaxtrain/data/store/windows.py; the
step -> batch rule (shuffles, blends, process rows) is jaxtrain/data/store/loader.py. Raw files
are one source among others, packed by the same rules as a store.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Sequence

import grain
import numpy as np

from jaxtrain.data.store import loader
from jaxtrain.data.store.memory_source import text_files_source
from jaxtrain.data.store.windows import WindowIndex
# Raw-file helpers live in text_files (the stores use them too); importable from here as well.
from jaxtrain.data.text_files import encode_to_array, read_documents, read_utf8, resolve_path  # noqa: F401
from jaxtrain.data.tokenizer import Tokenizer, load_tokenizer


@dataclasses.dataclass(frozen=True)
class DataConfig:
    # Relative paths are looked up in the CWD, then in the repo root (the folder holding jaxtrain/).
    # Entries: raw .txt/.jsonl files or save_to_disk folders (one corpus, tokenized at start), token
    # store folders (python -m jaxtrain.data prepare) or Megatron-LM prefixes (prefix.bin + .idx).
    train_files: tuple[str, ...] = ("data/tiny_corpus/train.txt",)
    eval_files: tuple[str, ...] = ("data/tiny_corpus/valid.txt",)  # (): no evaluation during training
    tokenizer: str = "bytes"  # "bytes" or a local Hugging Face tokenizer directory
    text_field: str = "text"  # the document field of .jsonl lines and datasets columns
    shuffle: bool = True  # shuffle document order once and window order every epoch
    # Train on a weighted blend instead of train_files, as Megatron's --data-path:
    # (weight, source, weight, source, ...), e.g. (0.7, "stores/web", 0.3, "megatron/code_text_document").
    # Weights are normalized; each source is one entry as in train_files.
    blend: tuple[str | float, ...] = ()

    def __post_init__(self):
        # Config systems hand over lists, and a lone string would iterate as characters.
        for name in ("train_files", "eval_files", "blend"):
            value = getattr(self, name)
            object.__setattr__(self, name, (value,) if isinstance(value, str) else tuple(value))


def tokenize_text_stream(path: str | os.PathLike, tokenizer: Tokenizer | str) -> np.ndarray:
    """A whole raw text file as one int32 token stream: no paragraph splitting, no specials."""
    if isinstance(tokenizer, str):
        tokenizer = load_tokenizer(tokenizer)
    return encode_to_array(tokenizer, read_utf8(resolve_path(path)))


@dataclasses.dataclass(frozen=True)
class PackedStream:
    """All documents back to back; `doc_ids[i]` says which document token `i` belongs to."""

    tokens: np.ndarray  # int32 [N]
    doc_ids: np.ndarray  # int32 [N], 0, 1, ... in stream order
    pad_id: int


def load_stream(
    files: Sequence[str], tokenizer_spec: str, text_field: str, doc_seed: int | None
) -> PackedStream:
    """The packed stream of raw `files`, documents shuffled by `doc_seed` (None: file order), built
    whole: a view for inspecting small corpora; training reads windows (WindowIndex) instead."""
    source = text_files_source(files, tokenizer_spec, text_field)
    order = WindowIndex(source, 1, loader.document_order(source, doc_seed)).doc_order
    tokens = np.concatenate([source.tokens(int(d)) for d in order])
    doc_ids = np.repeat(np.arange(len(order), dtype=np.int32), source.document_lengths[order])
    return PackedStream(tokens, doc_ids, source.pad_id)


# ----------------------------------------------------------------------------- sources


def train_sources(cfg: DataConfig) -> list[tuple[float, object]]:
    """(weight, TokenSource) of each training source: DataConfig.blend's, else train_files as one."""
    from jaxtrain.data.store.training_sources import corpus_source, parse_blend

    if cfg.blend:
        return [(weight, corpus_source([path], cfg.tokenizer, cfg.text_field))
                for weight, path in parse_blend(cfg.blend)]
    if not cfg.train_files:
        raise ValueError("DataConfig.train_files is empty: name a corpus file, token store or Megatron prefix to "
                         "train on (or set DataConfig.blend)")
    return [(1.0, corpus_source(cfg.train_files, cfg.tokenizer, cfg.text_field))]


def check_sources_fit(cfg: DataConfig, vocab_size: int) -> None:
    """Every training and eval source's token ids fit the model's vocabulary (one line naming
    the source otherwise)."""
    from jaxtrain.data.store.training_sources import check_fits_vocabulary, corpus_source

    sources = [source for _, source in train_sources(cfg)]
    if cfg.eval_files:  # (none: the run does not evaluate)
        sources.append(corpus_source(cfg.eval_files, cfg.tokenizer, cfg.text_field))
    check_fits_vocabulary(sources, vocab_size)


def _local_batch(batch: int, process_index: int, process_count: int) -> int:
    if process_count < 1 or not 0 <= process_index < process_count:
        raise ValueError(f"bad process_index {process_index} for process_count {process_count}")
    if batch < 1:
        raise ValueError(f"batch size must be positive, got {batch}")
    if batch % process_count:
        raise ValueError(f"global batch {batch} is not divisible by process count {process_count}")
    return batch // process_count


# ----------------------------------------------------------------------------- iterators

_TrainBatchAtStep = loader.TrainBatchAtStep  # (tests/faults/data_faults.py patches its __call__)


def make_train_iterator(
    cfg: DataConfig,
    *,
    seq_len: int,
    global_batch: int,
    seed: int,
    process_index: int = 0,
    process_count: int = 1,
) -> grain.DatasetIterator:
    """Endless iterator of this process's `global_batch // process_count` rows per step.

    Supports `get_state()` / `set_state()` (and so grain.checkpoint.CheckpointSave/Restore).
    One corpus: windows left over after the last full global batch of an epoch are skipped that
    epoch. A blend: each source runs through its own epochs (jaxtrain/data/store/loader.py).
    """
    _local_batch(global_batch, process_index, process_count)
    if seed < 0:
        raise ValueError(f"seed must be non-negative, got {seed}")
    doc_seed = seed if cfg.shuffle else None
    weighted = train_sources(cfg)
    if not cfg.blend:
        source = weighted[0][1]
        windows = WindowIndex(source, seq_len, loader.document_order(source, doc_seed))
        if windows.count < global_batch:
            raise ValueError(
                f"training corpus {', '.join(cfg.train_files)} has only {windows.count} windows of "
                f"{seq_len + 1} tokens, fewer than the global batch {global_batch}"
            )
        return loader.iterate_steps(
            _TrainBatchAtStep(windows, global_batch, seed, cfg.shuffle, process_index, process_count)
        )
    windows = [WindowIndex(source, seq_len, loader.document_order(source, doc_seed, (loader.BLEND_STREAM, j)))
               for j, (_, source) in enumerate(weighted)]
    return loader.iterate_steps(loader.BlendBatchAtStep(
        windows, [w for w, _ in weighted], global_batch, seed, cfg.shuffle, process_index, process_count
    ))


def make_eval_batches(
    cfg: DataConfig,
    *,
    seq_len: int,
    batch_size: int,
    max_batches: int | None,
    process_index: int = 0,
    process_count: int = 1,
) -> list[dict[str, np.ndarray]]:
    """Every window of `eval_files` in order, in batches of `batch_size // process_count` rows.

    Batch `t` covers windows `t*batch_size ... (t+1)*batch_size - 1`, process `p` taking every
    `process_count`-th of them from `p`. Rows past the last window are padding (loss_mask 0), so
    all batches, on all processes, have the same shape and count.
    """
    from jaxtrain.data.store.training_sources import corpus_source

    if not cfg.eval_files:
        raise ValueError("DataConfig.eval_files is empty: there is nothing to evaluate (a training run with no "
                         "eval_files skips evaluation instead)")
    _local_batch(batch_size, process_index, process_count)
    if max_batches is not None and max_batches < 1:
        raise ValueError(f"max_batches must be positive or None, got {max_batches}")
    windows = WindowIndex(corpus_source(cfg.eval_files, cfg.tokenizer, cfg.text_field), seq_len)
    count = -(-windows.count // batch_size)
    if max_batches is not None:
        count = min(count, max_batches)
    batches = []
    for t in range(count):
        rows = np.arange(t * batch_size + process_index, (t + 1) * batch_size, process_count)
        batches.append(windows.examples(np.where(rows < windows.count, rows, -1)))
    return batches
