"""The planner's context-exchange figures for MLA (jaxtrain/planner/context_kv.py) against the
compiled train step: tiny DeepSeek (dense MLA layers, float32) on context=2 x tensor=2. Under the
default ring each layer's forward permutes per-head keys and values of the device's heads
(heads / tensor x (nope + rope + v) values a token); under `kv=latent` it gathers the latent and
rotary key (kv_lora + rope). The time model's context bytes per layer forward must be the bytes
the compiled forward moves, and the memory model must count the per-head keys/values the ring
keeps (and not under kv=latent)."""
from __future__ import annotations

import re

import jax
import numpy as np
import pytest

from jaxtrain.planner.cluster import Cluster
from jaxtrain.planner.context_kv import exchanged_width, latent_shape
from jaxtrain.planner.links import LinkTable
from jaxtrain.planner.memory_model import CPU
from jaxtrain.planner.planner import Planner, Workload
from jaxtrain.training.config import TrainConfig
from jaxtrain.training.optim import OptimizerConfig
from jaxtrain.training.parallel_plan import ParallelPlan
from jaxtrain.training.train_setup import build_train_setup
from jaxtrain.meshes.context_settings import LatentKV, RingKV
from jaxtrain.models.deepseek import DeepSeekConfig

pytestmark = [pytest.mark.slow]

HEADS, NOPE, ROPE, V, KV_LORA = 4, 8, 4, 6, 16
MODEL = DeepSeekConfig(vocab_size=96, embed=32, layers=2, first_k_dense=2, heads=HEADS, kv_lora_rank=KV_LORA,
                       qk_nope_head_dim=NOPE, qk_rope_head_dim=ROPE, v_head_dim=V, mlp=64)
TRAIN = TrainConfig(global_batch=4, seq_len=64)
LAYOUT = "context=2,tensor=2,rules=fsdp,remat=none"
_RESULT = re.compile(r"=\s*f32\[([0-9,]+)\]\S*\s+(collective-permute|all-gather)(?:-start)?\(")


def _forward_bytes(hlo: str, kind: str) -> int:
    """Bytes of the float32 context exchange in the compiled forward (backward ops carry
    `transpose(` in their op_name), each instruction once (a layer scan's body: one layer): the
    ring's ppermutes, or the all-gathers of [b, sequence, w] arrays (FSDP's weight gathers and
    permutes are neither)."""
    total = 0
    for line in hlo.splitlines():
        m = _RESULT.search(line)
        if not m or m.group(2) != kind or "transpose(" in line:
            continue
        dims = [int(d) for d in m.group(1).split(",")]
        if kind == "collective-permute" and "ppermute" not in line:
            continue
        if kind == "all-gather" and not (len(dims) == 3 and dims[1] == TRAIN.seq_len):
            continue
        total += 4 * int(np.prod(dims))
    return total


def _planner():
    group = Cluster.from_args(cluster=None, device="H100", devices=4).groups[0]
    return Planner(Workload(MODEL, TRAIN.global_batch, TRAIN.seq_len, 16), group,
                   LinkTable(group.spec.intra_node_gbps, group.spec.inter_node_gbps))


@pytest.fixture(scope="module")
def compiled_and_planned():
    planner = _planner()
    out = {}
    for name, exchange in (("ring", RingKV()), ("latent", LatentKV())):
        plan = ParallelPlan.parse(f"{LAYOUT},kv={name}")
        assert plan.context_parallel.kv_exchange == exchange
        setup = build_train_setup(MODEL, plan, TRAIN, OptimizerConfig(), jax.devices()[:4])
        hlo = setup.train_step.lower(setup.state.abstract, setup.abstract_batch(TRAIN.global_batch, TRAIN.seq_len)
                                     ).compile().as_text()
        state = planner.state(plan)
        time = planner.evaluate(plan).time
        out[name] = (plan, hlo, state, time, planner.memory(plan, state, CPU))
    return planner, out


def _layer_leaves(state):
    return [leaf for leaf in state.leaves if leaf.in_layers]


def test_the_mla_widths_are_read_off_the_leaves(compiled_and_planned):
    _, out = compiled_and_planned
    mla = latent_shape(_layer_leaves(out["ring"][2]))
    assert (mla.heads, mla.qk_head_dim, mla.v_head_dim, mla.latent_width) == (HEADS // 2, NOPE + ROPE, V, KV_LORA + ROPE)


@pytest.mark.parametrize("name,kind", [("ring", "collective-permute"), ("latent", "all-gather")])
def test_context_bytes_per_layer_forward_are_what_the_step_moves(compiled_and_planned, name, kind):
    """Per device and layer forward: C - 1 = 1 rank's tokens (rows x seq / C) at the exchange's
    width, in the compute dtype (float32): the time model's figure and the compiled step's."""
    _, out = compiled_and_planned
    plan, hlo, state, time, _ = out[name]
    width = exchanged_width(_layer_leaves(state), MODEL.embed, plan.context_parallel.kv_exchange)
    tokens = TRAIN.global_batch * TRAIN.seq_len // 2
    moved = _forward_bytes(hlo, kind)
    if kind == "all-gather":  # the whole sequence's latent and rotary key: the other rank's half arrived
        moved //= 2
    assert moved == 4 * tokens * width, (name, moved, width)
    # The time model: forward + backward K/V and gradients = 3 layer forwards' bytes, 2 layers
    assert time.bytes_by_kind["context"] == pytest.approx(3 * MODEL.layers * 4 * tokens * width)


def test_the_memory_model_keeps_per_head_keys_values_only_for_a_per_head_exchange(compiled_and_planned):
    _, out = compiled_and_planned
    ring, latent = out["ring"][4], out["latent"][4]
    tokens = TRAIN.global_batch * TRAIN.seq_len // 2
    per_head = 4 * tokens * (HEADS // 2) * (NOPE + ROPE + V)  # one layer's keys and values, float32
    assert ring.saved_activations - latent.saved_activations == pytest.approx(MODEL.layers * per_head)
    assert ring.layer_backward - latent.layer_backward == pytest.approx(2 * per_head)
