"""The Python API for training scripts: resolve, validate and the OmegaConf resolver."""

from __future__ import annotations

import dataclasses
from typing import Any

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from . import layout_search
from .checked import CompileCheck, MeasureCheck
from .compose import live_mesh_shape, live_platform, to_config
from .config import Config
from .findings import ConfigError, Finding, error, errors_in, shown, warning
from .layout_search import SearchResult
from .plan import DispatchPlan, analyse
from .plugins import check_mode


def _typed(cfg: Any, mesh: Any) -> tuple[Config, list[Finding]]:
    """The typed config, with the hardware platform taken from a live mesh."""
    config = to_config(cfg)
    platform = live_platform(mesh)
    notes = []
    if platform and platform != config.hardware.platform:
        notes.append(
            warning(
                "HARDWARE_PLATFORM_MISMATCH",
                "hardware",
                f"hardware={config.hardware.name} is a {config.hardware.platform} chip but the "
                f"live mesh runs on {platform}; the block uses the {platform} grouped-matmul "
                f"backend. Set hardware= to the chip you run on for true estimates.",
            )
        )
        hw = dataclasses.replace(config.hardware, platform=platform)
        config = dataclasses.replace(config, hardware=hw)
    return config, notes


def analyse_any(cfg: Any, mesh: Any = None) -> tuple[DispatchPlan | None, list[Finding]]:
    """(plan or None, every finding) without raising: what the CLI reports.

    The plan's findings include the notes about the live mesh."""
    config, notes = _typed(cfg, mesh)
    plan, findings = analyse(config, live_mesh_shape(mesh))
    findings = notes + findings
    if plan is not None and notes:
        plan = dataclasses.replace(plan, findings=tuple(findings))
    return plan, findings


def resolve(cfg: Any, mesh: Any = None) -> DispatchPlan:
    """The DispatchPlan for `cfg` on `mesh`.

    Args:
      cfg: a Config, DictConfig or mapping of settings.
      mesh: a live `jax.sharding.Mesh` (its shape wins over the config's mesh knobs), or
        None to use the config's mesh knobs and `num_devices`.

    Returns:
      The frozen DispatchPlan: `.strategy`, `.placement`, `.per_device`, `.reason`,
      `.estimates` (see the README's "The plan"). Raises `ConfigError` listing every
      finding when any is an error.

    Examples:
      >>> import selector
      >>> cfg = selector.compose(["model=tiny", "mesh=cpu_8", "ici_context_parallelism=4",
      ...                         "ici_fsdp_parallelism=2", "per_device_batch_size=0.25"])
      >>> plan = selector.resolve(cfg)
      >>> plan.strategy.value, plan.placement.exchange.value
      ('megablox', 'gather')
      >>> plan.per_device.tokens_per_device  # 2 sequences of 2048 over fsdp=2 x context=4
      512.0
    """
    plan, findings = analyse_any(cfg, mesh)
    if plan is None or errors_in(findings):
        raise ConfigError(findings)
    return plan


def compile_check(cfg: Any, mesh: Any = None, *, progress=None) -> CompileCheck:
    """Choose as `resolve` does, then compile the chosen candidate and the runner-up for
    the config's hardware on this machine (XLA:TPU through libtpu, XLA:GPU through JAX's
    CUDA plugin, XLA:CPU on simulated devices) and choose again with XLA's memory
    numbers.

    Args:
      cfg: a Config, DictConfig or mapping, as for `resolve`.
      mesh: a live mesh, or None (the config's mesh knobs).
      progress: called with each step's message (compiles take minutes at the real
        models' sizes).

    Returns:
      The CompileCheck: `.plan` (its choice follows the compiled numbers; pass it to
      `layers.MoEBlock(cfg, mesh=..., plan=...)`), `.compiled` (each candidate estimated
      beside compiled) and `.findings`. Raises ConfigError when the config has errors,
      before compiling or after (a compiled program that does not fit is
      COMPILED_MEMORY_EXCEEDED), and `selector.targets.TargetUnavailable` naming the
      extra to install when the compiler plugin is missing (or the `checks` package,
      `selector.plugins.ChecksUnavailable`).

    Examples:
      >>> import selector
      >>> checked = selector.compile_check(selector.compose(["model=tiny", "mesh=cpu_8"]))
      >>> checked.target, [c.name for c in checked.compiled], checked.changed
      ('cpu, 8 simulated devices', ['megablox/gather', 'megablox/all_to_all'], False)
      >>> checked.compiled[0].compiled.temp > 0  # XLA's bytes beside the estimate's
      True
    """
    config, notes = _typed(cfg, mesh)
    check = check_mode("compile")
    plan, findings, checked = check(config, live_mesh_shape(mesh), progress=progress)
    findings = notes + list(findings)
    if checked is None or errors_in(findings):
        raise ConfigError(findings)
    return checked


def measure_check(cfg: Any, mesh: Any = None, *, progress=None, time_fn=None) -> MeasureCheck:
    """Choose as `resolve` does, then time the estimate's choice and the next candidates
    that fit on this process's devices at the configured shape (interleaved rounds,
    `measure_rounds` of them) and choose the measured fastest.

    Args:
      cfg: a Config, DictConfig or mapping (`measure_save=PATH` also writes what was
        timed beside what was counted, as JSON).
      mesh: a live mesh, or None (the config's mesh on `jax.devices()`).
      progress: called with each step's message.
      time_fn: `(config, keys, rounds) -> {key: [seconds]}`; default: build and run each
        candidate here (`checks.measured.time_candidates`).

    Returns:
      The MeasureCheck: `.plan` (its choice follows the medians), `.measured` (each
      candidate's estimated and measured times). Raises ConfigError when the config has
      errors.

    Examples:
      >>> import selector
      >>> def times(config, keys, rounds):  # given timings: the last candidate fastest
      ...     return {k: [0.002 if k == keys[-1] else 0.003] * rounds for k in keys}
      >>> cfg = selector.compose(["model=tiny", "mesh=cpu_8", "measure_rounds=3"])
      >>> measured = selector.measure_check(cfg, time_fn=times)
      >>> [c.name for c in measured.measured], measured.plan.chosen_estimate.name
      (['megablox/gather', 'megablox/all_to_all', 'dense'], 'dense')
    """
    config, notes = _typed(cfg, mesh)
    measure = check_mode("measure")
    plan, findings, checked = measure(
        config, live_mesh_shape(mesh), time_fn=time_fn, progress=progress
    )
    findings = notes + list(findings)
    if checked is None or errors_in(findings):
        raise ConfigError(findings)
    return checked


def search(cfg: Any, *, progress=None) -> SearchResult:
    """The launch layouts of the config's chips that pass the check, best first.

    Holds the model, the chips (`hardware`, `num_devices` or the mesh preset's,
    `num_slices`), the sequence length and the global batch fixed, and enumerates the
    rest (`selector.layout_search`): the mesh over data, fsdp, context, expert and
    tensor, the per-device batch, the remat policy and the vocabulary tiling, each
    checked as a launch is (the dispatch and expert group chosen by that check).

    Args:
      cfg: a Config, DictConfig or mapping; the global batch is `search_global_batch`
        sequences, or `search_global_tokens` tokens, or per_device_batch_size times
        the devices.
      progress: called with (meshes done, meshes) as the search goes.

    Returns:
      The SearchResult: `.layouts` best first (sure fits, then those within the memory
      margin; each by the whole step's counted time), each with `.settings` (the
      overrides that select it), `.plan` and `.step` (its time parts); `.refused` counts
      the layouts each error refused.

    Examples:
      >>> import selector
      >>> cfg = selector.compose(["model=tiny", "mesh=cpu_8", "search_global_batch=8"])
      >>> found = selector.search(cfg)
      >>> best = found.layouts[0]
      >>> best.settings["per_device_batch_size"], best.verdict.value
      (1.0, 'yes')
      >>> selector.validate(selector.compose(["model=tiny", "mesh=cpu_8", *best.overrides]))
      []
    """
    return layout_search.search(to_config(cfg), progress=progress)


def validate(cfg: Any, mesh: Any = None) -> list[Finding]:
    """Every finding for `cfg` on `mesh`, for a pre-launch check.

    Args:
      cfg: anything: a Config, DictConfig, mapping, or not a config at all.
      mesh: a live `jax.sharding.Mesh`, or None.

    Returns:
      The list of Findings (each with `.code`, `.severity`, `.setting`, `.message` and
      verified `.fixes`); empty when the config is clean. Never raises for a bad config:
      a key nothing reads (UNKNOWN_SETTING), a value of the wrong type
      (VALUE_TYPE_INVALID) or something that is no config at all (CONFIG_NOT_A_MAPPING)
      is a finding like any other.

    Examples:
      >>> import selector
      >>> [f.code for f in selector.validate({"num_experts": 8, "num_experts_per_tok": 9})]
      ['TOPK_EXCEEDS_EXPERTS']
      >>> [f.code for f in selector.validate(42)]
      ['CONFIG_NOT_A_MAPPING']
    """
    try:
        return analyse_any(cfg, mesh)[1]
    except ConfigError as exc:
        return list(exc.findings)
    except OmegaConfBaseException as exc:  # OmegaConf refused a value for its type
        key = str(getattr(exc, "full_key", "") or "config")
        reason = str(exc).splitlines()[0][:200]
        return [
            error(
                "VALUE_TYPE_INVALID",
                key,
                f"{key} cannot take the value given: {reason}. Give a value of the "
                "setting's type (`python -m selector --cfg job` shows every key's default).",
            )
        ]
    except TypeError as exc:  # not a Config, DictConfig or mapping
        return [error("CONFIG_NOT_A_MAPPING", "config", f"{exc}. Pass a mapping of settings.")]
    except (ValueError, OverflowError, RecursionError) as exc:  # a value no setting holds
        return [
            error(
                "VALUE_TYPE_INVALID",
                "config",
                f"A value cannot be read as a setting ({type(exc).__name__}: "
                f"{shown(str(exc).splitlines()[0] if str(exc) else '')}). Give each setting "
                "a plain value of its type.",
            )
        ]


def _chosen(path: str, root) -> DispatchPlan:
    if path:  # a node of selector settings only: every other key is an error
        node = OmegaConf.select(root, path)
        if node is None:
            raise KeyError(
                f"no node {path!r} in the config: give the path of the node that holds the "
                "selector's settings (e.g. ${moe_dispatch:model.moe}), or none for the root."
            )
        config = to_config(node)
    else:
        config = to_config(root, others="misspellings")
    if config.compile:  # compile=true: the choice follows the compiled candidates
        return compile_check(config).plan
    return resolve(config)


def _moe_dispatch(path: str = "", *, _root_) -> str:
    return _chosen(path, _root_).strategy.value


def _moe_exchange(path: str = "", *, _root_) -> str:
    return _chosen(path, _root_).placement.exchange.value


def register_resolvers() -> None:
    """Register `${moe_dispatch:}` and `${moe_exchange:}` (each also as
    `${...:path.to.node}`) in OmegaConf.

    The resolvers read the selector's settings (MaxText spelling) from the node at
    `path`, where any other key is an error, or from the root of the user's config,
    where the app's own keys may sit beside them and only a key that looks like a
    misspelled setting (`num_expert`) is an error. `moe_dispatch` returns the chosen
    dispatch's name, `moe_exchange` how its expert weights meet the tokens (`gather` or
    `all_to_all`, the block's `expert_exchange`). A config with errors does not
    resolve: OmegaConf raises its InterpolationResolutionError, whose message holds the
    ConfigError's findings and fixes (call `selector.resolve` to catch ConfigError).

    Returns:
      None; the resolvers are registered (again, replacing any before).

    Examples:
      >>> import selector
      >>> from omegaconf import OmegaConf
      >>> selector.register_resolvers()
      >>> app = OmegaConf.create({"model": "tiny", "mesh": "cpu_8",
      ...                         "run": {"dispatch": "${moe_dispatch:}",
      ...                                 "exchange": "${moe_exchange:}"}})
      >>> app.run.dispatch, app.run.exchange
      ('megablox', 'gather')
    """
    OmegaConf.register_new_resolver("moe_dispatch", _moe_dispatch, replace=True)
    OmegaConf.register_new_resolver("moe_exchange", _moe_exchange, replace=True)
