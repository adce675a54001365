"""The Hydra/OmegaConf edge: compose the packaged config, convert it to typed
dataclasses once, and read a live jax mesh without importing jax."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from hydra import compose as hydra_compose
from hydra import initialize_config_dir
from hydra.core.config_store import ConfigStore
from hydra.core.global_hydra import GlobalHydra
from omegaconf import DictConfig, OmegaConf

from .config import Config

SCHEMA_NAME = "base_config"


def conf_dir() -> Path:
    """The config tree: `selector/conf` in an installed wheel, `conf/` in a checkout."""
    here = Path(__file__).resolve().parent
    for candidate in (here / "conf", here.parent / "conf"):
        if (candidate / "config.yaml").is_file():
            return candidate
    raise FileNotFoundError(
        f"selector's config tree (config.yaml) is neither in {here / 'conf'} nor in "
        f"{here.parent / 'conf'}; reinstall the package."
    )


def register_schema() -> None:
    """Register the typed schema so `defaults: [base_config]` type-checks overrides."""
    ConfigStore.instance().store(name=SCHEMA_NAME, node=Config)


def compose(overrides: Sequence[str] = ()) -> DictConfig:
    """Compose the packaged config with Hydra overrides; works from any directory."""
    register_schema()
    hydra_global = GlobalHydra.instance()
    outer = None
    if hydra_global.is_initialized():  # called from inside someone's Hydra app
        outer = hydra_global.hydra
        hydra_global.clear()
    try:
        with initialize_config_dir(version_base=None, config_dir=str(conf_dir())):
            return hydra_compose(config_name="config", overrides=list(overrides))
    finally:
        if outer is not None:
            GlobalHydra.instance().initialize(outer)


_FIELDS = {f.name for f in dataclasses.fields(Config)}


def to_config(cfg: Any) -> Config:
    """A typed Config from a Config, a DictConfig or a plain mapping.

    Keys that are not Config fields (a user's own training keys, Hydra's node) are
    ignored; known keys are type-checked against the schema.
    """
    if isinstance(cfg, Config):
        return cfg
    if not isinstance(cfg, (DictConfig, Mapping)):
        raise TypeError(f"expected a Config, DictConfig or mapping, got {type(cfg).__name__}")
    # Read only our keys: resolving the whole node would also resolve a
    # `${moe_dispatch:}` that sits in it and asks for this very conversion.
    known = {k: cfg[k] for k in cfg.keys() if k in _FIELDS}
    merged = OmegaConf.merge(OmegaConf.structured(Config), known)
    return OmegaConf.to_object(merged)


def live_mesh_shape(mesh: Any) -> Mapping[str, int] | None:
    """Axis sizes of a `jax.sharding.Mesh` (or any object with a `.shape` mapping)."""
    if mesh is None:
        return None
    if isinstance(mesh, Mapping):
        return dict(mesh)
    return dict(mesh.shape)


def live_platform(mesh: Any) -> str | None:
    """'cpu', 'gpu' or 'tpu' for a live jax mesh; None for a plain mapping."""
    devices = getattr(mesh, "devices", None)
    if devices is None:
        return None
    first = devices.flat[0] if hasattr(devices, "flat") else devices[0]
    platform = getattr(first, "platform", None)
    return {"cuda": "gpu", "rocm": "gpu"}.get(platform, platform)
