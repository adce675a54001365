"""Test settings: 8 simulated CPU devices, set before jax initialises, and strict numerics."""

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def jax_cpu8():
    """jax with 8 CPU devices and strict settings (imported only by layer tests)."""
    import jax

    jax.config.update("jax_numpy_rank_promotion", "raise")
    assert jax.device_count() == 8, "conftest must set 8 CPU devices before jax starts"
    return jax
