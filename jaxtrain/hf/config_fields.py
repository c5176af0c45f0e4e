"""Strict reading of an HF config.json: every field is translated, checked to hold a value we
support, or known not to change the math; anything else is an error that names it.

Published configs carry many fields no forward or backward pass reads (provenance, tokenizer ids,
generation settings, exporters' markers); those are accepted, and the ones a mapping did not read
are listed in one info line. The classification below was decided by reading transformers 5's
modeling code for each family in hf/families/ (llama, deepseek_v2, mamba2, nemotron_h): none of
the accepted fields is read by it. A field naming computation that our models do one way only
is accepted only at that value (CHECKED_FIELDS); a family's mapping checks its own fields first.
"""
from __future__ import annotations

import logging
from typing import Any, Callable, Iterable

from jaxtrain.hf.errors import HFConfigError

logger = logging.getLogger(__name__)

# Bookkeeping transformers (or an exporter) writes: which class, which version, which dtype the
# file's tensors had (we convert them), what a forward returns, classifier-head labels (ours is a
# causal LM), the length the model was trained to (no position is clipped by it; llama3 rope reads it
# where it needs it), the init scale (a family translates it when it has one).
METADATA = frozenset({
    "model_type", "architectures", "auto_map", "transformers_version", "dtype", "torch_dtype", "use_bfloat16",
    "output_attentions", "output_hidden_states", "return_dict", "torchscript", "use_cache",
    "chunk_size_feed_forward", "is_decoder", "is_encoder_decoder", "add_cross_attention",
    "cross_attention_hidden_size", "tie_encoder_decoder", "tokenizer_class", "prefix", "task_specific_params",
    "finetuning_task", "id2label", "label2id", "num_labels", "problem_type", "max_position_embeddings",
    "initializer_range", "transformers.js_config",
    "is_llama_config",  # nanotron's marker on its Llama exports
    "gradient_checkpointing", "attn_implementation", "use_flash_attention_2",  # how, not what, is computed
})
# Token ids the tokenizer and generation use. pad_token_id is also torch's nn.Embedding padding_idx,
# which only keeps that row's gradient at zero in torch; no forward reads it.
TOKEN_IDS = frozenset({
    "bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id", "sep_token_id", "cls_token_id",
    "mask_token_id", "decoder_start_token_id",
})
# Sampling settings older transformers kept in config.json (now generation_config.json); transformers
# 5 drops them on load (GenerationConfig._get_default_generation_params, copied here).
GENERATION = frozenset({
    "assistant_confidence_threshold", "assistant_lookbehind", "bad_words_ids", "begin_suppress_tokens",
    "diversity_penalty", "do_sample", "early_stopping", "encoder_no_repeat_ngram_size", "encoder_repetition_penalty",
    "epsilon_cutoff", "eta_cutoff", "exponential_decay_length_penalty", "forced_bos_token_id", "forced_eos_token_id",
    "length_penalty", "max_length", "min_length", "no_repeat_ngram_size", "num_assistant_tokens",
    "num_assistant_tokens_schedule", "num_beam_groups", "num_beams", "num_return_sequences", "output_scores",
    "remove_invalid_values", "repetition_penalty", "return_dict_in_generate", "suppress_tokens",
    "target_lookbehind", "temperature", "top_k", "top_p", "typical_p",
})
NO_MATH_FIELDS = METADATA | TOKEN_IDS | GENERATION


def _is_private(name: str) -> bool:
    """transformers' own bookkeeping (`_name_or_path`, `_commit_hash`, `_attn_implementation`, ...)."""
    return name.startswith("_")


def _one_of(*values) -> tuple[Callable[[Any], bool], str]:
    return (lambda v: v in values), " or ".join(repr(v) for v in values)


def _positive_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 1


# Fields naming computation our models have one way only: accepted at that value (or null),
# refused naming the field otherwise. Any family's config may carry them.
CHECKED_FIELDS: dict[str, tuple[Callable[[Any], bool], str]] = {
    # transformers 4's Llama split each projection into pretraining_tp slices and summed the partial
    # products (the same math in another summation order); transformers 5 does not read it
    "pretraining_tp": (_positive_int, "a positive integer"),
    "rope_interleaved": _one_of(False),  # nanotron: True = rotary on interleaved pairs, not halves
    "use_sliding_window": _one_of(False),
    "sliding_window": _one_of(None),
    "qk_layernorm": _one_of(False), "qk_norm": _one_of(False), "use_qk_norm": _one_of(False),
    "qk_layer_norms": _one_of(False),
    "attn_logit_softcapping": _one_of(None), "final_logit_softcapping": _one_of(None),
    "attention_dropout": _one_of(0, 0.0), "hidden_dropout": _one_of(0, 0.0), "resid_pdrop": _one_of(0, 0.0),
    "embd_pdrop": _one_of(0, 0.0), "neftune_noise_alpha": _one_of(0, 0.0),
    "pruned_heads": _one_of({}),
    "rms_norm": _one_of(True),  # every norm of ours is an RMSNorm (mamba_ssm's False: LayerNorm)
}

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

    def check_all_understood(self, family: str) -> list[str]:
        """Every field the mapping did not read: checked (CHECKED_FIELDS), known not to change the
        math (listed in one info line and returned), or an error naming all that are neither."""
        unread = sorted(set(self.raw) - self.used)
        for name in unread:
            if name in CHECKED_FIELDS and self.raw[name] is not None:
                supported, described = CHECKED_FIELDS[name]
                if not supported(self.raw[name]):
                    raise HFConfigError(f"{self.where}: {name}={self.raw[name]!r} is not supported by the {family} "
                                        f"mapping (supported: {described})")
        unknown = [n for n in unread if n not in CHECKED_FIELDS and n not in NO_MATH_FIELDS and not _is_private(n)]
        if unknown:
            raise HFConfigError(f"{self.where}: field(s) {', '.join(repr(u) for u in unknown)} are not understood "
                                f"by the {family} mapping; converting would silently ignore them")
        ignored = [n for n in unread if n not in CHECKED_FIELDS]
        if ignored:
            logger.info("%s: not used, as they do not change the computation: %s", self.where, ", ".join(ignored))
        return ignored


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
