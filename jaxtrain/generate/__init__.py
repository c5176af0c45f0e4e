"""Text generation: prefill + cached decode (engine.py), sampling (sampling.py), the CLI (cli.py)."""
from jaxtrain.generate.engine import Engine, left_pad
from jaxtrain.generate.sampling import Sampling, filter_logits, sample

__all__ = ["Engine", "Sampling", "filter_logits", "left_pad", "sample"]
