"""The named device mesh: axes `pipeline, data, context, expert, tensor`, outermost first.

Tensor is innermost because its collectives are the most frequent and want the fastest
links; pipeline is outermost because it only sends activations between neighbours and so
tolerates the slowest (cross-node) links. Across several processes the mesh is hybrid: each
axis size factors into an ICI part (within a process) and a DCN part (across processes).
"""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from jaxtrain.meshes.mesh_config import AXES, MeshConfig  # noqa: F401  (re-exported)


def resolve_axis_sizes(config: MeshConfig, num_devices: int) -> dict[str, int]:
    """Axis sizes with the one `-1` filled in; raises ValueError naming the sizes if they don't fit."""
    sizes = config.sizes()
    described = ", ".join(f"{a}={s}" for a, s in sizes.items())
    bad = [a for a, s in sizes.items() if s == 0 or s < -1]
    if bad:
        raise ValueError(f"mesh axis sizes must be positive or -1 (fill); got {described}")
    fill = [a for a, s in sizes.items() if s == -1]
    if len(fill) > 1:
        raise ValueError(f"at most one mesh axis may be -1 (fill the rest); got {described}")
    fixed = math.prod(s for s in sizes.values() if s != -1)
    if fill:
        if num_devices % fixed:
            raise ValueError(
                f"mesh {described}: the fixed axes use {fixed} devices, which does not divide "
                f"the {num_devices} available devices")
        sizes[fill[0]] = num_devices // fixed
    elif fixed != num_devices:
        raise ValueError(
            f"mesh {described} needs {fixed} devices but {num_devices} are available")
    return sizes


def split_over_processes(sizes: dict[str, int], num_processes: int,
                         dcn: Sequence[int] | None) -> tuple[list[int], list[int]]:
    """Factor each axis into (ICI within a process) x (DCN across processes).

    With no explicit `dcn`, processes are spread over the outermost axes first (pipeline,
    then data, ...), which keeps tensor, expert and context traffic inside a node.
    """
    if dcn is not None:
        dcn = list(dcn)
        if len(dcn) != len(AXES) or math.prod(dcn) != num_processes:
            raise ValueError(
                f"dcn sizes {tuple(dcn)} must give one factor per axis {AXES} whose product "
                f"equals the {num_processes} processes")
    else:
        dcn, left = [], num_processes
        for axis in AXES:
            factor = math.gcd(sizes[axis], left)
            dcn.append(factor)
            left //= factor
        if left != 1:
            raise ValueError(
                f"cannot spread {num_processes} processes over mesh axes {sizes}: no axis "
                f"combination is divisible by the process count")
    ici = []
    for axis, d in zip(AXES, dcn):
        if sizes[axis] % d:
            raise ValueError(f"mesh axis {axis}={sizes[axis]} is not divisible by its DCN factor {d}")
        ici.append(sizes[axis] // d)
    return ici, dcn


def build_mesh(config: MeshConfig, devices: Sequence | None = None):
    """A `jax.sharding.Mesh` with Auto axis types (GSPMD propagation) from a MeshConfig."""
    import jax
    from jax.experimental import mesh_utils
    from jax.sharding import AxisType, Mesh

    devices = list(devices) if devices is not None else jax.devices()
    sizes = resolve_axis_sizes(config, len(devices))
    shape = [sizes[a] for a in AXES]
    num_processes = len({d.process_index for d in devices})
    if num_processes > 1:
        ici, dcn = split_over_processes(sizes, num_processes, config.dcn)
        device_array = mesh_utils.create_hybrid_device_mesh(
            ici, dcn, devices, process_is_granule=True)
    else:
        try:
            device_array = mesh_utils.create_device_mesh(shape, devices, allow_split_physical_axes=True)
        except (ValueError, NotImplementedError, AssertionError):
            device_array = np.asarray(devices).reshape(shape)
    return Mesh(device_array, AXES, axis_types=(AxisType.Auto,) * len(AXES))


def describe(mesh) -> str:
    return " x ".join(f"{a}={n}" for a, n in mesh.shape.items())
