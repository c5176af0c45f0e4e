"""Lower a function for an NVIDIA GPU from any host, without a GPU.

Tests and benchmarks use this to run the Pallas -> Triton lowering (which
enforces Triton's rules: power-of-2 shapes, supported primitives) on CPU CI.
It stops at the serialized Triton IR; PTX compilation still needs a real GPU.
The one-device abstract mesh only names the target device kind.
"""

from __future__ import annotations

import jax

# device_kind strings as the CUDA runtime reports them.
GPU_DEVICE_KINDS = {
    "H100": "NVIDIA H100 80GB HBM3",
    "H200": "NVIDIA H200",
}
_NUM_SMS = 132
TRITON_CALL_TARGET = "xla.gpu.triton"


def lower_for_gpu(fn, *args, device_kind: str = GPU_DEVICE_KINDS["H100"], **kwargs) -> str:
    """StableHLO text of `jax.jit(fn)` lowered for CUDA on `device_kind`.

    `args` may be `jax.ShapeDtypeStruct`s. Raises whatever the Triton lowering
    raises (e.g. ValueError for a non-power-of-2 block).
    """
    device = jax.sharding.AbstractDevice(device_kind=device_kind, num_cores=_NUM_SMS, platform="gpu")
    # Auto axes, as jax's default was before it became Explicit: the kernels' wrappers make
    # arrays without sharding annotations, which Explicit axes would have to type.
    mesh = jax.sharding.AbstractMesh((1,), ("gpu",), axis_types=(jax.sharding.AxisType.Auto,), abstract_device=device)
    with jax.sharding.use_abstract_mesh(mesh):
        traced = jax.jit(fn).trace(*args, **kwargs)
        lowered = traced.lower(lowering_platforms=("cuda",))
    return lowered.as_text()


def count_triton_kernels(hlo_text: str) -> int:
    return hlo_text.count(TRITON_CALL_TARGET)
