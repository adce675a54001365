"""checks.jax_start: the compiler plugins' start-up lines are dropped from stderr, and
nothing else is (progress bars, XLA's warnings, a dying process's last words)."""

import subprocess
import sys

from subproc import ROOT

# As libtpu 0.0.42.1 and JAX's CUDA plugin 0.10.2 print them on a machine with neither chip.
PLUGIN_LINES = [
    b"WARNING: All log messages before absl::InitializeLog() is called are written to STDERR\n",
    b"I0000 00:00:1796126839.759455   11257 cudart_stub.cc:31] Could not find cuda drivers on "
    b"your machine, GPU will not be used.\n",
    b"Failed to find host bounds for accelerator type: WARNING: could not determine TPU "
    b"accelerator type, please set env var `TPU_ACCELERATOR_TYPE` manually, otherwise "
    b"libtpu.so may not properly initialize.\n",
    b"WARNING: Logging before InitGoogle() is written to STDERR\n",
    b"E0000 00:00:1796126842.087980   11257 common_lib.cc:554] INVALID_ARGUMENT: Error: "
    b"unexpected worker hostname 'WARNING: could not determine TPU worker hostnames or IP "
    b"addresses' from env var TPU_WORKER\n",
    b"=== Source Location Trace: ===\n",
    b"learning/45eac/tfrc/runtime/libtpu_init_utils.cc:327\n",
]
KEPT = [
    b"W1201 12:08:18.764663   15949 spmd_partitioner.cc:656] [SPMD] Involuntary full "
    b"rematerialization. The compiler cannot go from sharding\n",
    b"train cp=4:  50%|#####     | 1/2 [00:32<00:32]\r",
    b"Traceback (most recent call last):\n",
    b"RuntimeError: Unable to load CUDA. Is it installed?\n",  # when the user asked for CUDA
]


def test_the_filter_drops_plugin_lines_and_keeps_the_rest():
    from checks.jax_start import NOISE

    assert all(NOISE.search(line) for line in PLUGIN_LINES)
    assert not any(NOISE.search(line) for line in KEPT)


def test_a_crash_still_gets_its_last_words_through(tmp_path):
    """The filter is its own process: stderr written just before a hard exit (no atexit,
    no flush of ours) arrives whole, in order, and the exit status is the program's."""
    kept = (KEPT * 2)[: len(PLUGIN_LINES)]
    mixed = b"".join(x for pair in zip(PLUGIN_LINES, kept, strict=True) for x in pair)
    code = (
        "import os; from checks.jax_start import _filter_stderr; _filter_stderr(); "
        f"os.write(2, {mixed!r}); os.write(2, b'last words without a newline'); os._exit(3)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, cwd=ROOT, timeout=60)
    assert out.returncode == 3
    assert out.stderr == b"".join(kept) + b"last words without a newline"
