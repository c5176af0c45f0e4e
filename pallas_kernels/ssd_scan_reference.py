"""XLA forms of the Mamba-2 SSD scan (the math is in ssd_scan.py's docstring).

`ssd_scan_reference`: the chunked form in float32 XLA, O(l x chunk) memory; the path off GPU
and the Pallas kernels' reference. `ssd_scan_naive`: the token-by-token recurrence, for tests.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from jaxtrain.pallas_kernels import _common

_F32 = jnp.float32


def padded_segment_ids(seq_idx, length):
    """Change-counting ids (see _common.segment_ids), edge-padded to `length`.

    Padding repeats the last id, so padded tokens never look like a restart.
    """
    seg = _common.segment_ids(seq_idx)
    return jnp.pad(seg, ((0, 0), (0, length - seg.shape[1])), mode="edge")


def pad_time(a, length):
    pad = [(0, 0)] * a.ndim
    pad[1] = (0, length - a.shape[1])
    return jnp.pad(a, pad)


# ----------------------------------------------------------------------------
# References.


def ssd_scan_reference(x, dt, A, B, C, *, chunk_size, D=None, initial_states=None, seq_idx=None):
    """Chunked SSD in XLA (f32 math). Memory O(l * chunk_size), not O(l^2)."""
    b, l, h, p = x.shape
    g, n = B.shape[2:]
    hpg = h // g
    lc = chunk_size
    nc = pl.cdiv(l, lc)
    lp = nc * lc

    def chunked(a):
        a = pad_time(a.astype(_F32), lp)
        return a.reshape(b, nc, lc, *a.shape[2:])

    xc = chunked(x).reshape(b, nc, lc, g, hpg, p)
    dtc = chunked(dt).reshape(b, nc, lc, g, hpg)
    bc, cc = chunked(B), chunked(C)  # [b, nc, lc, g, n]
    acum = jnp.cumsum(dtc * A.astype(_F32).reshape(g, hpg), axis=2)
    last = acum[:, :, -1]  # [b, nc, g, hpg]
    causal = jnp.tril(jnp.ones((lc, lc), bool))
    if seq_idx is None:
        same = causal  # [i, j]
        from_prev = from_here = carry = jnp.ones((), bool)
    else:
        seg = padded_segment_ids(seq_idx, lp).reshape(b, nc, lc)
        seg_in = jnp.concatenate([jnp.zeros_like(seg[:, :1, -1]), seg[:, :-1, -1]], axis=1)  # [b, nc]
        same = causal & (seg[..., :, None] == seg[..., None, :])  # [b,nc,i,j]
        same = same[:, :, None, None]
        from_prev = (seg == seg_in[..., None])[..., None, None]  # [b,nc,lc,1,1]
        from_here = (seg == seg[..., -1:])[..., None, None]
        carry = (seg[..., -1] == seg_in)[..., None, None]  # [b, nc, 1, 1]

    # Intra-chunk (quadratic within a chunk only).
    cb = jnp.einsum("bcign,bcjgn->bcgij", cc, bc)
    a_h = jnp.moveaxis(acum, 2, -1)  # [b, nc, g, hpg, lc]
    decay = jnp.exp(jnp.where(same, a_h[..., :, None] - a_h[..., None, :], -jnp.inf))
    mix = cb[:, :, :, None] * decay * jnp.moveaxis(dtc, 2, -1)[..., None, :]
    y = jnp.einsum("bcgkij,bcjgkp->bcigkp", mix, xc)

    # Per-chunk states, then the sequential pass over chunks.
    w = jnp.exp(last[:, :, None] - acum) * dtc * from_here
    states = jnp.einsum("bcjgk,bcjgkp,bcjgn->bcgkpn", w, xc, bc)
    chunk_decay = jnp.exp(last) * carry
    if initial_states is None:
        # zeros_like (not zeros): inside shard_map the carry must vary over the mesh like `states`.
        init = jnp.zeros_like(states[:, 0])
    else:
        init = initial_states.astype(_F32).reshape(b, g, hpg, p, n)

    def step(s, inputs):
        st, dc = inputs
        return dc[..., None, None] * s + st, s

    final, s_in = jax.lax.scan(step, init, (jnp.moveaxis(states, 1, 0), jnp.moveaxis(chunk_decay, 1, 0)))
    s_in = jnp.moveaxis(s_in, 0, 1)  # state entering each chunk
    y = y + jnp.einsum("bcign,bcgkpn->bcigkp", cc, s_in) * (jnp.exp(acum) * from_prev)[..., None]
    if D is not None:
        y = y + D.astype(_F32).reshape(g, hpg)[:, :, None] * xc
    y = y.reshape(b, lp, h, p)[:, :l].astype(x.dtype)
    return y, final.reshape(b, h, p, n)


def ssd_scan_naive(x, dt, A, B, C, *, D=None, initial_states=None, seq_idx=None):
    """Token-by-token lax.scan of the recurrence (f32). For tests only."""
    b, l, h, p = x.shape
    g, n = B.shape[2:]
    f32 = lambda a: a.astype(_F32)
    bh = jnp.repeat(f32(B), h // g, axis=2)
    ch = jnp.repeat(f32(C), h // g, axis=2)
    if seq_idx is None:
        keep = jnp.ones((b, l), _F32)
    else:
        keep = jnp.concatenate([jnp.ones((b, 1), bool), seq_idx[:, 1:] == seq_idx[:, :-1]], axis=1)
        keep = keep.astype(_F32)
    s0 = jnp.zeros((b, h, p, n), _F32) if initial_states is None else f32(initial_states)

    def step(s, inputs):
        xt, dtt, bt, ct, kt = inputs
        da = jnp.exp(dtt * f32(A)) * kt[:, None]
        s = da[..., None, None] * s + (dtt[..., None] * xt)[..., None] * bt[:, :, None, :]
        return s, jnp.einsum("bhpn,bhn->bhp", s, ct)

    seq = lambda a: jnp.moveaxis(a, 1, 0)
    final, y = jax.lax.scan(step, s0, (seq(f32(x)), seq(f32(dt)), seq(bh), seq(ch), seq(keep)))
    y = jnp.moveaxis(y, 0, 1)
    if D is not None:
        y = y + f32(D)[:, None] * f32(x)
    return y.astype(x.dtype), final
