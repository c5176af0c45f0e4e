"""The models' bf16 matmul (pallas_kernels/low_precision_dot.py): on XLA:CPU a dot with a bf16
result is widened to float32 operands; asking for a float32 result and rounding once keeps the
dot on bf16 operands. Checked: the numbers against float64 (value and both gradients), the
compiled CPU programs' dot operand dtypes (a Dense's forward and backward under the dp and FSDP
tables), the GPU target keeping the native dot, and the remat policies saving a rounded dot as
they saved the plain one."""
import contextlib
import io

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.ad_checkpoint import print_saved_residuals

from jaxtrain.observe.hlo_dots import dot_dtypes
from jaxtrain.meshes.mesh import MeshConfig, build_mesh
from jaxtrain.meshes.rules import get_rule_set, named_sharding, use_rules
from jaxtrain.models.layers.dense import Dense
from jaxtrain.models.layers.expert_ffn import GatedExperts
from jaxtrain.models.layers.layer_scan import REMAT_POLICIES
from jaxtrain.pallas_kernels import low_precision_dot as lpd
from jaxtrain.pallas_kernels.gpu_lowering import GPU_DEVICE_KINDS

pytestmark = [pytest.mark.fast]

BF16 = jnp.bfloat16
_ROUNDS_ONCE = lpd.rounds_once


def _bf16(rng, shape, scale=1.0):
    return jnp.asarray(rng.normal(size=shape) * scale, BF16)


def _f64(a):
    return np.asarray(a.astype(jnp.float32), np.float64)


def _within_one_rounding(got, want64):
    """bf16 `got` is float64 `want64` rounded once, up to float32 summation order: within one
    bf16 unit in the last place (2^-8 relative) of the value, plus a float32 epsilon of scale."""
    got = _f64(got)
    assert np.isfinite(got).all()
    ulp = np.abs(want64) * 2.0 ** -8 + 1e-6 * np.abs(want64).max()
    assert (np.abs(got - want64) <= ulp).all(), np.max(np.abs(got - want64) / ulp)


@pytest.mark.parametrize("tokens", [(4, 6), (24,)])
@pytest.mark.parametrize("impl", ["round_once", "native"])
def test_the_dot_and_its_gradients_are_float64_rounded_once(impl, tokens):
    rng = np.random.default_rng()
    x, w, g = _bf16(rng, (*tokens, 96)), _bf16(rng, (96, 3, 40)), _bf16(rng, (*tokens, 3, 40))
    y, vjp = jax.vjp(lambda x, w: lpd.tensordot(x, w, 1, impl=impl), x, w)
    dx, dw = vjp(g)
    assert y.dtype == dx.dtype == dw.dtype == BF16
    n = len(tokens)
    _within_one_rounding(y, np.tensordot(_f64(x), _f64(w), axes=1))
    _within_one_rounding(dx, np.tensordot(_f64(g), _f64(w), axes=([n, n + 1], [1, 2])))
    _within_one_rounding(dw, np.tensordot(_f64(x), _f64(g), axes=(list(range(n)), list(range(n)))))


@pytest.mark.parametrize("impl", ["round_once", "native"])
def test_the_batched_matmul_and_its_gradients_are_float64_rounded_once(impl):
    rng = np.random.default_rng()
    a, w, g = _bf16(rng, (3, 10, 96)), _bf16(rng, (3, 96, 24)), _bf16(rng, (3, 10, 24))
    y, vjp = jax.vjp(lambda a, w: lpd.batched_matmul(a, w, impl=impl), a, w)
    da, dw = vjp(g)
    assert y.dtype == da.dtype == dw.dtype == BF16
    _within_one_rounding(y, np.einsum("bnk,bkm->bnm", _f64(a), _f64(w)))
    _within_one_rounding(da, np.einsum("bnm,bkm->bnk", _f64(g), _f64(w)))
    _within_one_rounding(dw, np.einsum("bnk,bnm->bkm", _f64(a), _f64(g)))


def test_float32_operands_take_the_plain_dot_and_mixed_ones_are_refused():
    x, w = jnp.ones((4, 8), jnp.float32), jnp.ones((8, 2), jnp.float32)
    assert not lpd.rounds_once(jnp.float32, "round_once")
    eqns = jax.make_jaxpr(lambda x, w: lpd.tensordot(x, w, 1, impl="round_once"))(x, w).eqns
    assert [e.primitive.name for e in eqns] == ["dot_general"]
    with pytest.raises(TypeError, match="one dtype"):
        lpd.tensordot(x.astype(BF16), w, 1)
    with pytest.raises(TypeError, match="one dtype"):
        lpd.batched_matmul(jnp.ones((2, 4, 8), BF16), jnp.ones((2, 8, 2), jnp.float32))
    with pytest.raises(ValueError, match="impl must be one of"):
        lpd.rounds_once(BF16, "fast")


def _cpu_widens_bf16_result_dots() -> bool:
    """Whether this jax's XLA:CPU multiplies a plain bf16 x bf16 -> bf16 dot in float32 (older
    backends do; newer ones have bf16-result kernels, and the native formulation stays bf16)."""
    a = jnp.ones((64, 64), BF16)
    return [ops for _, ops in dot_dtypes(jax.jit(jnp.dot).lower(a, a).compile().as_text())] == [("f32", "f32")]


def _dense_step_hlo(rules_name: str, monkeypatch, impl: str):
    """The compiled CPU program of a bf16 Dense's loss and its gradients (input and weight)
    under `rules_name` over 16 devices (data=4, tensor=4), with the dot formulation `impl`."""
    monkeypatch.setattr(lpd, "rounds_once", lambda dtype, _="auto": _ROUNDS_ONCE(dtype, impl))
    mesh, rules = build_mesh(MeshConfig(data=4, tensor=4)), get_rule_set(rules_name)
    dense = Dense((256,), (512,), in_axes=("embed",), out_axes=("mlp",), rngs=nnx.Rngs(0), dtype=BF16)
    graphdef, state = nnx.split(dense)
    kernel = jax.device_put(state["kernel"][...], named_sharding(mesh, ("embed", "mlp"), (256, 512), rules.params))
    x = jnp.ones((16, 64, 256), BF16)

    def loss(kernel, x):
        state["kernel"] = state["kernel"].replace(value=kernel)
        with use_rules(mesh, rules):
            return jnp.sum(jnp.square(nnx.merge(graphdef, state)(x).astype(jnp.float32)))

    return jax.jit(jax.grad(loss, argnums=(0, 1))).lower(kernel, x).compile().as_text()


@pytest.mark.parametrize("rules_name", ["dp", "fsdp"])
def test_on_cpu_every_dot_of_a_bf16_dense_multiplies_bf16(rules_name, monkeypatch):
    rounded = dot_dtypes(_dense_step_hlo(rules_name, monkeypatch, "auto"))
    assert len(rounded) >= 3  # forward, input gradient, weight gradient
    assert all(ops == ("bf16", "bf16") and out == "f32" for out, ops in rounded), rounded
    # the native formulation on a CPU backend that widens bf16-result dots (what this module avoids)
    native = dot_dtypes(_dense_step_hlo(rules_name, monkeypatch, "native"))
    assert any(ops == ("f32", "f32") for _, ops in native) == _cpu_widens_bf16_result_dots(), native


@pytest.mark.parametrize("x_shape", [(512, 256), (4, 128, 256)])
def test_on_cpu_a_tensordot_and_its_gradients_multiply_bf16(x_shape):
    """Tokens flattened or not: one contracting dimension in the weight gradient (2-D x) is a
    form XLA:CPU widens unless the dot is written over two."""
    x, w = jnp.ones(x_shape, BF16), jnp.ones((256, 512), BF16)
    grads = jax.grad(lambda x, w: jnp.sum(jnp.square(lpd.tensordot(x, w, 1).astype(jnp.float32))), argnums=(0, 1))
    dots = dot_dtypes(jax.jit(grads).lower(x, w).compile().as_text())
    assert len(dots) == 3 and all(ops == ("bf16", "bf16") for _, ops in dots), dots


def _capacity_experts_step_hlo(monkeypatch, impl: str):
    """The compiled CPU program of bf16 gated experts on a capacity buffer [experts, rows, embed]
    (the capacity dispatch's expert compute), its loss and all gradients."""
    monkeypatch.setattr(lpd, "rounds_once", lambda dtype, _="auto": _ROUNDS_ONCE(dtype, impl))
    experts = GatedExperts(4, 64, 128, rngs=nnx.Rngs(0), dtype=BF16)
    buffer = jnp.ones((4, 32, 64), BF16)

    def loss(weights, buffer):
        return jnp.sum(jnp.square(experts.compute_batched(buffer, weights).astype(jnp.float32)))

    return jax.jit(jax.grad(loss, argnums=(0, 1))).lower(experts.weights(), buffer).compile().as_text()


def test_on_cpu_every_dot_of_the_capacity_experts_multiplies_bf16(monkeypatch):
    rounded = dot_dtypes(_capacity_experts_step_hlo(monkeypatch, "auto"))
    assert len(rounded) >= 9  # three matmuls, each forward, input and weight gradient
    assert all(ops == ("bf16", "bf16") and out == "f32" for out, ops in rounded), rounded
    # batched bf16-result dots: widened by every XLA:CPU we run
    native = dot_dtypes(_capacity_experts_step_hlo(monkeypatch, "native"))
    assert any(ops == ("f32", "f32") for _, ops in native), native


def test_a_gpu_target_keeps_the_native_dot():
    device = jax.sharding.AbstractDevice(device_kind=GPU_DEVICE_KINDS["H100"], num_cores=132, platform="gpu")
    mesh = jax.sharding.AbstractMesh((1,), ("gpu",), axis_types=(jax.sharding.AxisType.Auto,), abstract_device=device)
    with jax.sharding.use_abstract_mesh(mesh):
        assert not lpd.rounds_once(BF16)
        eqns = jax.make_jaxpr(lambda x, w: lpd.tensordot(x, w, 1))(jnp.ones((4, 8), BF16), jnp.ones((8, 2), BF16)).eqns
    assert [e.primitive.name for e in eqns] == ["dot_general"]
    assert eqns[0].outvars[0].aval.dtype == BF16
    assert lpd.rounds_once(BF16)  # this host: XLA:CPU


_MATMULS = {  # (matmul, x, w): the output's shape is [..., 8, 32] either way
    "tensordot": (lambda x, w, impl: lpd.tensordot(x, w, 1, impl=impl), (8, 16), (16, 32)),
    "batched": (lambda x, w, impl: lpd.batched_matmul(x, w, impl=impl), (2, 8, 16), (2, 16, 32)),
}


@pytest.mark.parametrize("matmul", sorted(_MATMULS))
@pytest.mark.parametrize("remat", ["dots", "dots_no_batch", "offload_dots", "full"])
def test_remat_policies_save_a_rounded_dot_as_the_native_one(remat, matmul):
    mm, x_shape, w_shape = _MATMULS[matmul]
    x, w = jnp.ones(x_shape, BF16), jnp.ones(w_shape, BF16)

    def saved(impl):
        f = jax.checkpoint(lambda x, w: jnp.tanh(mm(x, w, impl)).sum(), policy=REMAT_POLICIES[remat])
        out = io.StringIO()
        with contextlib.redirect_stdout(out):  # jax's public view of what a checkpoint keeps
            print_saved_residuals(f, x, w)
        return sorted(line.split()[0] for line in out.getvalue().splitlines())  # e.g. bf16<host>[8,32]

    assert saved("round_once") == saved("native")
    # the matmul's [.., 8, 32] output is among what the dot policies keep, and only theirs (a
    # batched dot not under the two that keep dots with no batch dimensions)
    kept = remat != "full" and not (matmul == "batched" and remat in ("dots_no_batch", "offload_dots"))
    assert any(a.endswith("8,32]") for a in saved("round_once")) == kept
