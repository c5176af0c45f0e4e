"""Shared tolerances and comparisons for the kernel tests."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

TOL = {jnp.float32: 1e-4, jnp.bfloat16: 1e-2}


@pytest.fixture
def exact_f32_matmuls():
    # XLA on GPU would use TF32 for f32 matmuls; the kernels do not.
    with jax.default_matmul_precision("highest"):
        yield


def assert_close(actual, expected, rtol):
    """Max absolute error relative to the largest reference magnitude."""
    actual = np.asarray(actual, np.float64)
    expected = np.asarray(expected, np.float64)
    assert actual.shape == expected.shape
    scale = max(np.max(np.abs(expected), initial=0.0), 1e-6)
    err = np.max(np.abs(actual - expected), initial=0.0) / scale
    assert err <= rtol, f"relative error {err:.3g} > {rtol}"


def pallas_kernel_names(jaxpr) -> set[str]:
    """Names of the `pallas_call`s anywhere in a (Closed)Jaxpr, sub-jaxprs included (jit, scan,
    shard_map, custom_vjp, ...). In interpret mode the compiled HLO has no trace of Pallas, but
    the jaxpr keeps the pallas_call: the proof that a kernel, not its XLA reference, ran."""
    from jax.extend import core as jcore

    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    names = set()
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pallas_call":
            names.add(str(eqn.params.get("name")))
        for value in eqn.params.values():
            for sub in value if isinstance(value, (list, tuple)) else (value,):
                if isinstance(sub, (jcore.ClosedJaxpr, jcore.Jaxpr)):
                    names |= pallas_kernel_names(sub)
    return names
