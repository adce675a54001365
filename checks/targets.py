"""The devices of a compile target (`selector.targets.Target`): abstract TPU chips
through libtpu, abstract GPUs through JAX's CUDA plugin, or this process's simulated
CPU devices. They need jax, so they are made here and not in the selector, which only
names a plan's target.
"""

from __future__ import annotations

import functools
import os

import jax
from jax._src import xla_bridge  # backends_are_initialized has no public spelling
from jax.experimental import topologies

from selector.targets import EXTRA, TPU_CHIPS, Target, TargetUnavailable, gpu_facts, torus


def devices(target: Target) -> list:
    """The target's devices, in JAX's order (abstract for TPU and GPU)."""
    return list(_devices(target))


@functools.cache
def _devices(target: Target) -> tuple:
    if target.platform == "cpu":
        have = jax.devices("cpu")
        if len(have) < target.num_devices:
            raise TargetUnavailable(
                f"{target.describe()} needs XLA_FLAGS=--xla_force_host_platform_device_count="
                f"{target.num_devices} set before jax starts; this process has {len(have)}."
            )
        return tuple(have[: target.num_devices])
    try:
        if target.platform == "tpu":
            # libtpu takes a machine-wide lock meant for a real TPU; compile-only
            # topologies need none, and two compiling processes would refuse each other.
            os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
            dims, host, config = TPU_CHIPS[target.chip]
            shape = torus(target.chip, target.per_slice)
            dims3 = (*shape, 1, 1)[:3]  # chips per host and wrap are given in 3 dims
            desc = topologies.get_topology_desc(
                platform="tpu",
                topology_name=f"{target.chip}:{'x'.join(map(str, shape))}",
                chip_config_name=config,
                chips_per_host_bounds=tuple(min(h, s) for h, s in zip(host, dims3, strict=True)),
                num_slices=target.slices,
                # v5p slices wrap around in each dim of 4 or more; v5e and v6e only
                # in a full 16 x 16 pod.
                wrap=tuple(s >= (4 if dims == 3 else 16) for s in dims3),
            )
        else:
            _cpu_backend_for_gpu_compiles()
            desc = topologies.get_topology_desc(
                platform="cuda",
                topology_name="",
                topology=f"1x{target.slices}x{target.per_slice}",
                target_config=gpu_target_config(target.chip),
            )
    except Exception as exc:  # the plugin is absent, or refuses the description
        raise _unavailable(target, exc) from exc
    return tuple(desc.devices)


def _cpu_backend_for_gpu_compiles() -> None:
    """On a machine without a GPU driver, JAX's CUDA plugin offers its compile-only
    topology only while JAX's backends are limited to the CPU (seen with jax 0.10.2):
    limit them, unless the process chose its platforms or has started its backends."""
    if not jax.config.jax_platforms and not xla_bridge.backends_are_initialized():
        jax.config.update("jax_platforms", "cpu")


def _unavailable(target: Target, exc: Exception) -> TargetUnavailable:
    extra = EXTRA[target.platform]
    return TargetUnavailable(
        f"Cannot compile for {target.describe()}: JAX's {target.platform.upper()} compiler "
        f"plugin is not usable here ({type(exc).__name__}: {str(exc).splitlines()[0][:200]}). "
        f'Install it with pip install "moe-cp[{extra}]" (it pins the plugin to the '
        f"installed jax), then run again"
        + (
            "; for a GPU target on a machine without a GPU driver, start with "
            "JAX_PLATFORMS=cpu (this process had started its backends first)."
            if target.platform == "gpu"
            else "."
        )
    )


def gpu_target_config(chip: str) -> str:
    """XLA's GpuTargetConfigProto for `chip`, in protobuf text form, written from the
    figures in `selector/targets_data/gpu.json` (`selector.targets.gpu_facts`).

    Args:
      chip: a GPU the package describes ("h100", "h200").

    Returns:
      The proto's text, for `jax.experimental.topologies.get_topology_desc`.

    Example:
      >>> from checks.targets import gpu_target_config
      >>> 'name: "NVIDIA H200 141GB HBM3e"' in gpu_target_config("h200")
      True
    """
    f = gpu_facts()[chip]

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
