"""Compile targets: abstract devices of the chips MoE models train on, so a program can be
compiled for a TPU slice or a GPU node, and its HLO and memory read, on a machine that
has neither. Nothing runs on them; `jax.jit(f).lower(...).compile()` is what they are for.

- TPU (v5p, v6e, v5e), by chips per slice and slices, through libtpu (`pip install
  "moe-cp[tpu]"`).
- GPU (H100, H200), by GPUs per host and hosts, through JAX's CUDA plugin (`pip install
  "moe-cp[gpu]"`) and a GPU description shipped with this package
  (`targets_data/gpu.json`, figures from XLA's public target configs, named there).
- CPU: the simulated host devices (`checks.jax_start.prepare_process` asks XLA for them).

    >>> from selector import targets
    >>> t = targets.Target("v5p", 8)
    >>> t.platform, t.describe()
    ('tpu', 'v5p, 8 chips (2x2x2)')
    >>> targets.Target.from_hardware("h200", num_devices=16, num_slices=2).describe()
    'h200, 2 hosts x 8 GPUs'

Compile GPU programs with `target.compile_options()`: autotuning needs a real GPU.
The devices themselves need jax, so `checks.targets.devices(target)` makes them (with
XLA's GPU target description written from `gpu_facts()`), and `checks.jax_start` sets
a process up for them; this module, which names the target of a plan, imports no jax.
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass
from pathlib import Path

TPU_CHIPS = {  # generation -> (torus dims, chips per host, chip config name)
    "v5p": (3, (2, 2, 1), "megacore"),
    "v6e": (2, (2, 2, 1), "default"),
    "v5e": (2, (2, 2, 1), "default"),
}
GPU_FILE = Path(__file__).resolve().parent / "targets_data" / "gpu.json"
GPU_PER_HOST = 8
EXTRA = {"tpu": "tpu", "gpu": "gpu"}  # pip extra that brings each compiler
# Compiling for a GPU here: no autotuning (it times kernels on a device).
GPU_COMPILE_OPTIONS = {"xla_gpu_autotune_level": 0, "xla_gpu_shard_autotuning": False}


class TargetUnavailable(RuntimeError):
    """The compiler for a target is not installed (the message names the extra)."""


def gpu_chips() -> tuple[str, ...]:
    return tuple(k for k in gpu_facts() if not k.startswith("_"))


@dataclass(frozen=True)
class Target:
    """A compile target: abstract devices of real chips, for compiling on a laptop.

    Args:
      chip: a TPU generation ("v5p", "v6e", "v5e"), a GPU ("h100", "h200"), or "cpu".
      per_slice: devices in each slice (TPU chips of one ICI slice, GPUs of one host).
      slices: how many (DCN-connected slices, or hosts).

    `checks.targets.devices(target)` returns the abstract devices (XLA:TPU through
    libtpu, the `tpu` extra; XLA:GPU through JAX's CUDA plugin, the `gpu` extra; a
    missing plugin raises TargetUnavailable naming the extra), `.compile_options()`
    what the compiler needs.

    Example:
      >>> from selector.targets import Target
      >>> Target("v5p", 8).describe()
      'v5p, 8 chips (2x2x2)'
      >>> Target("h200", 8, 2).describe(), Target("h200", 8, 2).platform
      ('h200, 2 hosts x 8 GPUs', 'gpu')
    """

    chip: str
    per_slice: int
    slices: int = 1

    def __post_init__(self):
        known = (*TPU_CHIPS, *gpu_chips(), "cpu")
        if self.chip not in known:
            raise ValueError(f"unknown chip {self.chip!r}: one of {', '.join(known)}")
        if self.per_slice < 1 or self.slices < 1:
            raise ValueError(f"a target needs >= 1 device and slice, not {self}")

    @classmethod
    def from_hardware(cls, chip: str, num_devices: int, num_slices: int = 1) -> Target:
        """The target a selector config describes (`hardware.name`, `num_devices`,
        `num_slices`); GPU hosts hold 8 GPUs, and slices of GPUs are their hosts."""
        if num_devices < 1 or num_slices < 1:
            raise ValueError(f"{num_devices} devices in {num_slices} slices describe no target")
        if chip in gpu_chips() and num_slices == 1 and num_devices > GPU_PER_HOST:
            num_slices = num_devices // GPU_PER_HOST
        if num_devices % num_slices:
            raise ValueError(f"{num_devices} devices do not split into {num_slices} slices")
        return cls(chip, num_devices // num_slices, num_slices)

    @property
    def platform(self) -> str:
        return "tpu" if self.chip in TPU_CHIPS else "cpu" if self.chip == "cpu" else "gpu"

    @property
    def num_devices(self) -> int:
        return self.per_slice * self.slices

    def describe(self) -> str:
        if self.platform == "tpu":
            many = f", {self.slices} slices" if self.slices > 1 else ""
            shape = "x".join(map(str, torus(self.chip, self.per_slice)))
            return f"{self.chip}, {self.per_slice} chips ({shape}){many}"
        if self.platform == "gpu":
            if self.slices == 1:
                return f"{self.chip}, {self.per_slice} GPUs"
            return f"{self.chip}, {self.slices} hosts x {self.per_slice} GPUs"
        return f"cpu, {self.num_devices} simulated devices"

    def compile_options(self) -> dict:
        """Options for `.compile(compiler_options=...)` on this target."""
        return dict(GPU_COMPILE_OPTIONS) if self.platform == "gpu" else {}


def describe(chip: str, num_devices: int, num_slices: int = 1) -> str:
    """The compile target a config describes, in words ("" when `chip` is not one this
    module compiles for, or the devices make no slice of it)."""
    try:
        return Target.from_hardware(chip, num_devices, num_slices).describe()
    except ValueError:
        return ""


def torus(chip: str, chips: int) -> tuple[int, ...]:
    """The slice shape of `chips` chips of a TPU generation: powers of two, as even as
    they go, larger dims last (v5p 8 -> 2x2x2, 64 -> 4x4x4; v6e 8 -> 2x4)."""
    if chips & (chips - 1):
        raise ValueError(f"a {chip} slice has a power-of-two chip count, not {chips}")
    dims, _, _ = TPU_CHIPS[chip]
    shape = [1] * dims
    for i in range(int(math.log2(chips))):
        shape[i % dims] *= 2
    return tuple(sorted(shape))


@functools.cache
def gpu_facts() -> dict:
    """The GPU descriptions shipped with this package (`targets_data/gpu.json`): each
    chip's figures from XLA's public target configs, named there."""
    return json.loads(GPU_FILE.read_text())
