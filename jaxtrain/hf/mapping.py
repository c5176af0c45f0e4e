"""How a model family's HF tensors correspond to our parameters, declared as data.

A family file lists `TensorMap`s. Each one links an HF tensor name, which may hold index
placeholders (`{layer}`, later `{expert}`), to one of our parameter paths:

* every placeholder is one leading *stack* axis of our parameter, in the order the
  placeholders appear (our layer stacks are scanned, so layer i of HF is row i of ours);
  `hf_indices` gives the HF index of each row when a stack takes only some HF layers
  (a dense prefix, a hybrid layer pattern);
* `pattern` rearranges one HF tensor (one layer's) into our per-layer layout: transpose,
  split heads, ... (see rearrange.py); empty means the same layout;
* `hf_slice` takes a part of a fused HF tensor (split on import, concatenated on export);
  `ours_slice` fills a part of one of our parameters from a separate HF tensor (fuse).
  Both are (axis, start, stop) in the per-layer tensor.

Which maps apply is decided by our model: a map whose parameter the configured model does not
have is skipped if `optional` (biases that are off, the head of a tied model), an error if not.
"""
from __future__ import annotations

import dataclasses
import re
import string
from typing import Any, Callable, Mapping, Sequence

# Placeholder in an HF name -> the logical axis name of the matching stack axis of ours.
STACK_AXES = {"layer": "layers", "expert": "experts"}


@dataclasses.dataclass(frozen=True)
class TensorMap:
    ours: str  # our parameter path, '/'-separated, as in nnx.to_pure_dict(nnx.state(model))
    hf: str  # HF tensor name, e.g. "model.layers.{layer}.self_attn.q_proj.weight"
    pattern: str = ""  # rearrangement from the HF tensor to our per-layer tensor
    optional: bool = False
    hf_slice: tuple[int, int, int] | None = None
    ours_slice: tuple[int, int, int] | None = None
    hf_indices: Mapping[str, Sequence[int]] | None = None

    @property
    def stack(self) -> tuple[str, ...]:
        names = [f for _, f, _, _ in string.Formatter().parse(self.hf) if f]
        unknown = [n for n in names if n not in STACK_AXES]
        if unknown:
            raise ValueError(f"HF name {self.hf!r} has unknown placeholders {unknown}; use {sorted(STACK_AXES)}")
        return tuple(names)

    def hf_name(self, index: Sequence[int]) -> str:
        """The HF name of our stack row `index`."""
        values = {}
        for axis, i in zip(self.stack, index):
            table = (self.hf_indices or {}).get(axis)
            values[axis] = table[i] if table is not None else i
        return self.hf.format(**values)

    def hf_name_regex(self) -> re.Pattern:
        parts = re.split(r"\{(\w+)\}", self.hf)
        return re.compile("".join(re.escape(p) if i % 2 == 0 else r"(\d+)" for i, p in enumerate(parts)) + "$")


@dataclasses.dataclass(frozen=True)
class Family:
    """Everything the HF bridge knows about one model family (one HF `model_type`)."""
    model_type: str  # config.json "model_type"
    architecture: str  # config.json "architectures"[0] written on export (the transformers class)
    config_class: type  # our config dataclass; `build(rngs)` gives the model
    config_from_hf: Callable[[dict, str], Any]  # (config.json dict, its path) -> our config; raises on anything unsupported
    config_to_hf: Callable[[Any], dict]  # our config -> config.json dict
    tensors: Callable[[Any], Sequence[TensorMap]]  # our config -> the tensor table
    ignored_hf_tensors: tuple[str, ...] = ()  # regexes of HF tensors that carry nothing we use
