"""A bf16 (or f16) matmul, formulated for the backend that runs it.

A low-precision dot accumulates in float32 and rounds its result once to the operands' dtype:
a GPU's bf16 GEMM does that natively. XLA:CPU does not: it runs bf16 x bf16 on its bf16 kernels
(YNNPACK, AVX512-BF16) only when the dot's result is float32; a dot with a bf16 result it widens,
converting both operands to float32 and multiplying in float32, about twice the time of its
bf16 kernels. Written plainly, most of a bf16 model's matmul work on CPU would run that way.

So two formulations of the same numbers (exact products, float32 sums, one rounding):

  "round_once"  the dot asks for a float32 result and rounds it once to the operands' dtype
                (XLA:CPU: the bf16 kernels); `tensordot` does the same in its backward through
                a custom VJP (autodiff of the float32-result dot would hand the backward a
                float32 cotangent, and XLA:CPU would widen those dots again).
  "native"      the dot's result in the operands' dtype (GPUs, TPUs: the GEMM rounds once itself).

`impl="auto"` picks round_once on CPU and native elsewhere (`_common.target_platform`, so
cross-lowering for a GPU from a CPU host compiles the GPU's formulation). float32 operands take
the plain dot either way.
"""
from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp

from jaxtrain.pallas_kernels._common import target_platform

IMPLS = ("auto", "round_once", "native")
_LOW = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def rounds_once(dtype, impl: str = "auto") -> bool:
    """Whether a dot of `dtype` operands asks for a float32 result and rounds it itself."""
    if impl not in IMPLS:
        raise ValueError(f"low_precision_dot: impl must be one of {IMPLS}, got {impl!r}")
    if jnp.dtype(dtype) not in _LOW:
        return False
    return impl == "round_once" or (impl == "auto" and target_platform() == "cpu")


def dot_general(a, b, dimension_numbers, *, impl: str = "auto"):
    """`jax.lax.dot_general(a, b, dims)` of two same-dtype operands, result in their dtype. For
    use inside a custom VJP's rules; a differentiated caller wants `tensordot`."""
    if not rounds_once(a.dtype, impl):
        return jax.lax.dot_general(a, b, dimension_numbers)
    return jax.lax.dot_general(a, b, dimension_numbers, preferred_element_type=jnp.float32).astype(a.dtype)


def tensordot(x, w, n_in: int, *, impl: str = "auto"):
    """`jnp.tensordot(x, w, axes=n_in)` (x's last n_in dims against w's first n_in), x and w of
    one dtype; gradients in the same formulation."""
    if x.dtype != w.dtype:
        raise TypeError(f"low_precision_dot.tensordot: operands of one dtype, got {x.dtype} and {w.dtype}")
    if not rounds_once(x.dtype, impl):
        return jnp.tensordot(x, w, axes=n_in)
    return _rounded_tensordot(x, w, n_in)


def _dims(x_ndim: int, n_in: int):
    return ((tuple(range(x_ndim - n_in, x_ndim)), tuple(range(n_in))), ((), ()))


@partial(jax.custom_vjp, nondiff_argnums=(2,))
def _rounded_tensordot(x, w, n_in):
    return dot_general(x, w, _dims(x.ndim, n_in), impl="round_once")


def _tensordot_fwd(x, w, n_in):
    return _rounded_tensordot(x, w, n_in), (x, w)


def _tensordot_bwd(n_in, residuals, g):
    x, w = residuals
    g = g.astype(x.dtype)
    batch = tuple(range(x.ndim - n_in))
    out_dims = tuple(range(len(batch), g.ndim))
    # dx = g . w^T over w's output dims; dw = x^T . g over the batch dims
    dx = dot_general(g, w, ((out_dims, tuple(range(n_in, w.ndim))), ((), ())), impl="round_once")
    dw = _weight_gradient(x, g, contract=batch, batch=())
    return dx, dw


_rounded_tensordot.defvjp(_tensordot_fwd, _tensordot_bwd)


def _weight_gradient(x, g, *, contract: tuple, batch: tuple):
    """x^T . g over the dimensions `contract` (the same in both), per `batch` index, rounded once.
    XLA:CPU (jaxlib 0.10.2) widens a dot whose lhs contracts one non-minor dimension, even with a
    float32 result (a transpose written first is folded back into the dot); over two contracting
    dimensions (a unit one added) its dot decomposer copies the lhs in bf16 and the dot stays on
    bf16 operands."""
    if len(contract) == 1:
        axis = contract[0]
        x, g, contract = jnp.expand_dims(x, axis), jnp.expand_dims(g, axis), (axis, axis + 1)
    return dot_general(x, g, ((contract, contract), (batch, batch)), impl="round_once")


def batched_matmul(a, w, *, impl: str = "auto"):
    """`[b, n, k] x [b, k, m] -> [b, n, m]`, one matmul per leading index (the capacity
    dispatch's experts), a and w of one dtype; gradients in the same formulation."""
    if a.dtype != w.dtype:
        raise TypeError(f"low_precision_dot.batched_matmul: operands of one dtype, got {a.dtype} and {w.dtype}")
    if not rounds_once(a.dtype, impl):
        return jnp.einsum("bnk,bkm->bnm", a, w)
    return _rounded_batched_matmul(a, w)


_BATCHED = (((2,), (1,)), ((0,), (0,)))


@jax.custom_vjp
def _rounded_batched_matmul(a, w):
    return dot_general(a, w, _BATCHED, impl="round_once")


def _batched_fwd(a, w):
    return _rounded_batched_matmul(a, w), (a, w)


def _batched_bwd(residuals, g):
    a, w = residuals
    g = g.astype(a.dtype)
    da = dot_general(g, w, (((2,), (2,)), ((0,), (0,))), impl="round_once")  # [b,n,m] . [b,k,m]^T
    dw = _weight_gradient(a, g, contract=(1,), batch=(0,))  # [b,n,k]^T . [b,n,m]
    return da, dw


_rounded_batched_matmul.defvjp(_batched_fwd, _batched_bwd)


def inner_dot(prim, params):
    """For a remat policy: when (prim, params) is a rounded `tensordot` or `batched_matmul` (a custom VJP call whose
    primal is one dot and its rounding), (the dot's primitive, its operands' avals, its params),
    so a policy saving matmul outputs saves this one's rounded output as it saved the plain bf16
    dot's; else None. A custom VJP call is opaque to policies otherwise: its output counted as no
    dot's, and remat `dots` recomputed every rounded matmul."""
    if getattr(prim, "name", "") != "custom_vjp_call":
        return None
    call = params.get("call_jaxpr")
    eqns = getattr(getattr(call, "jaxpr", None), "eqns", ())
    if [e.primitive.name for e in eqns] != ["dot_general", "convert_element_type"]:
        return None
    dot = eqns[0]
    return dot.primitive, [v.aval for v in dot.invars], dot.params
