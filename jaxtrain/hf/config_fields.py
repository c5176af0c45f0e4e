"""Strict reading of an HF config.json: every field is either translated, checked to hold a value
we support, or known not to change the math; anything else is an error that names it."""
from __future__ import annotations

from typing import Any, Iterable

from jaxtrain.hf.errors import HFConfigError

# Fields any HF config may carry that change nothing in the forward or backward pass.
NO_MATH_FIELDS = frozenset({
    "model_type", "_name_or_path", "architectures", "auto_map", "transformers_version", "dtype", "torch_dtype",
    "bos_token_id", "eos_token_id", "pad_token_id", "sep_token_id", "decoder_start_token_id",
    "use_cache", "max_position_embeddings", "output_attentions", "output_hidden_states",
    "return_dict", "id2label", "label2id", "num_labels", "tokenizer_class", "prefix", "task_specific_params",
    "problem_type", "is_decoder", "is_encoder_decoder", "add_cross_attention", "tie_encoder_decoder",
    "chunk_size_feed_forward", "finetuning_task", "cross_attention_hidden_size", "use_bfloat16",
    "initializer_range",
})
_MISSING = object()


class HFConfigFields:
    """Reads fields of one config.json, remembering which were looked at."""

    def __init__(self, raw: dict, where: str = "config.json"):
        self.raw, self.where, self.used = raw, where, set()

    def get(self, name: str, default: Any = _MISSING) -> Any:
        self.used.add(name)
        if name in self.raw and self.raw[name] is not None:
            return self.raw[name]
        if default is _MISSING:
            raise HFConfigError(f"{self.where}: required field {name!r} is missing")
        return default

    def expect(self, name: str, supported: Iterable, default: Any) -> Any:
        """A field whose value must be one we support (e.g. hidden_act='silu')."""
        supported = tuple(supported)
        value = self.get(name, default)
        if value not in supported:
            raise HFConfigError(f"{self.where}: {name}={value!r} is not supported "
                                f"(supported: {', '.join(repr(s) for s in supported)})")
        return value

    def check_all_understood(self, family: str) -> None:
        unknown = sorted(set(self.raw) - self.used - NO_MATH_FIELDS)
        if unknown:
            raise HFConfigError(f"{self.where}: field(s) {', '.join(repr(u) for u in unknown)} are not understood "
                                f"by the {family} mapping; converting would silently ignore them")


_TAGGED_FLOATS = {"Infinity": float("inf"), "-Infinity": float("-inf"), "NaN": float("nan")}


def decode_float(value: Any) -> Any:
    """transformers writes non-finite floats as {"__float__": "Infinity"} (plain JSON has none)."""
    if isinstance(value, dict) and set(value) == {"__float__"} and value["__float__"] in _TAGGED_FLOATS:
        return _TAGGED_FLOATS[value["__float__"]]
    return value


def encode_float(value: float) -> Any:
    """The inverse of decode_float, for writing config.json."""
    for tag, v in _TAGGED_FLOATS.items():
        if value == v:
            return {"__float__": tag}
    return value
