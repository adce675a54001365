"""Test settings: 8 simulated CPU devices, set before jax initialises, and strict numerics."""

import os

from subproc import TEST_XLA_FLAGS  # a plain helper: no jax

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8 " + TEST_XLA_FLAGS
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


MAXTEXT_VERSION = "0.2.5"


@pytest.fixture(scope="session")
def maxtext_dir():
    """MaxText's own package files (configs/, layers/, models/) from its public wheel,
    fetched once into a cache without installing it (the wheel wants Python >= 3.12 and
    its own jax; we only read its files). Skips only when the index cannot be reached."""
    import subprocess
    import sys
    import tempfile
    import urllib.request
    import zipfile
    from pathlib import Path

    cache = Path(os.environ.get("MOE_CP_CACHE", Path.home() / ".cache" / "moe-cp"))
    root = cache / f"maxtext-{MAXTEXT_VERSION}"
    if (root / "maxtext" / "configs" / "base.yml").is_file():
        return root / "maxtext"
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--only-binary=:all:",
            "--python-version",
            "3.12",
            f"maxtext=={MAXTEXT_VERSION}",
            "-d",
            tmp,
            "--quiet",
        ]
        got = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        wheels = list(Path(tmp).glob("maxtext-*.whl"))
        if got.returncode != 0 or not wheels:
            try:
                urllib.request.urlopen("https://pypi.org/simple/maxtext/", timeout=15)
            except OSError as exc:
                pytest.skip(f"the package index cannot be reached to fetch maxtext: {exc}")
            raise RuntimeError(f"pip download maxtext=={MAXTEXT_VERSION} failed: {got.stderr}")
        wanted = ("maxtext/configs/", "maxtext/layers/", "maxtext/models/")
        # One staging folder per process: parallel test workers may fetch at once.
        staging = cache / f".maxtext-{MAXTEXT_VERSION}.partial-{os.getpid()}"
        with zipfile.ZipFile(wheels[0]) as wheel:
            for name in wheel.namelist():
                if name.startswith(wanted):
                    wheel.extract(name, staging)
        try:
            staging.rename(root)  # complete or absent: no half-extracted cache
        except OSError:  # another worker's copy landed first: keep it
            import shutil

            shutil.rmtree(staging, ignore_errors=True)
            if not (root / "maxtext" / "configs" / "base.yml").is_file():
                raise
    return root / "maxtext"
