"""The MaxText route's `compile=true`: MaxText 0.2.5's own train step, compiled ahead of
time by its `train_compile` for the chips the config names, with the MoE settings the
plan chose written in MaxText's keys.

On the MaxText route the block that would run is MaxText's, so the program compiled is
MaxText's whole train step (its decoder, its RoutedMoE, its optimizer and remat policy),
not this project's. `train_compile` runs in a child Python (the one running this check,
which must import `maxtext`: Python >= 3.12, the `maxtext` extra) on the CPU backend, and
prints `Memory analysis: CompiledMemoryStats(...)`; an out-of-memory program fails there
with `RESOURCE_EXHAUSTED`, before anyone waits for chips. A device then holds
arguments + outputs - aliased + temp.

The selector finds `check` by the `moe_cp.checks` entry point `maxtext_compile` and never
imports this module.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from selector.config import Config, Dispatch, Mode
from selector.findings import Finding, error, warning
from selector.maxtext.files import load_chain, parse_overrides
from selector.maxtext.importer import model_file_as_config
from selector.targets import TargetUnavailable

GIB = 2**30
TRAIN_COMPILE = "maxtext.trainers.pre_train.train_compile"
STATS = re.compile(r"Memory analysis: CompiledMemoryStats\((.*?)\)")
FIELDS = {
    "arguments": "argument_size_in_bytes",
    "outputs": "output_size_in_bytes",
    "aliased": "alias_size_in_bytes",
    "temp": "temp_size_in_bytes",
}
# Topology names count TensorCores: two a chip on v4 and v5p, one on v5e and v6e.
CORES_A_CHIP = {"v5p": 2, "v4": 2, "v5e": 1, "v6e": 1}
EXTRA = 'the maxtext extra (Python >= 3.12, with jax 0.12): pip install "moe-cp[maxtext,tpu]"'


@dataclasses.dataclass(frozen=True)
class MaxTextStep:
    """What MaxText's train_compile said of the step: status "ok" (its memory analysis
    read), "oom" (the compiler refused it: RESOURCE_EXHAUSTED), "failed" or "timeout"."""

    status: str
    command: str
    seconds: float
    arguments: int = 0
    outputs: int = 0
    aliased: int = 0
    temp: int = 0
    used_bytes: float = 0.0  # an out-of-memory compile: what it needed
    capacity_bytes: float = 0.0  # and what the chip has
    message: str = ""

    @property
    def device_bytes(self) -> float:
        """What a device holds: the compiled step's peak, or what an out-of-memory
        compile said it needed."""
        if self.status == "oom":
            return self.used_bytes
        return float(self.arguments + self.outputs - self.aliased + self.temp)

    def as_dict(self) -> dict:
        return {**dataclasses.asdict(self), "device_bytes": self.device_bytes}

    def summary(self, estimate_bytes: float | None) -> str:
        """The report's lines: what a device holds, beside the estimate."""
        head = f"MaxText's train step, compiled by its train_compile ({self.seconds:g} s):"
        if self.status == "ok":
            against = ""
            if estimate_bytes:
                rel = estimate_bytes / self.device_bytes - 1
                against = f"; the estimate says {estimate_bytes / GIB:.3g} GiB ({rel:+.1%})"
            return (
                f"{head}\n  a device holds {self.device_bytes / GIB:.3g} GiB (arguments "
                f"{self.arguments / GIB:.3g}, outputs {self.outputs / GIB:.3g}, aliased "
                f"{self.aliased / GIB:.3g}, temporaries {self.temp / GIB:.3g}){against}\n"
                f"  {self.command}"
            )
        return f"{head} {self.status}: {self.message}\n  {self.command}"


def parse_log(text: str) -> dict:
    """The compiled step's bytes from train_compile's output, or the failure it reports
    (`status` and `message`; `used_bytes`/`capacity_bytes` when out of memory)."""
    m = STATS.search(text)
    if m:
        kv = dict(re.findall(r"(\w+)=(\d+)", m.group(1)))
        return {"status": "ok", **{k: int(kv[v]) for k, v in FIELDS.items()}}
    lines = text.splitlines()
    oom = [ln for ln in lines if "RESOURCE_EXHAUSTED" in ln or "CompileTimeHbmOom" in ln]
    if oom:
        # libtpu 0.0.50.1: "... the total memory required for HLO temporaries (101.19G)
        # exceeds available HBM (95.73G)"; older: "Used 111.06G of 95.73G hbm". XLA prints
        # these with HumanReadableNumBytes, whose G is 2**30 bytes.
        joined = "\n".join(oom)
        m = re.search(
            r"HLO temporaries \(([\d.]+)([GMK])\) exceeds available HBM \(([\d.]+)([GMK])\)", joined
        )
        m = m or re.search(r"Used ([\d.]+)([GMK]) of ([\d.]+)([GMK]) hbm", joined)
        out: dict = {"status": "oom", "message": oom[-1].strip()[:600]}
        if m:
            scale = {"G": GIB, "M": 2**20, "K": 2**10}
            out["used_bytes"] = float(m.group(1)) * scale[m.group(2)]
            out["capacity_bytes"] = float(m.group(3)) * scale[m.group(4)]
        return out
    # MaxText's config validation names its reason on a "Value error, ..." line.
    errors = [ln.strip() for ln in lines if "Value error," in ln]
    errors = errors or [ln.strip() for ln in lines if re.search(r"(Error|error:|Check failed)", ln)]
    message = errors[-1] if errors else (lines[-1] if lines else "")
    return {"status": "failed", "message": message[:600]}


def topology(config: Config) -> tuple[str, int]:
    """(compile_topology, compile_topology_num_slices) for the config's TPU chips: the
    names MaxText's train_compile takes (v5p-16 is 8 chips)."""
    chip = config.hardware.name
    if chip not in CORES_A_CHIP:
        raise TargetUnavailable(
            f"compile=true on a MaxText config compiles MaxText's train step with its "
            f"train_compile, which this check runs for TPU slices only ({', '.join(CORES_A_CHIP)}); "
            f"hardware={chip} is not one. Set compile_topology= to a TPU slice (e.g. "
            f"v5p-128), or drop compile=true for the estimate alone."
        )
    slices = max(config.num_slices, 1)
    chips = (config.num_devices or 0) // slices
    return f"{chip}-{chips * CORES_A_CHIP[chip]}", slices


def maxtext_command(path: str, overrides: Sequence[str], config: Config, plan) -> list[str]:
    """train_compile's arguments: the MaxText config (base.yml beneath a model file, as
    the route reads it), the user's overrides that MaxText reads (this check's own keys,
    num_devices or chip, left out), the compile target, and the dispatch the plan chose
    in MaxText's keys (sparse_matmul=true: its grouped matmul; false: its capacity
    einsum)."""
    config_path, overrides, _ = model_file_as_config(Path(path), list(overrides))
    raw, _, _ = load_chain(config_path)
    given = parse_overrides(overrides)
    read = set(raw) | ({"model_name"} if given.get("model_name") else set())
    name, slices = topology(config)
    sparse = plan is None or plan.strategy in (Dispatch.megablox, Dispatch.mlp)
    written_here = {
        "compile_topology": name,
        "compile_topology_num_slices": slices,
        "sparse_matmul": "true" if sparse else "false",
    }
    keep = [o for o in overrides if (key := o.split("=", 1)[0]) in read and key not in written_here]
    return [str(config_path), *keep, *(f"{k}={v}" for k, v in written_here.items())]


def findings_of(step: MaxTextStep, config: Config, estimate_bytes: float | None) -> list[Finding]:
    """What the compile says for the launch: an out-of-memory step or a config MaxText
    refuses is an error; a compile that timed out is a warning."""
    est = f"{estimate_bytes / GIB:.3g} GiB" if estimate_bytes else "nothing"
    if step.status == "oom":
        needs = (
            f"needs {step.used_bytes / GIB:.3g} GiB per device where the compiler allows "
            f"{step.capacity_bytes / GIB:.3g}"
            if step.used_bytes
            else "does not fit"
        )
        found = error(
            "COMPILED_MEMORY_EXCEEDED",
            "compile",
            f"MaxText's train step, compiled by its train_compile for "
            f"{config.hardware.name} x {config.num_devices}, {needs} (the estimate said "
            f"{est}; the compiler: {step.message}). Shard the state over more devices "
            "(more fsdp or expert devices), lower per_device_batch_size or raise cp, save "
            "less for the backward (remat_policy=full), or tile the loss (num_vocab_tiling).",
        )
        why = "each fix would need another MaxText compile to verify; try them with compile=true"
        return [dataclasses.replace(found, no_fix=why)]
    if step.status == "failed":
        found = error(
            "MAXTEXT_STEP_NOT_COMPILED",
            "compile",
            f"MaxText's train_compile did not compile this config: {step.message}",
        )
        return [dataclasses.replace(found, no_fix="the message is MaxText's: fix what it names")]
    if step.status == "timeout":
        return [
            warning(
                "MAXTEXT_STEP_NOT_COMPILED",
                "compile",
                f"MaxText's train_compile gave no result ({step.message}); the estimate alone "
                "speaks for this config.",
            )
        ]
    return []


def available() -> bool:
    """MaxText is importable: a package with an origin (a folder named maxtext on the
    path, such as this project's tests/selector/maxtext, is a namespace package)."""
    spec = importlib.util.find_spec("maxtext")
    return spec is not None and spec.origin is not None


def check(
    path: str,
    overrides: Sequence[str],
    config: Config,
    plan,
    *,
    progress: Callable[[str], None] | None = None,
    timeout: float = 1800.0,
    python: str | None = None,
) -> tuple[MaxTextStep, list[Finding]]:
    """(MaxText's train step for `path` with `overrides`, compiled ahead of time by its
    train_compile for the config's TPU slice; the findings it makes). Raises
    TargetUnavailable naming the extra when `maxtext` is not importable, or when the
    config is not a training run on a TPU slice."""
    if python is None and not available():
        raise TargetUnavailable(
            "compile=true on a MaxText config compiles MaxText 0.2.5's own train step with "
            f"its train_compile, and maxtext is not importable here. Install {EXTRA}; or "
            "drop compile=true for the estimate alone."
        )
    if config.mode is not Mode.train:
        raise TargetUnavailable(
            f"compile=true on a MaxText config compiles MaxText's train step; mode="
            f"{config.mode.value} has none. Drop compile=true, or check mode=train."
        )
    args = maxtext_command(path, overrides, config, plan)
    command = [python or sys.executable, "-m", TRAIN_COMPILE, *args]
    shown = " ".join(["python", "-m", TRAIN_COMPILE, *args])
    if progress:
        progress(f"compiling MaxText's train step with its train_compile: {shown}")
    # Abstract TPU chips need no TPU: JAX's CPU backend drives libtpu's compiler.
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    start = time.monotonic()
    try:
        with tempfile.TemporaryDirectory(prefix="moe_cp_train_compile_") as workdir:
            proc = subprocess.run(
                command, env=env, capture_output=True, text=True, timeout=timeout, cwd=workdir
            )
        parsed = parse_log(proc.stdout + "\n" + proc.stderr)
    except subprocess.TimeoutExpired:
        parsed = {"status": "timeout", "message": f"no result within {timeout:.0f} s"}
    seconds = round(time.monotonic() - start, 1)
    if progress:
        progress(f"MaxText's train_compile: {parsed['status']} after {seconds} s")
    step = MaxTextStep(command=shown, seconds=seconds, **parsed)
    estimate = plan.chosen_estimate.device_bytes if plan is not None else None
    return step, findings_of(step, config, estimate)
