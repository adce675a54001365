"""Shared test helpers."""

import selector
from selector.config import Config

BASE = ("model=tiny", "mesh=cpu_8")


def typed(*overrides: str) -> Config:
    """The typed config for the tiny model on the 8-device CPU mesh plus overrides."""
    return selector.to_config(selector.compose([*BASE, *overrides]))


# Twelve experts on an expert axis of 8 (and no fsdp): the experts do not divide it.
TWELVE_EXPERTS_ON_EIGHT = ("num_experts=12", "ici_expert_parallelism=8", "ici_fsdp_parallelism=1")


def codes(findings) -> set[str]:
    return {f.code for f in findings}


def problem(*overrides: str):
    """(config, plan, the per-device problem the cost and memory models price) for
    `typed`'s config plus overrides."""
    from selector.problem import problem_shape

    cfg = typed(*overrides)
    plan = selector.resolve(cfg)
    return cfg, plan, problem_shape(cfg, plan.mesh, plan.placement)


def routed_findings(base, over) -> list:
    """The MaxText route's findings for a file and overrides, as the command reports
    them: the importer's and the analysis', each fix run on the route (re-read with the
    files in MaxText's keys) by the one fix search, knobs in MaxText's spelling."""
    from selector.maxtext import analyse_on_route

    return analyse_on_route(selector.from_maxtext(base, over), base, over)[1]


# DeepSeek-V3 decoding on v5p-128 (fsdp 64), 2 sequences of 8,192 a device, bfloat16
# weights: the decode whose gathered experts move 22.3 GB a device a layer.
DEEPSEEK_DECODE = (
    "model=deepseek_v3",
    "mesh=v5p_128",
    "mode=decode",
    "per_device_batch_size=2",
    "max_target_length=8192",
    "param_dtype=bfloat16",
)
