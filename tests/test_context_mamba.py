"""Context parallelism for the Mamba-2 mixer (meshes/context_ssm.py): with the sequence split over
`context`, in either layout, the mixer gives the values and gradients of one unsplit call, and
its compiled memory per device shrinks with the context axis instead of holding the whole row."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding, PartitionSpec

from jaxtrain.meshes.context_layout import ContextParallel, Contiguous, LoadBalanced, device_order, use_context_parallel
from jaxtrain.meshes.mesh import AXES, MeshConfig, build_mesh
from jaxtrain.meshes.rules import get_rule_set, use_rules
from jaxtrain.models.layers.mamba2 import Mamba2Mixer, SSMConfig
from jaxtrain.pallas_kernels.gpu_lowering import GPU_DEVICE_KINDS, count_triton_kernels

pytestmark = [pytest.mark.slow]

EMBED = 16
# chunk_size 16: the Pallas scan's smallest, so the Pallas case shares the XLA reference. Context
# chunks of 8, 16 and 32 tokens then hold a padded, one or two scan chunks.
TINY = SSMConfig(heads=4, head_dim=8, state=8, groups=2, chunk_size=16)
LENGTH = 64
# Document starts per row. 16, 32 and 48 are context-chunk boundaries in every mesh and layout
# below (LoadBalanced at context=4 also cuts at every multiple of 8): row 0 starts documents a
# token after one and two tokens after another, so the conv halo must be masked; row 1 starts
# one exactly at a boundary and two short ones right after it; long documents cross several.
STARTS = ([17, 50], [9, 32, 34, 35])
# LLVM -O0: these programs run once on tiny shapes, so compiling dominates (about 3x faster this
# way); the HLO passes and buffer assignment, hence memory_analysis(), are unchanged.
QUICK = {"xla_backend_optimization_level": 0}


@pytest.fixture(autouse=True)
def _exact_f32_matmuls():
    with jax.default_matmul_precision("highest"):
        yield


def packed_segments(length=LENGTH, starts=STARTS):
    seg = np.zeros((len(starts), length), np.int32)
    for row, cuts in enumerate(starts):
        for c in cuts:
            seg[row, c:] += 1
    return seg


def mixer_params(cfg, kernels, seed=0, scale=0.3):
    """(graphdef, params) of a mixer with every parameter drawn by numpy (non-trivial D, biases)."""
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: Mamba2Mixer(EMBED, cfg, rngs=nnx.Rngs(0),
                                                                      kernels=kernels)))
    rng = np.random.default_rng(seed)

    def draw(path, a):
        name = jax.tree_util.keystr(path)
        if "A_log" in name:  # slow decay (|dt A| ~ 0.01 a token): states carry across whole chunks
            return jnp.asarray(np.log(rng.uniform(0.05, 0.2, a.shape)), a.dtype)
        if "dt_bias" in name:
            return jnp.asarray(rng.uniform(-2.5, -1.5, a.shape), a.dtype)
        return jnp.asarray(scale * rng.standard_normal(a.shape), a.dtype)
    return graphdef, jax.tree_util.tree_map_with_path(draw, abstract)


def loss_fn(graphdef, seg, weights):
    def loss(params, x):
        y = nnx.merge(graphdef, params)(x, seg)
        return jnp.sum(y * weights), y
    return loss


def reference(graphdef, params, x, seg, weights):
    loss = loss_fn(graphdef, jnp.asarray(seg), jnp.asarray(weights))
    (_, y), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True), compiler_options=QUICK)(params, x)
    return y, grads


def context_parallel(mesh_cfg, layout, graphdef, params, x, seg, weights):
    """The mixer under `mesh_cfg` with inputs in `layout`'s device order; outputs and the input
    gradient are put back in the original order."""
    devices = jax.devices()[:mesh_cfg.fixed_device_count()]
    mesh = build_mesh(mesh_cfg, devices)
    context = mesh.shape["context"]
    order = device_order(layout, x.shape[1], context)
    back = np.argsort(order)
    whole = NamedSharding(mesh, PartitionSpec())
    put = lambda a: jax.device_put(a, whole)
    with use_rules(mesh, get_rule_set("dp")), use_context_parallel(ContextParallel(layout=layout)):
        loss = loss_fn(graphdef, put(seg[:, order]), put(weights[:, order]))
        step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True), compiler_options=QUICK)
        (_, y), (g_params, g_x) = step(jax.tree.map(put, params), put(np.asarray(x)[:, order]))
    return np.asarray(y)[:, back], (g_params, np.asarray(g_x)[:, back])


def assert_close(actual, expected, rtol, what):
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    assert np.isfinite(actual).all() and np.isfinite(expected).all(), f"{what}: not finite"
    # Elementwise rtol, with an absolute floor at rtol x the largest magnitude (tiny entries
    # are sums of cancelling terms, whose order differs under a mesh).
    np.testing.assert_allclose(actual, expected, rtol=rtol, atol=rtol * np.abs(expected).max(), err_msg=what)


_REFERENCES = {}


def case(cfg, seed=0):
    """Inputs (params, x, seg, weights) and the unsplit XLA mixer's (y, (d params, d x)) on them,
    computed once per config for the whole module."""
    key = (cfg, seed)
    if key not in _REFERENCES:
        graphdef, params = mixer_params(cfg, "xla", seed)
        rng = np.random.default_rng(seed + 1)
        seg = packed_segments()
        x = jnp.asarray(rng.standard_normal((seg.shape[0], LENGTH, EMBED)), jnp.float32)
        weights = rng.standard_normal((seg.shape[0], LENGTH, EMBED)).astype(np.float32)
        _REFERENCES[key] = (params, x, seg, weights), reference(graphdef, params, x, seg, weights)
    return _REFERENCES[key]


def check_against_reference(cfg, mesh_cfg, layout, rtol, kernels="xla"):
    inputs, (ref_y, (ref_gp, ref_gx)) = case(cfg)
    graphdef, _ = mixer_params(cfg, kernels)
    y, (gp, gx) = context_parallel(mesh_cfg, layout, graphdef, *inputs)
    assert_close(y, ref_y, rtol, "output")
    assert_close(gx, ref_gx, rtol, "d input")
    flat_ref = dict(jax.tree_util.tree_leaves_with_path(ref_gp))
    for path, g in jax.tree_util.tree_leaves_with_path(gp):
        assert_close(g, flat_ref[path], rtol, f"d {jax.tree_util.keystr(path)}")


MESHES = {"context2": MeshConfig(data=1, context=2), "context4": MeshConfig(data=1, context=4),
          "data2_context4_tensor2": MeshConfig(data=2, context=4, tensor=2)}
LAYOUTS = {"contiguous": Contiguous(), "load_balanced": LoadBalanced()}


@pytest.mark.parametrize("layout", LAYOUTS, ids=list(LAYOUTS))
@pytest.mark.parametrize("mesh", MESHES, ids=list(MESHES))
def test_mixer_under_context_parallel_equals_unsplit(mesh, layout):
    check_against_reference(TINY, MESHES[mesh], LAYOUTS[layout], rtol=1e-5)


def test_inputs_carry_a_state_across_a_whole_chunk():
    """The incoming state's decay is only used when a document covers a whole context chunk and
    reaches the chunks on both sides (with two chunks the second gets the first's final state as
    it is): the context-4 meshes above have that in both layouts, so dropping the decay from the
    carried state fails them (context2-contiguous alone cannot see it)."""
    seg = packed_segments()
    for layout in LAYOUTS.values():
        size = LENGTH // (4 * layout.chunks_per_rank)
        spans = [seg[:, j * size - 1] == seg[:, (j + 1) * size] for j in range(1, 4 * layout.chunks_per_rank - 1)]
        assert np.any(spans), f"no document spans three {size}-token chunks ({type(layout).__name__})"


def test_pallas_kernels_under_context_parallel():
    """The kernels (interpreted on CPU) run per chunk inside the context shard_map; the
    reference is the unsplit XLA mixer."""
    check_against_reference(TINY, MeshConfig(data=1, context=2), LoadBalanced(), rtol=1e-4, kernels="pallas")


def test_pallas_context_parallel_lowers_for_gpu():
    """Cross-lowered for CUDA (no GPU needed): the chunk-stacked, halo-extended shapes obey
    Triton's rules, and the conv and scan kernels (forward and backward) stay per shard."""
    device = jax.sharding.AbstractDevice(device_kind=GPU_DEVICE_KINDS["H100"], num_cores=132, platform="gpu")
    mesh = jax.sharding.AbstractMesh((1, 1, 2, 1, 2), AXES, axis_types=(AxisType.Auto,) * 5, abstract_device=device)
    graphdef, params = mixer_params(TINY, "pallas")
    x = jax.ShapeDtypeStruct((2, LENGTH, EMBED), jnp.float32)
    seg = jax.ShapeDtypeStruct((2, LENGTH), jnp.int32)

    def loss(params, x, seg):
        return jnp.sum(nnx.merge(graphdef, params)(x, seg) ** 2)

    with (jax.sharding.use_abstract_mesh(mesh), use_rules(mesh, get_rule_set("dp")),
          use_context_parallel(ContextParallel(layout=LoadBalanced()))):
        text = jax.jit(jax.value_and_grad(loss)).trace(params, x, seg).lower(lowering_platforms=("cuda",)).as_text()
    assert count_triton_kernels(text) == 12  # 3 convs and the scan's 3 kernels, forward and backward
    assert "collective_permute" in text and "all_gather" in text


# ---- compiled memory ---------------------------------------------------------------------------

MEMORY_CFG = SSMConfig(heads=2, head_dim=4, state=4, groups=1, chunk_size=64)


def compiled_temp_bytes(length, context):
    """Temp bytes per device of the mixer's value_and_grad at batch 1 (compile only)."""
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: Mamba2Mixer(8, MEMORY_CFG, rngs=nnx.Rngs(0))))
    x = jax.ShapeDtypeStruct((1, length, 8), jnp.float32)
    seg = jax.ShapeDtypeStruct((1, length), jnp.int32)

    def loss(params, x, seg):
        return jnp.sum(nnx.merge(graphdef, params)(x, seg) ** 2)

    f = jax.value_and_grad(loss, argnums=(0, 1))
    if context == 1:
        return jax.jit(f, compiler_options=QUICK).lower(abstract, x, seg).compile().memory_analysis().temp_size_in_bytes
    mesh = build_mesh(MeshConfig(data=1, context=context), jax.devices()[:context])
    with use_rules(mesh, get_rule_set("dp")), use_context_parallel(ContextParallel(layout=LoadBalanced())):
        compiled = jax.jit(f, compiler_options=QUICK).lower(abstract, x, seg).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def test_context_parallel_mixer_memory_shrinks_per_device():
    whole = compiled_temp_bytes(32768, 1)
    split = {n: compiled_temp_bytes(n, 4) for n in (16384, 32768, 65536)}
    print(f"temp bytes: context=1 32k {whole}; context=4 " + ", ".join(f"{n}: {v}" for n, v in split.items()))
    assert split[32768] <= 0.3 * whole, (split[32768], whole)
    assert split[65536] <= 4.5 * split[16384], split
