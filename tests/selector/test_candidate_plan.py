"""Compile mode builds each candidate's block from the plan it already has
(`checks.compiled.candidate_plan`) instead of analysing the config again with the
candidate forced; both must give the block the same plan."""

import pytest

import selector

CONFIGS = {
    "cp4_fsdp2": [
        "ici_fsdp_parallelism=2",
        "ici_context_parallelism=4",
        "per_device_batch_size=0.25",
    ],
    "expert4_cp2": [
        "ici_expert_parallelism=4",
        "ici_context_parallelism=2",
        "per_device_batch_size=0.5",
    ],
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_a_candidate_of_the_plan_is_the_plan_forcing_it(name, jax_cpu8):
    from checks.compiled import candidate_plan
    from selector.api import analyse_any

    config = selector.to_config(selector.compose(["model=tiny", "mesh=cpu_8", *CONFIGS[name]]))
    plan = selector.resolve(config)
    assert len(plan.candidates) > 1
    for c in plan.candidates:
        # A forced candidate may carry errors (subgroup_capacity while dropless): the
        # check compiles it all the same.
        forced, _ = analyse_any(config.replace(dispatch=c.strategy, expert_exchange=c.exchange))
        ours = candidate_plan(plan, c.strategy, c.exchange)
        for field in (
            "strategy",
            "placement",
            "mesh",
            "per_device",
            "gmm_backend",
            "exchange_backend",
            "target",
            "training",
        ):
            assert getattr(ours, field) == getattr(forced, field), (c.name, field)
        assert ours.chosen_estimate == forced.chosen_estimate, c.name
