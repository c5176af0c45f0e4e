"""Shared by the kernel files: impl dispatch, Triton params, tiles, masks.

Single-device only: nothing here knows about meshes, models or configs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental.pallas import triton as pl_triton

IMPLS = ("auto", "pallas", "xla")


def target_platform() -> str:
    """Platform we are compiling for.

    An abstract mesh (set by `jax.sharding.use_abstract_mesh` or `jax.set_mesh`)
    wins over the local backend, so cross-lowering for CUDA on a CPU host picks
    the real Triton kernel instead of the CPU interpreter.
    """
    mesh = jax.sharding.get_abstract_mesh()
    device = None if mesh.empty else getattr(mesh, "abstract_device", None)
    if device is not None and device.platform:
        platform = device.platform
        return "gpu" if platform in ("gpu", "cuda", "rocm") else platform
    return jax.default_backend()


def resolve_impl(impl: str, kernel: str) -> tuple[bool, bool]:
    """Returns (use_pallas, interpret) for `impl` in "auto" | "pallas" | "xla"."""
    if impl not in IMPLS:
        raise ValueError(f"{kernel}: impl must be one of {IMPLS}, got {impl!r}")
    on_gpu = target_platform() == "gpu"
    if impl == "xla" or (impl == "auto" and not on_gpu):
        return False, False
    return True, not on_gpu


def segment_ids(seq_idx):
    """[b, l] ids -> int32 ids that start at 0 and grow at every change.

    "Same segment" then means "no change in between", even if an id repeats
    later (e.g. [7, 7, 3, 7] is three segments).
    """
    change = (seq_idx[:, 1:] != seq_idx[:, :-1]).astype(jnp.int32)
    # the first id from seq_idx, not from `change`: for a 1-token sequence `change` is empty
    return jnp.concatenate([jnp.zeros_like(seq_idx[:, :1], jnp.int32), jnp.cumsum(change, axis=1)], axis=1)


def triton_params(num_warps: int, num_stages: int):
    # Explicit Triton params: without them jax 0.10 lowers to Mosaic GPU.
    return pl_triton.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def check_block(kernel: str, name: str, value: int, minimum: int = 1) -> int:
    """Validates a Triton tile size: a power of 2, >= minimum (16 for dots)."""
    value = int(value)
    if value < minimum or value & (value - 1):
        raise ValueError(f"{kernel}: {name} must be a power of 2 >= {minimum} " f"(Triton tiles), got {value}")
    return value


def fit_block(dim: int, preferred: int, minimum: int = 16) -> int:
    """Largest useful power-of-2 block: no bigger than needed to cover `dim`."""
    need = max(minimum, pl_next_pow2(dim))
    return min(preferred, need)


def pl_next_pow2(x: int) -> int:
    return 1 if x <= 1 else 1 << (int(x) - 1).bit_length()


def dot_precision(dtype):
    # Triton's DEFAULT precision for f32 is TF32; f32 callers want f32 accuracy.
    if jnp.dtype(dtype) == jnp.float32:
        return jax.lax.Precision.HIGHEST
    return None


def _outer_mask(row_mask, col_mask, shape):
    """AND of optional 1-D row/col masks, broadcast to `shape` (None: all)."""
    if row_mask is None and col_mask is None:
        return None
    if row_mask is None:
        mask = col_mask[None, :]
    elif col_mask is None:
        mask = row_mask[:, None]
    else:
        mask = row_mask[:, None] & col_mask[None, :]
    return jnp.broadcast_to(mask, shape)


def masked_load(ref, row_mask=None, col_mask=None):
    """Loads a 2-D ref view; masked-off elements read as 0 (no OOB access)."""
    mask = _outer_mask(row_mask, col_mask, ref.shape)
    if mask is None:
        return ref[...]
    return pl_triton.load(ref, mask=mask, other=0)


def masked_store(ref, value, row_mask=None, col_mask=None):
    mask = _outer_mask(row_mask, col_mask, ref.shape)
    pl_triton.store(ref, value.astype(ref.dtype), mask=mask)
