"""Tensor maps and config fields of one HF Mamba-2 mixer, shared by the mamba2 and nemotron_h
families (both use transformers' Mamba-2 mixer layout).

HF fuses the input projections into `in_proj` ([z | x | B | C | dt] rows) and the three convs
into `conv1d` ([x | B | C] channels, weight [channels, 1, kernel]); ours are separate parameters
(models/layers/mamba2.py), so each map takes its rows of the fused tensor (`hf_slice`).
"""
from __future__ import annotations

from typing import Sequence

from jaxtrain.hf.config_fields import HFConfigFields, decode_float, encode_float
from jaxtrain.hf.errors import HFConfigError
from jaxtrain.hf.mapping import TensorMap
from jaxtrain.models.layers.mamba2 import SSMConfig

HEADS = "(heads dim)"
GROUPS = "(groups state)"


def mixer_maps(ours: str, hf: str, ssm: SSMConfig, hf_indices: Sequence[int] | None = None) -> list[TensorMap]:
    """Maps from `hf` + "in_proj.weight" ... (one layer, `{layer}` in `hf`) to `ours` + "in_z/kernel" ..."""
    i, gn, h = ssm.inner, ssm.groups * ssm.state, ssm.heads
    index = {"layer": tuple(hf_indices)} if hf_indices is not None else None
    tm = lambda o, n, pattern="", **kw: TensorMap(ours + o, hf + n, pattern, hf_indices=index, **kw)
    # (our projection, its channel pattern, first HF row, last HF row)
    projections = (("in_z", HEADS, 0, i), ("in_x", HEADS, i, 2 * i), ("in_b", GROUPS, 2 * i, 2 * i + gn),
                   ("in_c", GROUPS, 2 * i + gn, 2 * i + 2 * gn), ("in_dt", "heads", 2 * i + 2 * gn, 2 * i + 2 * gn + h))
    convs = (("conv_x", HEADS, 0, i), ("conv_b", GROUPS, i, i + gn), ("conv_c", GROUPS, i + gn, i + 2 * gn))
    maps = []
    for name, chan, start, stop in projections:
        axes = chan.strip("()")
        maps += [tm(f"{name}/kernel", "in_proj.weight", f"{chan} embed -> embed {axes}", hf_slice=(0, start, stop)),
                 tm(f"{name}/bias", "in_proj.bias", f"{chan} -> {axes}", hf_slice=(0, start, stop), optional=True)]
    for name, chan, start, stop in convs:
        axes = chan.strip("()")
        maps += [tm(f"{name}/kernel", "conv1d.weight", f"{chan} 1 k -> {axes} k", hf_slice=(0, start, stop)),
                 tm(f"{name}/bias", "conv1d.bias", f"{chan} -> {axes}", hf_slice=(0, start, stop), optional=True)]
    maps += [
        tm("dt_bias", "dt_bias"), tm("A_log", "A_log"), tm("D", "D"),
        tm("norm/scale", "norm.weight", f"{HEADS} -> heads dim"),
        tm("out/kernel", "out_proj.weight", f"embed {HEADS} -> heads dim embed"),
        tm("out/bias", "out_proj.bias", optional=True),
    ]
    return maps


def time_step_limit(f: HFConfigFields) -> tuple[float, float | None]:
    """HF `time_step_limit` ([min, max], max may be a tagged Infinity) -> ours (max None = unbounded)."""
    raw = f.get("time_step_limit", (0.0, float("inf")))
    if not isinstance(raw, (list, tuple)) or len(raw) != 2:
        raise HFConfigError(f"{f.where}: time_step_limit={raw!r} must be [min, max]")
    lo, hi = (float(decode_float(v)) for v in raw)
    return lo, (None if hi == float("inf") else hi)


def time_step_limit_to_hf(limit) -> list:
    lo, hi = limit
    return [float(lo), encode_float(float("inf") if hi is None else float(hi))]
