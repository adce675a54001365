"""Compile targets: abstract devices of the chips MoE models train on, so a program can be
compiled for a TPU slice or a GPU node, and its HLO and memory read, on a machine that
has neither. Nothing runs on them; `jax.jit(f).lower(...).compile()` is what they are for.

- TPU (v5p, v6e, v5e), by chips per slice and slices, through libtpu (`pip install
  "moe-cp[tpu]"`).
- GPU (H100, H200), by GPUs per host and hosts, through JAX's CUDA plugin (`pip install
  "moe-cp[gpu]"`) and a GPU description shipped with this package
  (`targets_data/gpu.json`, figures from XLA's public target configs, named there).
- CPU: the simulated host devices (`--xla_force_host_platform_device_count`).

    >>> from selector import targets
    >>> t = targets.Target("v5p", 8)
    >>> t.platform, t.describe()
    ('tpu', 'v5p, 8 chips (2x2x2)')
    >>> targets.Target.from_hardware("h200", num_devices=16, num_slices=2).describe()
    'h200, 2 hosts x 8 GPUs'

Compile GPU programs with `target.compile_options()`: autotuning needs a real GPU.
The devices themselves need jax, so `checks.targets.devices(target)` makes them; this
module, which names the target of a plan, imports no jax.
"""

from __future__ import annotations

import functools
import json
import math
import os
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
    return tuple(k for k in _gpu_facts() if not k.startswith("_"))


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


def prepare_process(platform: str, num_devices: int) -> None:
    """Set up a process that has not started jax to compile for `platform`: abstract TPU
    and GPU devices need only JAX's CPU backend; CPU targets need `num_devices` simulated
    devices, which XLA reads from XLA_FLAGS when jax starts. A no-op once jax runs."""
    import sys

    if "jax" in sys.modules:
        return
    if platform in ("tpu", "gpu"):
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
        return
    os.environ.setdefault("JAX_PLATFORMS", "cpu")  # not a plugin's backend
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        count = f"--xla_force_host_platform_device_count={num_devices}"
        os.environ["XLA_FLAGS"] = f"{flags} {count}".strip()


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
def _gpu_facts() -> dict:
    return json.loads(GPU_FILE.read_text())


def gpu_target_config(chip: str) -> str:
    """XLA's GpuTargetConfigProto for `chip`, in protobuf text form, written from the
    figures in `targets_data/gpu.json`."""
    f = _gpu_facts()[chip]

    def rates(name, rows):
        body = "".join(
            f"    rate_infos {{ key: {k} value {{ clock_rate_ghz: {clock} "
            f"units_per_core: {units} ops_per_clock: {ops} }} }}\n"
            for k, clock, units, ops in rows
        )
        return f"  {name} {{\n{body}  }}\n"

    major, minor = f["compute_capability"]
    bx, by, bz = f["block_dim_limit"]
    tx, ty, tz = f["thread_dim_limit"]
    scalars = (
        "threads_per_block_limit threads_per_warp shared_memory_per_block "
        "shared_memory_per_core threads_per_core_limit core_count fpus_per_core "
        "memory_bandwidth l2_cache_size clock_rate_ghz device_memory_size "
        "shared_memory_per_block_optin registers_per_core_limit registers_per_block_limit "
        "device_address_bits pcie_bandwidth"
    ).split()
    lines = "".join(f"  {k}: {f[k]}\n" for k in scalars)
    dnn = f["dnn_version"]
    return (
        "gpu_device_info {\n"
        + lines
        + f"  block_dim_limit_x: {bx}\n  block_dim_limit_y: {by}\n  block_dim_limit_z: {bz}\n"
        + f"  thread_dim_limit_x: {tx}\n  thread_dim_limit_y: {ty}\n  thread_dim_limit_z: {tz}\n"
        + f"  cuda_compute_capability {{ major: {major} minor: {minor}"
        + " feature_extension: ACCELERATED_FEATURES }\n"
        + rates("scalar_unit_description", f["scalar_rates"])
        + rates("matrix_unit_description", f["matrix_rates"])
        + '  device_vendor: "NVIDIA Corporation"\n'
        + f'  name: "{f["name"]}"\n'
        + f"  device_interconnect_info {{ active_links: {f['nvlink_active_links']} }}\n"
        + "}\n"
        + 'platform_name: "CUDA"\n'
        + f"dnn_version_info {{ major: {dnn[0]} minor: {dnn[1]} patch: {dnn[2]} }}\n"
        + f'device_description_str: "{f["name"]}"\n'
    )
