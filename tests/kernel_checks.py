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
