"""Memory-efficient (flash) attention: one API over three implementations.

  impl="reference"  materializes the [l, s] scores (flash_attention_reference.py): the yardstick
  impl="xla"        blockwise pure JAX: online softmax over key blocks, fully masked blocks
                    skipped, O(l * block) memory forward and backward (flash_attention_xla.py)
  impl="pallas"     Triton kernels, forward and backward (flash_attention_pallas.py); on CPU
                    they run in interpret mode
  impl="auto"       Pallas on GPU, blockwise XLA elsewhere

Masks come from token places and segment ids (see flash_attention_reference.py), so a context
rank's slice, a load-balanced order or a ring block all use the same functions. The forward
returns float32 (out, lse) so partial results over disjoint key blocks merge exactly
(`merge_partials`); the backward takes the saved (out, lse) — possibly over more keys than it is
given, as ring attention needs — and returns (dq, dk, dv).

Single-device: nothing here knows about meshes (meshes/context.py runs these per shard).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxtrain.pallas_kernels import _common
from jaxtrain.pallas_kernels.flash_attention_reference import (  # noqa: F401  (re-exported)
    NO_KEYS,
    attention_backward_reference,
    attention_reference,
    check_shapes,
    merge_partials,
)

_NAME = "flash_attention"
IMPLS = ("auto", "pallas", "xla", "reference")


def _backend(impl: str):
    """The module implementing `forward`/`backward` for `impl`, and whether to interpret."""
    if impl not in IMPLS:
        raise ValueError(f"{_NAME}: impl must be one of {IMPLS}, got {impl!r}")
    if impl == "reference":
        return None, False
    use_pallas, interpret = _common.resolve_impl(impl, _NAME)
    if use_pallas:
        from jaxtrain.pallas_kernels import flash_attention_pallas as backend
        return backend, interpret
    from jaxtrain.pallas_kernels import flash_attention_xla as backend
    return backend, False


def default_index(length: int):
    return jnp.arange(length, dtype=jnp.int32)


def attention_forward(q, k, v, q_segment, kv_segment, q_index, kv_index, *, scale: float, impl: str = "auto",
                      block_q: int | None = None, block_k: int | None = None):
    """(out [b, l, h, dv] float32, lse [b, h, l] float32)."""
    check_shapes(_NAME, q, k, v, q_segment, kv_segment, q_index, kv_index)
    backend, interpret = _backend(impl)
    if backend is None:
        return attention_reference(q, k, v, q_segment, kv_segment, q_index, kv_index, scale=scale)
    return backend.forward(q, k, v, q_segment, kv_segment, q_index, kv_index, scale=scale, block_q=block_q,
                           block_k=block_k, interpret=interpret)


def attention_backward(q, k, v, q_segment, kv_segment, q_index, kv_index, out, lse, dout, *, scale: float,
                       impl: str = "auto", block_q: int | None = None, block_k: int | None = None):
    """(dq, dk, dv) in the dtypes of q, k, v, from the saved (out, lse) and the output cotangent."""
    backend, interpret = _backend(impl)
    if backend is None:
        return attention_backward_reference(q, k, v, q_segment, kv_segment, q_index, kv_index, out, lse, dout,
                                            scale=scale)
    return backend.backward(q, k, v, q_segment, kv_segment, q_index, kv_index, out, lse, dout, scale=scale,
                            block_q=block_q, block_k=block_k, interpret=interpret)


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8, 9, 10))
def _flash(q, k, v, q_segment, kv_segment, q_index, kv_index, scale, impl, block_q, block_k):
    out, _ = attention_forward(q, k, v, q_segment, kv_segment, q_index, kv_index, scale=scale, impl=impl,
                               block_q=block_q, block_k=block_k)
    return out.astype(q.dtype)


def _flash_fwd(q, k, v, q_segment, kv_segment, q_index, kv_index, scale, impl, block_q, block_k):
    out, lse = attention_forward(q, k, v, q_segment, kv_segment, q_index, kv_index, scale=scale, impl=impl,
                                 block_q=block_q, block_k=block_k)
    out = out.astype(q.dtype)
    return out, (q, k, v, q_segment, kv_segment, q_index, kv_index, out, lse)


def _flash_bwd(scale, impl, block_q, block_k, res, dout):
    q, k, v, q_segment, kv_segment, q_index, kv_index, out, lse = res
    dq, dk, dv = attention_backward(q, k, v, q_segment, kv_segment, q_index, kv_index, out, lse, dout, scale=scale,
                                    impl=impl, block_q=block_q, block_k=block_k)
    return dq, dk, dv, None, None, None, None


_flash.defvjp(_flash_fwd, _flash_bwd)


def flash_attention(q, k, v, q_segment, kv_segment, q_index=None, kv_index=None, *, scale: float,
                    impl: str = "auto", block_q: int | None = None, block_k: int | None = None):
    """Differentiable attention -> out [b, l, h, dv] in q's dtype. `q_index`/`kv_index` default to
    0..len-1 (one contiguous causal sequence)."""
    q_index = default_index(q.shape[1]) if q_index is None else q_index
    kv_index = default_index(k.shape[1]) if kv_index is None else kv_index
    check_shapes(_NAME, q, k, v, q_segment, kv_segment, q_index, kv_index)
    _backend(impl)  # an unknown impl fails here, before tracing
    return _flash(q, k, v, q_segment, kv_segment, q_index.astype(jnp.int32), kv_index.astype(jnp.int32),
                  float(scale), impl, block_q, block_k)
