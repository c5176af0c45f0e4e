"""HF rotary-embedding settings <-> our frequency-scaling strategies (models/layers/rope.py).

transformers 5 keeps them in `rope_parameters` (with `rope_theta` inside); configs written by
transformers 4 have top-level `rope_theta` and `rope_scaling`. Both are read; version 5's form
is written. The table says, per HF `rope_type`, which strategy it is and how its fields are named.
"""
from __future__ import annotations

from jaxtrain.hf.config_fields import HFConfigFields
from jaxtrain.hf.errors import HFConfigError
from jaxtrain.models.layers.rope import Llama3Scaling, LinearScaling, NoScaling

# rope_type -> (strategy class, {HF field: strategy field})
ROPE_TYPES = {
    "default": (NoScaling, {}),
    "linear": (LinearScaling, {"factor": "factor"}),
    "llama3": (Llama3Scaling, {"factor": "factor", "low_freq_factor": "low_freq_factor",
                               "high_freq_factor": "high_freq_factor",
                               "original_max_position_embeddings": "original_max_position"}),
}
_ALWAYS_ALLOWED = {"rope_type", "type", "rope_theta", "partial_rotary_factor"}
DEFAULT_THETA = 10000.0  # transformers' default when a config names no rope_theta


def rope_from_hf(fields: HFConfigFields) -> tuple[float, object]:
    """(rope_theta, scaling strategy) from a config; errors on any type or field we don't model."""
    params = fields.get("rope_parameters", None)
    legacy = fields.get("rope_scaling", None)
    top_theta = fields.get("rope_theta", None)
    if params is None:
        params = dict(legacy or {})
        params.setdefault("rope_theta", DEFAULT_THETA if top_theta is None else top_theta)
        where = f"{fields.where}: rope_scaling"
    else:
        where = f"{fields.where}: rope_parameters"
    if not isinstance(params, dict) or any(isinstance(v, dict) for v in params.values()):
        raise HFConfigError(f"{where}: per-layer-type rope settings are not supported: {params!r}")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise HFConfigError(f"{where}: rope_type={rope_type!r} is not supported "
                            f"(supported: {', '.join(repr(t) for t in ROPE_TYPES)})")
    cls, names = ROPE_TYPES[rope_type]
    extra = sorted(set(params) - _ALWAYS_ALLOWED - set(names))
    if extra:
        raise HFConfigError(f"{where}: field(s) {extra} are not supported for rope_type={rope_type!r}")
    partial = params.get("partial_rotary_factor", fields.get("partial_rotary_factor", 1.0))
    if float(partial) != 1.0:
        raise HFConfigError(f"{where}: partial_rotary_factor={partial} is not supported (only 1.0)")
    if rope_type == "llama3" and "original_max_position_embeddings" not in params:
        # transformers falls back to max_position_embeddings; so do we
        params = {**params, "original_max_position_embeddings": fields.get("max_position_embeddings")}
    missing = [k for k in names if params.get(k) is None]
    if missing:
        raise HFConfigError(f"{where}: rope_type={rope_type!r} needs field(s) {missing}")
    scaling = cls(**{ours: _number(params[hf], f"{where}.{hf}") for hf, ours in names.items()})
    return _number(params["rope_theta"], f"{where}.rope_theta"), scaling


def rope_to_hf(theta: float, scaling) -> dict:
    """The `rope_parameters` dict transformers 5 reads."""
    for rope_type, (cls, names) in ROPE_TYPES.items():
        if type(scaling) is cls:
            out = {"rope_type": rope_type, "rope_theta": float(theta)}
            out.update({hf: getattr(scaling, ours) for hf, ours in names.items()})
            return out
    raise HFConfigError(f"rope scaling {scaling!r} has no HF equivalent "
                        f"(known: {', '.join(c.__name__ for c, _ in ROPE_TYPES.values())})")


def _number(value, where: str):
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise HFConfigError(f"{where}={value!r} is not a number")
    return value
