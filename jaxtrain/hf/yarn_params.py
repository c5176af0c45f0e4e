"""HF `rope_type="yarn"` settings <-> models.layers.rope.YarnScaling, beside rope_params.py's table.

Kept apart from rope_params.ROPE_TYPES on purpose: YaRN also scales cos/sin (its attention
factor), which only attention layers that apply `rope_attention_factor` honour (MLA does), so a
family opts in by reading its rope with `rope_from_hf_with_yarn`. Defaults follow transformers:
beta_fast 32, beta_slow 1 (also when given as 0 or null), factor = max_position_embeddings /
original_max_position_embeddings when null, original_max_position_embeddings =
max_position_embeddings when absent, truncate true.
"""
from __future__ import annotations

from jaxtrain.hf.config_fields import HFConfigFields
from jaxtrain.hf.errors import HFConfigError
from jaxtrain.hf.rope_params import DEFAULT_THETA, rope_from_hf, rope_to_hf
from jaxtrain.models.layers.rope import YarnScaling

YARN_FIELDS = {"rope_type", "type", "rope_theta", "partial_rotary_factor", "factor", "original_max_position_embeddings",
               "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "attention_factor", "truncate"}


def rope_from_hf_with_yarn(fields: HFConfigFields) -> tuple[float, object]:
    """rope_params.rope_from_hf, plus YaRN (in either the transformers 5 or the legacy layout)."""
    params = fields.get("rope_parameters", None)
    where = f"{fields.where}: rope_parameters"
    if params is None:
        params, where = fields.get("rope_scaling", None) or {}, f"{fields.where}: rope_scaling"
    if not isinstance(params, dict) or params.get("rope_type", params.get("type")) != "yarn":
        return rope_from_hf(fields)
    extra = sorted(set(params) - YARN_FIELDS)
    if extra:
        raise HFConfigError(f"{where}: field(s) {extra} are not supported for rope_type='yarn'")
    partial = params.get("partial_rotary_factor", fields.get("partial_rotary_factor", 1.0))
    if float(partial) != 1.0:
        raise HFConfigError(f"{where}: partial_rotary_factor={partial} is not supported (only 1.0)")
    theta = params.get("rope_theta")
    if theta is None:
        theta = fields.get("rope_theta", DEFAULT_THETA)
    original = fields.get("original_max_position_embeddings", None)  # top level wins, as in transformers
    if original is None:
        original = params.get("original_max_position_embeddings") or fields.get("max_position_embeddings")
    factor = params.get("factor")
    if factor is None:
        factor = fields.get("max_position_embeddings") / original
    attention_factor = params.get("attention_factor")
    scaling = YarnScaling(
        factor=_number(factor, f"{where}.factor"),
        original_max_position=int(_number(original, f"{where}.original_max_position_embeddings")),
        beta_fast=_number(params.get("beta_fast") or 32.0, f"{where}.beta_fast"),
        beta_slow=_number(params.get("beta_slow") or 1.0, f"{where}.beta_slow"),
        mscale=_number(params.get("mscale") or 0.0, f"{where}.mscale"),  # 0: not set
        mscale_all_dim=_number(params.get("mscale_all_dim") or 0.0, f"{where}.mscale_all_dim"),
        attention_factor_override=None if attention_factor is None else _number(attention_factor,
                                                                                 f"{where}.attention_factor"),
        truncate=bool(params.get("truncate", True)),
    )
    if scaling.factor < 1:
        raise HFConfigError(f"{where}.factor={scaling.factor} must be at least 1")
    return _number(theta, f"{where}.rope_theta"), scaling


def rope_to_hf_with_yarn(theta: float, scaling) -> dict:
    if not isinstance(scaling, YarnScaling):
        return rope_to_hf(theta, scaling)
    out = {"rope_type": "yarn", "rope_theta": float(theta), "factor": float(scaling.factor),
           "original_max_position_embeddings": int(scaling.original_max_position),
           "beta_fast": float(scaling.beta_fast), "beta_slow": float(scaling.beta_slow)}
    for name in ("mscale", "mscale_all_dim"):
        if getattr(scaling, name):
            out[name] = float(getattr(scaling, name))
    if scaling.attention_factor_override is not None:
        out["attention_factor"] = float(scaling.attention_factor_override)
    if not scaling.truncate:
        out["truncate"] = False
    return out


def _number(value, where: str):
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise HFConfigError(f"{where}={value!r} is not a number")
    return value
