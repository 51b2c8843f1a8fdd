"""Test-wide setup: 4 fake CPU devices, float64 available, deterministic hypothesis, tolerances.

Import the helpers with `from tests.conftest import assert_close, tolerance`.
"""

import os

# Must precede the first `import jax` anywhere in the test session (and reaches the launcher
# subprocesses the tests start). The tests check numerics and contracts, not speed (that is
# `benchmarks/`), and compiling dominates their time: XLA's CPU backend compiles without LLVM's
# optimizations (the same IEEE arithmetic, no fast-math either way): tests/modules/test_mixers.py
# took 40 s instead of 69. A level set in XLA_FLAGS comes after this one and wins.
os.environ["XLA_FLAGS"] = (
    "--xla_backend_optimization_level=0 "
    + os.environ.get("XLA_FLAGS", "")
    + " --xla_force_host_platform_device_count=4"
)
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import HealthCheck, settings

# float64 is opt-in per array: library code must follow its inputs' dtype, never the default.
jax.config.update("jax_enable_x64", True)

settings.register_profile(
    "seqlab",
    derandomize=True,  # the same draws on every run and machine
    max_examples=12,
    deadline=None,  # first calls compile
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
settings.load_profile("seqlab")

# Per-dtype tolerances for comparing a fast path with its reference (same math, other order of
# floating-point operations). Loosen an entry only with a comment that states the cause.
TOLERANCES = {
    jnp.dtype(jnp.float64): dict(rtol=1e-10, atol=1e-10),
    jnp.dtype(jnp.float32): dict(rtol=2e-4, atol=2e-5),
    # bfloat16 keeps 8 bits of mantissa: inputs round at 4e-3 relative.
    jnp.dtype(jnp.bfloat16): dict(rtol=3e-2, atol=3e-2),
}


def tolerance(dtype) -> dict:
    """The `rtol`/`atol` pair for comparisons in `dtype`."""
    return TOLERANCES[jnp.dtype(dtype)]


def assert_close(actual, expected, dtype=None, *, err_msg: str = "") -> None:
    """Assert two arrays (or pytrees of arrays) agree within the tolerance of `dtype`.

    `dtype` defaults to the dtype of each leaf of `expected`.
    """
    leaves_a, tree_a = jax.tree.flatten(actual)
    leaves_e, tree_e = jax.tree.flatten(expected)
    assert tree_a == tree_e, f"pytree structures differ: {tree_a} vs {tree_e}"
    for a, e in zip(leaves_a, leaves_e, strict=True):
        tol = tolerance(dtype if dtype is not None else e.dtype)
        np.testing.assert_allclose(
            np.asarray(a, np.float64), np.asarray(e, np.float64), err_msg=err_msg, **tol
        )
