"""The planner's update phase (memory_model.update_phase) against XLA's temp memory of the
guarded optimizer update compiled alone (as benchmarks/update_memory.py does), on abstract
arrays of a mid-size Llama: nothing is allocated, each layout compiles in a second or two."""
from __future__ import annotations

import dataclasses

import jax
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from jaxtrain.planner.memory_model import update_phase
from jaxtrain.planner.state_bytes import state_bytes, state_shapes
from jaxtrain.training.optim import OptimizerConfig
from jaxtrain.training.parallel_plan import ParallelPlan
from jaxtrain.training.step import make_update
from jaxtrain.training.train_setup import build_train_setup
from jaxtrain.training.config import TrainConfig
from jaxtrain.meshes.mesh import MeshConfig
from jaxtrain.meshes.rules import get_rule_set, use_rules
from jaxtrain.models.llama import LlamaConfig

pytestmark = [pytest.mark.fast]

# Leaves of different sizes (embedding, MLP, attention), large enough that the update's scalars
# and masks are noise: 4 layers, ~60 M parameters.
MODEL = LlamaConfig(vocab_size=8192, embed=1024, layers=4, heads=8, kv_heads=4, mlp=3584)


def _update_temp(mesh: MeshConfig, rules: str) -> tuple[float, float]:
    """(XLA's temp bytes of the compiled update, the planner's update_phase) per device."""
    plan = ParallelPlan(mesh=mesh, rules=rules)
    setup = build_train_setup(MODEL, plan, TrainConfig(global_batch=16, seq_len=16), OptimizerConfig())
    state_abs, shardings = setup.state.abstract, setup.state.shardings
    update = make_update(setup.state.graphdef, setup.tx, setup.lr_schedule, rules=setup.rules,
                         opt_state_shardings=shardings.opt_state)
    grads = jax.tree.map(lambda p: jax.ShapeDtypeStruct(p.shape, jax.numpy.float32, sharding=p.sharding),
                         state_abs.params)
    replicated = NamedSharding(setup.mesh, PartitionSpec())
    scalar = jax.ShapeDtypeStruct((), jax.numpy.float32, sharding=replicated)

    def run(state, grads, nll, tokens):
        with use_rules(setup.mesh, setup.rules):
            return update(state, grads, (nll, nll, nll), {}, tokens, {})

    compiled = jax.jit(run, out_shardings=(shardings, replicated), donate_argnums=(0,)).lower(
        state_abs, grads, scalar, scalar).compile()
    planned = state_bytes(state_shapes(MODEL, setup.tx), mesh.sizes(), get_rule_set(rules))
    return compiled.memory_analysis().temp_size_in_bytes, update_phase(planned.leaves)


# dp and FSDP: the new parameters, exactly. ZeRO-1: the largest leaf gathered plus its optimizer
# layout copy; XLA also has the next leaves' gathers in flight (here the attention weights: the
# measured temp is 26% above; Llama-3-8B 5-6%): 30% here (the planner claims 25% on the whole
# step's temp, whose update phase is rarely the larger). dp and a second ZeRO-1 mesh measured the
# same way (0% and 26%) are left out of the suite for time.
@pytest.mark.parametrize("mesh,rules,tolerance", [
    (MeshConfig(data=16), "fsdp", 0.02),
    (MeshConfig(data=4, tensor=4), "zero1", 0.30),
], ids=["fsdp16", "zero1_dp4_tp4"])
def test_update_phase_is_what_xla_holds(mesh, rules, tolerance):
    xla, planned = _update_temp(mesh, rules)
    assert xla > 0 and abs(planned / xla - 1) <= tolerance, (rules, planned / 2**20, xla / 2**20)
