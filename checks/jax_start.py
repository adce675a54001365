"""Setting up a process before jax starts, for this project's commands: a quiet start on
a machine without accelerators, and the devices a compile target needs.

With the `tpu` and `gpu` extras installed (libtpu, JAX's CUDA plugin), every jax start
on a machine with neither chip prints about 30 lines: the CUDA plugin's failed
initialisation (`Unable to load CUDA`), its stub's `Could not find cuda drivers`, and
libtpu's `unexpected worker hostname`. None of it is an error of ours; compile mode
still needs both plugins (their topology factories make the abstract chips), so the
plugins stay loaded and their lines are dropped instead.

`quiet_jax_start()`, called before jax is imported, does two things when no
accelerator is present:
- JAX_PLATFORMS=cpu unless the user set it, so the CUDA and TPU backends are never
  initialised (no traceback);
- stderr through a small filter process that drops the lines in NOISE and passes every
  other byte (XLA's warnings, tracebacks, progress bars). A separate process, not a
  thread, so that a crash of this one still gets its last words through.
MOE_CP_PLUGIN_LOGS=1 keeps everything.

`prepare_process(platform, num_devices)` sets what jax reads when it starts for a
compile target (the CPU backend; simulated CPU devices), and `start_for(config)` does
both for the CLI's compile=true and measure=true (the `start` entry point the selector
loads). This module imports no jax, so the CLI can call it before jax starts.

    >>> from checks.jax_start import NOISE
    >>> bool(NOISE.search(b"I0000 cudart_stub.cc:31] Could not find cuda drivers on your machine"))
    True
"""

from __future__ import annotations

import atexit
import glob
import os
import re
import subprocess
import sys
from importlib import metadata

NOISE = re.compile(
    rb"^WARNING: All log messages before absl::InitializeLog\(\) is called are written to STDERR"
    rb"|^WARNING: Logging before InitGoogle\(\) is written to STDERR"
    rb"|cudart_stub\.cc:\d+\] Could not find cuda drivers on your machine"
    rb"|could not determine TPU accelerator type"
    rb"|unexpected worker hostname .* from env var TPU_WORKER"
    rb"|^=== Source Location Trace: ==="
    rb"|^learning/[0-9a-f]+/tfrc/runtime/libtpu_init_utils\.cc:\d+"
)
PLUGINS = ("libtpu", "jax-cuda12-plugin", "jax-cuda13-plugin")
KEEP_ENV = "MOE_CP_PLUGIN_LOGS"
_started: list[subprocess.Popen] = []


def accelerator_present() -> bool:
    """A GPU or TPU on this machine's PCI bus (or a ROCm device): read from sysfs, as
    jax's own TPU detection does, without starting anything."""
    if os.path.exists("/dev/kfd") or glob.glob("/dev/nvidia[0-9]*") or glob.glob("/dev/accel*"):
        return True
    for dev in glob.glob("/sys/bus/pci/devices/*"):
        try:
            with open(f"{dev}/vendor") as v, open(f"{dev}/class") as c:
                vendor, cls = v.read().strip(), c.read().strip()
        except OSError:
            continue
        if vendor == "0x1ae0" or (vendor == "0x10de" and cls.startswith("0x03")):
            return True  # Google (TPU), NVIDIA display / 3D controller
    return False


def _plugins_installed() -> bool:
    for name in PLUGINS:
        try:
            metadata.distribution(name)
            return True
        except metadata.PackageNotFoundError:
            continue
    return False


def prepare_process(platform: str, num_devices: int) -> None:
    """Set up a process that has not started jax to compile for `platform`: abstract TPU
    and GPU devices need only JAX's CPU backend; CPU targets need `num_devices` simulated
    devices, which XLA reads from XLA_FLAGS when jax starts. A no-op once jax runs.

    Args:
      platform: "tpu", "gpu" or "cpu" (`selector.targets.Target.platform`).
      num_devices: the simulated CPU devices a CPU target needs.

    Returns:
      None; it sets the environment jax reads when it starts (JAX_PLATFORMS, XLA_FLAGS).

    Example:
      >>> import os, sys
      >>> from checks.jax_start import prepare_process
      >>> prepare_process("cpu", 8) if "jax" not in sys.modules else None
    """
    if "jax" in sys.modules:
        return
    os.environ.setdefault("JAX_PLATFORMS", "cpu")  # abstract chips need only this backend
    if platform in ("tpu", "gpu"):
        return
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        count = f"--xla_force_host_platform_device_count={num_devices}"
        os.environ["XLA_FLAGS"] = f"{flags} {count}".strip()


def start_for(config) -> None:
    """The CLI's set-up before compile=true or measure=true starts jax: a quiet start
    (`quiet_jax_start`) and, to time on CPU, the mesh's simulated devices.

    Args:
      config: the typed `selector.Config` about to be compiled or timed.

    Returns:
      None; it sets the environment jax reads when it starts, and nothing once jax runs.

    Example:
      >>> import os, selector
      >>> from checks.jax_start import start_for
      >>> cfg = selector.to_config(selector.compose(["model=tiny", "measure=true"]))
      >>> before = dict(os.environ)
      >>> start_for(cfg)  # jax already runs in this process: the environment stays
      >>> dict(os.environ) == before
      True
    """
    quiet_jax_start()
    if config.measure and config.hardware.platform == "cpu":
        from selector.mesh import build_mesh_view

        mesh, _ = build_mesh_view(config, None)
        prepare_process("cpu", mesh.num_devices if mesh is not None else 1)


def quiet_jax_start() -> None:
    """Before jax starts: on a machine without accelerators, use the CPU backend
    (unless JAX_PLATFORMS says otherwise) and drop the compiler plugins' start-up lines from
    stderr. Does nothing once jax is imported, on a machine with a GPU or TPU, or
    with MOE_CP_PLUGIN_LOGS=1."""
    if "jax" in sys.modules or os.environ.get(KEEP_ENV) or accelerator_present():
        return
    os.environ.setdefault("JAX_PLATFORMS", "cpu")  # a user's choice stands
    if not _started and _plugins_installed():
        _filter_stderr()


def _filter_stderr() -> None:
    try:
        sys.stderr.flush()
        original = os.dup(2)
        read, write = os.pipe()
        proc = subprocess.Popen(
            [sys.executable, "-S", os.path.abspath(__file__)],
            stdin=read,
            stdout=original,
            stderr=original,
            start_new_session=True,  # Ctrl-C reaches us, not the filter: it ends at EOF
        )
    except OSError:
        return  # no fd to spare or no process to start: the noise is only noise
    os.close(read)
    os.dup2(write, 2)
    os.close(write)
    _started.append(proc)

    def restore() -> None:
        try:
            sys.stderr.flush()
        except (OSError, ValueError):
            pass
        os.dup2(original, 2)  # the pipe's last writer gone: the filter drains and ends
        os.close(original)
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass  # a child of ours still holds the pipe; the filter ends with it

    atexit.register(restore)


def _run_filter(source, sink) -> None:
    """Copy `source` to `sink` line by line (a line ends at \\n or \\r, so progress bars
    pass as they are drawn), leaving out the lines NOISE matches."""
    pending = b""
    while True:
        chunk = os.read(source, 65536)
        if not chunk:
            break
        pending += chunk
        out = []
        while True:
            cut = min((i for i in (pending.find(b"\n"), pending.find(b"\r")) if i >= 0), default=-1)
            if cut < 0:
                break
            line, pending = pending[: cut + 1], pending[cut + 1 :]
            if not NOISE.search(line):
                out.append(line)
        if out:
            os.write(sink, b"".join(out))
    if pending and not NOISE.search(pending):
        os.write(sink, pending)


if __name__ == "__main__":
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _run_filter(0, 1)
