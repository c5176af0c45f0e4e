"""Run a single-device kernel on each device's shard of its operands.

A Pallas kernel is an opaque custom call to XLA's SPMD partitioner, which cannot split it; so
under a mesh the model calls such kernels through `per_shard`, a `shard_map` whose specs come
from the operands' logical names and the active rule table. Dimensions the kernel needs whole
(the sequence, for a scan) are left unsplit: XLA gathers them before the call.
"""
from __future__ import annotations

from typing import Callable, Sequence

import jax
from jax.sharding import NamedSharding, PartitionSpec

from jaxtrain.meshes.rules import _ACTIVE, spec_for

Names = Sequence[str | None]


def per_shard(fn: Callable, args: Sequence, arg_names: Sequence[Names | None], out_names: Names,
              whole: Sequence[str] = ("length",)):
    """fn(*args) on every device's shard; `None` names an argument passed whole (or absent). A fn
    returning a tuple names each output: `out_names` is then a tuple of names."""
    active = _ACTIVE.get()
    if active is None:
        return fn(*args)
    mesh, rules = active
    table = {k: v for k, v in rules.activations.items() if k not in whole}
    specs = [None if a is None else PartitionSpec() if n is None else spec_for(n, a.shape, table, mesh)
             for a, n in zip(args, arg_names)]
    out_shape = jax.eval_shape(fn, *args)
    if isinstance(out_shape, tuple):  # several outputs: `out_names` names each one
        out_spec = tuple(spec_for(n, o.shape, table, mesh) for n, o in zip(out_names, out_shape, strict=True))
    else:
        out_spec = spec_for(out_names, out_shape.shape, table, mesh)
    placed = [None if a is None else jax.lax.with_sharding_constraint(a, NamedSharding(mesh, s))
              for a, s in zip(args, specs)]
    present = [i for i, a in enumerate(args) if a is not None]

    def local(*xs):
        full = [None] * len(args)
        for i, x in zip(present, xs):
            full[i] = x
        return fn(*full)

    # check_vma=False: a pallas_call's outputs carry no varying-axes annotation (and a kernel
    # must not know the mesh); tests/test_model_kernels.py checks gradients under a mesh.
    return jax.shard_map(local, mesh=mesh, in_specs=tuple(specs[i] for i in present), out_specs=out_spec,
                         check_vma=False)(*[placed[i] for i in present])
