"""Mamba-2 mixer: input projections, short causal conv, SSD scan, gated group norm, output.

    z, x, B, C, dt = projections of the input          (x, z: heads x head_dim; B, C: groups x state)
    x, B, C        = silu(causal depthwise conv)          (window restarts at packed-document starts)
    dt             = clamp(softplus(dt + dt_bias), time_step_limit)
    y              = SSD(x, dt, A = -exp(A_log), B, C) + D * x   (state restarts at document starts)
    out            = out_proj(gated_group_rmsnorm(y, z))

HF fuses the five projections into one `in_proj` and the three convs into one `conv1d`; here each
is its own parameter with logical axes (ssm_heads / ssm_groups), so a rule table can split heads
and groups over `tensor` like attention heads. The conv and the scan are called in one place
each (`ShortConv.__call__`, `Mamba2Mixer._scan`), where the Pallas kernels take over on GPU.

Generation (models/layers/decode_cache.py): the cache is the SSM state [b, heads, head_dim, state]
and each conv's last conv_kernel - 1 inputs, whatever max_len. Prefill is the training forward
(the scan dispatch returns the final state; left pads are another segment, so the state and the
conv windows start at the prompt); decode is one window dot per conv and one recurrence step.
"""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import nnx

from jaxtrain.meshes.context_layout import context_size
from jaxtrain.meshes.context_ssm import context_causal_conv, context_ssd_scan
from jaxtrain.meshes.per_shard import per_shard
from jaxtrain.meshes.rules import constrain
from jaxtrain.models.layers.decode_cache import LayerCache
from jaxtrain.models.layers.dense import Dense
from jaxtrain.models.layers.gated_norm import GatedGroupRMSNorm
from jaxtrain.models.layers.params import LOGICAL_AXES, OPTIMIZER, param
from jaxtrain.pallas_kernels.causal_conv1d import causal_conv1d
from jaxtrain.pallas_kernels.ssd_scan import ssd_scan

PER_HEAD = ("batch", "length", "ssm_heads", None)
PER_GROUP = ("batch", "length", "ssm_groups", None)
STATE = ("batch", "ssm_heads", None, None)  # the recurrent state [b, heads, head_dim, state]
WINDOW = {"conv_x": ("batch", None, "ssm_heads", None), "conv_b": ("batch", None, "ssm_groups", None),
          "conv_c": ("batch", None, "ssm_groups", None)}  # conv caches [b, conv_kernel - 1, heads|groups, ...]


@dataclasses.dataclass(frozen=True)
class SSMConfig:
    """Shape and numerics of one Mamba-2 mixer (HF names in comments)."""
    heads: int = 8  # mamba_num_heads / num_heads
    head_dim: int = 16  # mamba_head_dim / head_dim
    state: int = 16  # ssm_state_size / state_size
    groups: int = 1  # n_groups: heads share B and C within a group
    conv_kernel: int = 4
    chunk_size: int = 128  # SSD chunk; any length works, a power of 2 >= 16 for the Pallas kernel
    time_step_limit: tuple = (0.0, None)  # dt clamp after softplus; None = unbounded above
    conv_bias: bool = True  # use_conv_bias
    proj_bias: bool = False  # use_bias: biases on the input and output projections
    dt_init_range: tuple = (0.001, 0.1)  # init only: dt log-uniform in this range
    dt_init_floor: float = 1e-4

    @property
    def inner(self) -> int:
        return self.heads * self.head_dim

    def validate(self, owner: str) -> None:
        """Semantic checks. Heads and groups over the mesh are the rule tables' check (meshes/rules.py:
        `ssm_heads` must divide, `ssm_groups` must divide unless there is one group)."""
        for name in ("heads", "head_dim", "state", "groups", "conv_kernel", "chunk_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{owner}.ssm.{name} must be positive, got {getattr(self, name)}")
        if self.heads % self.groups:
            raise ValueError(f"{owner}.ssm.heads={self.heads} is not a multiple of ssm.groups={self.groups}")
        lo, hi = self.time_step_limit
        if lo < 0 or (hi is not None and hi <= lo):
            raise ValueError(f"{owner}.ssm.time_step_limit={self.time_step_limit} must be (min >= 0, max > min "
                             f"or None)")

    def param_count(self, embed: int) -> int:
        bc = 2 * self.groups * self.state
        proj = embed * (2 * self.inner + bc + self.heads) + self.inner * embed
        proj_bias = (2 * self.inner + bc + self.heads + embed) if self.proj_bias else 0
        conv = (self.inner + bc) * (self.conv_kernel + (1 if self.conv_bias else 0))
        return proj + proj_bias + conv + 3 * self.heads + self.inner  # A_log, D, dt_bias; norm scale

    def matmul_params(self, embed: int) -> int:
        return embed * (3 * self.inner + 2 * self.groups * self.state + self.heads)

    def scan_flops_per_token(self) -> float:
        """Training FLOPs per token of the chunked scan (forward x 3), multiply-adds x 2:
        intra-chunk C.B scores per group and score @ x per head (causal half of each chunk, as
        attention counts its causal half), and per head the chunk-state write (x ⊗ B) and the
        state read (state @ C). The chunk-to-chunk recurrence is O(1/chunk) of that and left out."""
        lc, n, p = self.chunk_size, self.state, self.head_dim
        forward = self.groups * lc * n + self.heads * lc * p + 4 * self.heads * p * n
        return 3.0 * forward


def _uniform(bound: float):
    return lambda key, shape, dtype: jax.random.uniform(key, shape, dtype, -bound, bound)


class ShortConv(nnx.Module):
    """Depthwise causal conv + SiLU over channels of shape `channels` (e.g. heads x head_dim)."""

    def __init__(self, channels: tuple[int, ...], axes: tuple[str, ...], kernel_size: int, *, rngs: nnx.Rngs,
                 use_bias: bool):
        init = _uniform(1.0 / math.sqrt(kernel_size))  # PyTorch's conv default (fan-in = kernel size)
        self.kernel = param(rngs, init, tuple(channels) + (kernel_size,), tuple(axes) + ("conv_kernel",))
        self.bias = param(rngs, init, tuple(channels), tuple(axes), optimizer="no_decay") if use_bias else None

    def __call__(self, x, segment_ids, kernels: str):
        b, l = x.shape[:2]
        flat = x.reshape(b, l, -1)
        width = flat.shape[-1]
        bias = None if self.bias is None else self.bias[...].reshape(width)
        # Channels are (heads or groups) x inner dim, flattened head-major, so splitting the flat
        # width like the heads keeps each device's channels whole.
        channel = self.kernel.get_metadata()[LOGICAL_AXES][0]
        conv = lambda v, w, bb, seg: causal_conv1d(v, w, bb, activation="silu", seq_idx=seg, impl=kernels)
        weight = self.kernel[...].reshape(width, -1)
        if context_size() > 1:  # the sequence stays split; each chunk borrows its predecessor's tail
            return context_causal_conv(conv, flat, weight, bias, segment_ids, channel).reshape(x.shape)
        y = per_shard(conv, (flat, weight, bias, segment_ids),
                      (("batch", "length", channel), (channel, None), (channel,), ("batch", "length")),
                      ("batch", "length", channel))
        return y.reshape(x.shape)

    # Generation (models/layers/decode_cache.py): the conv's cache is its last kernel - 1 inputs.
    def window(self, x, segment_ids, dtype):
        """The last kernel - 1 inputs of each left-padded row x [b, P, ...], zero where they are not
        the row's last segment (pads; before t = 0): what the conv would read for the next token."""
        k = self.kernel.shape[-1] - 1
        ours = (segment_ids == segment_ids[:, -1:]).reshape(segment_ids.shape + (1,) * (x.ndim - 2))
        kept = jnp.where(ours, x, jnp.zeros((), x.dtype)).astype(dtype)
        padded = jnp.pad(kept, [(0, 0), (max(k - x.shape[1], 0), 0)] + [(0, 0)] * (x.ndim - 2))
        return padded[:, padded.shape[1] - k:]

    def step(self, window, x):
        """One new input x [b, 1, ...] against the window [b, kernel - 1, ...]: (silu(conv) [b, 1, ...]
        in x's dtype, the window shifted by one). The conv is one dot over the kernel's taps."""
        full = jnp.concatenate([window, x.astype(window.dtype)], axis=1)  # [b, kernel, ...]
        taps = jnp.moveaxis(self.kernel[...].astype(jnp.float32), -1, 0)  # [kernel, ...channels]
        z = jnp.einsum("bk...,k...->b...", full.astype(jnp.float32), taps)
        if self.bias is not None:
            z = z + self.bias[...].astype(jnp.float32)
        return jax.nn.silu(z)[:, None].astype(x.dtype), full[:, 1:]


def _dt_bias_init(cfg: SSMConfig):
    """softplus^-1 of dt drawn log-uniform in dt_init_range (floored), so softplus(dt_bias)
    starts in that range."""
    lo, hi = cfg.dt_init_range

    def init(key, shape, dtype):
        u = jax.random.uniform(key, shape, jnp.float32)
        dt = jnp.maximum(jnp.exp(u * (math.log(hi) - math.log(lo)) + math.log(lo)), cfg.dt_init_floor)
        return (dt + jnp.log(-jnp.expm1(-dt))).astype(dtype)
    return init


def _a_log_init(key, shape, dtype):
    return jnp.log(jax.random.uniform(key, shape, jnp.float32, 1.0, 16.0)).astype(dtype)


class Mamba2Mixer(nnx.Module):
    """(x[b, l, embed], segment_ids[b, l]) -> [b, l, embed]."""

    def __init__(self, embed: int, cfg: SSMConfig, *, rngs: nnx.Rngs, norm_eps: float = 1e-5,
                 init_std: float = 0.02, dtype=jnp.float32, kernels: str = "xla"):
        self.cfg, self.kernels = cfg, kernels
        h, p, g, n = cfg.heads, cfg.head_dim, cfg.groups, cfg.state
        kw = dict(rngs=rngs, use_bias=cfg.proj_bias, init_std=init_std, dtype=dtype)
        heads_out = dict(in_axes=("embed",), out_axes=("ssm_heads", "ssm_head_dim"), **kw)
        groups_out = dict(in_axes=("embed",), out_axes=("ssm_groups", "ssm_state"), **kw)
        self.in_z = Dense((embed,), (h, p), **heads_out)
        self.in_x = Dense((embed,), (h, p), **heads_out)
        self.in_b = Dense((embed,), (g, n), **groups_out)
        self.in_c = Dense((embed,), (g, n), **groups_out)
        self.in_dt = Dense((embed,), (h,), in_axes=("embed",), out_axes=("ssm_heads",), **kw)
        conv = dict(rngs=rngs, use_bias=cfg.conv_bias)
        self.conv_x = ShortConv((h, p), ("ssm_heads", "ssm_head_dim"), cfg.conv_kernel, **conv)
        self.conv_b = ShortConv((g, n), ("ssm_groups", "ssm_state"), cfg.conv_kernel, **conv)
        self.conv_c = ShortConv((g, n), ("ssm_groups", "ssm_state"), cfg.conv_kernel, **conv)
        # no weight decay, as in mamba_ssm (_no_weight_decay) and Megatron: decay would pull A_log, D and
        # dt_bias toward 0, i.e. toward A = -1, no skip and a fixed step size, not toward a smaller model
        per_head = {LOGICAL_AXES: ("ssm_heads",), OPTIMIZER: "no_decay"}
        self.dt_bias = nnx.Param(_dt_bias_init(cfg)(rngs.params(), (h,), jnp.float32), **per_head)
        self.A_log = nnx.Param(_a_log_init(rngs.params(), (h,), jnp.float32), **per_head)
        self.D = nnx.Param(jnp.ones((h,), jnp.float32), **per_head)
        self.norm = GatedGroupRMSNorm(h, p, g, rngs=rngs, eps=norm_eps)
        self.out = Dense((h, p), (embed,), in_axes=("ssm_heads", "ssm_head_dim"), out_axes=("embed",), **kw)

    def __call__(self, x, segment_ids):
        z, (xs, b, c), dt = self._project(x)
        xs, b, c = self._conv(xs, b, c, segment_ids)
        y, _ = self._scan(xs, dt, b, c, segment_ids, final_state=False)
        return self.out(self.norm(constrain(y, PER_HEAD), z))

    def _project(self, x):
        """z, the conv inputs (x, B, C) and dt = clamp(softplus(. + dt_bias)) of x [b, l, embed]."""
        z = constrain(self.in_z(x), PER_HEAD)
        pre = (constrain(self.in_x(x), PER_HEAD), constrain(self.in_b(x), PER_GROUP),
               constrain(self.in_c(x), PER_GROUP))
        dt = jax.nn.softplus(self.in_dt(x).astype(jnp.float32) + self.dt_bias[...])
        lo, hi = self.cfg.time_step_limit
        return z, pre, constrain(jnp.clip(dt, lo, hi), ("batch", "length", "ssm_heads"))

    def _conv(self, xs, b, c, segment_ids):
        k = self.kernels
        return (constrain(self.conv_x(xs, segment_ids, k), PER_HEAD),
                constrain(self.conv_b(b, segment_ids, k), PER_GROUP),
                constrain(self.conv_c(c, segment_ids, k), PER_GROUP))

    def _scan(self, x, dt, b, c, segment_ids, final_state: bool):
        """The SSD scan (the Pallas kernel on GPU); states restart where segment_ids change.
        -> (y, the state after the last token [b, heads, head_dim, state] f32, or None)."""
        def scan(x, dt, a, b, c, d, seg):  # -> (y, final_states)
            return ssd_scan(x, dt, a, b, c, chunk_size=self.cfg.chunk_size, D=d, seq_idx=seg, impl=self.kernels)

        a = -jnp.exp(self.A_log[...])
        if context_size() > 1:  # the sequence stays split; states pass between context ranks
            if final_state:
                raise ValueError("Mamba-2 prefill under context parallelism is not supported: generate with a "
                                 "layout whose context axis is 1")
            return context_ssd_scan(scan, x, dt, a, b, c, self.D[...], segment_ids), None
        heads, groups = ("batch", "length", "ssm_heads", None), ("batch", "length", "ssm_groups", None)
        args = (x, dt, a, b, c, self.D[...], segment_ids)
        names = (heads, ("batch", "length", "ssm_heads"), ("ssm_heads",), groups, groups, ("ssm_heads",),
                 ("batch", "length"))
        if final_state:
            return per_shard(scan, args, names, (heads, STATE))
        return per_shard(lambda *a: scan(*a)[0], args, names, heads), None

    # Generation (models/layers/decode_cache.py): constant-size cache, whatever max_len.
    def init_cache(self, batch: int, max_len: int, dtype):
        """The SSM state (float32: a recurrence accumulates over every generated token) and each
        conv's last conv_kernel - 1 inputs (in `dtype`). `max_len` changes nothing."""
        cfg = self.cfg
        h, p, g, n, w = cfg.heads, cfg.head_dim, cfg.groups, cfg.state, cfg.conv_kernel - 1
        zeros = lambda shape, names, dt: constrain(jnp.zeros(shape, dt), names)
        return {"state": zeros((batch, h, p, n), STATE, jnp.float32),
                "conv_x": zeros((batch, w, h, p), WINDOW["conv_x"], dtype),
                "conv_b": zeros((batch, w, g, n), WINDOW["conv_b"], dtype),
                "conv_c": zeros((batch, w, g, n), WINDOW["conv_c"], dtype)}

    def prefill(self, x, positions, segment_ids, cache):
        """The training forward over the left-padded prompt (pads are segment 0, so the conv window
        and the state restart at the prompt's first token); its final state and conv inputs fill the cache."""
        z, (xs, b, c), dt = self._project(x)
        window = lambda conv, v, key: constrain(conv.window(v, segment_ids, cache[key].dtype), WINDOW[key])
        new = {"conv_x": window(self.conv_x, xs, "conv_x"), "conv_b": window(self.conv_b, b, "conv_b"),
               "conv_c": window(self.conv_c, c, "conv_c")}
        xs, b, c = self._conv(xs, b, c, segment_ids)
        y, state = self._scan(xs, dt, b, c, segment_ids, final_state=True)
        new["state"] = constrain(state.astype(jnp.float32), STATE)
        return self.out(self.norm(constrain(y, PER_HEAD), z)), new

    def decode(self, x, positions, cache, index, valid_from):
        """One token per row x [b, 1, embed]: one conv window step and one recurrence step,
        s = exp(dt A) s + dt x (x) B,  y = C . s + D x. Positions, index and valid_from are not
        needed: the state already holds exactly the row's tokens."""
        view = LayerCache.of(cache)  # inside a stack: this layer of the stacked cache, updated in place
        z, (xs, b, c), dt = self._project(x)
        xs, wx = self.conv_x.step(view.read("conv_x"), xs)
        b, wb = self.conv_b.step(view.read("conv_b"), b)
        c, wc = self.conv_c.step(view.read("conv_c"), c)
        hpg = self.cfg.heads // self.cfg.groups
        f32 = lambda v: v[:, 0].astype(jnp.float32)
        x1, dt1 = f32(xs), dt[:, 0]  # [b, h, p], [b, h]
        b1, c1 = jnp.repeat(f32(b), hpg, axis=1), jnp.repeat(f32(c), hpg, axis=1)  # [b, h, n]
        decay = jnp.exp(dt1 * -jnp.exp(self.A_log[...]))
        state = decay[..., None, None] * view.read("state") + (dt1[..., None] * x1)[..., None] * b1[:, :, None, :]
        state = constrain(state, STATE)
        y = jnp.einsum("bhpn,bhn->bhp", state, c1) + self.D[...][:, None] * x1
        y = constrain(y[:, None].astype(xs.dtype), PER_HEAD)
        view = (view.replace("state", state, STATE).replace("conv_x", wx, WINDOW["conv_x"])
                .replace("conv_b", wb, WINDOW["conv_b"]).replace("conv_c", wc, WINDOW["conv_c"]))
        return self.out(self.norm(y, z)), view.like(cache)

