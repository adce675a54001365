"""One answer per decision, and every error a fix or a reason (issue 29): the expert
group the exchange folds (decode included), fixes on every error code, ConfigError for
every bad value from the Python API, non-finite numbers, and to_config defaulting as
compose does."""

import dataclasses
import itertools

import pytest
from helpers import codes, typed
from test_selector_findings import CASES

import selector
from selector.config import Config, Exchange
from selector.findings import Severity
from selector.placement import exchange_group, expert_groups
from selector.plan import analyse

# The reported command: decode on the decode axis, experts asked to be exchanged.
DECODE_REPORTED = (
    "model=deepseek_v3",
    "mode=decode",
    "ici_context_autoregressive_parallelism=4",
    "per_device_batch_size=1",
    "expert_exchange=all_to_all",
    "expert_group=expert_and_sequence",
    "param_dtype=bfloat16",
)


def _config(*overrides: str) -> Config:
    return selector.to_config(selector.compose(list(overrides)))


def test_decode_group_is_empty_not_indivisible_and_its_fixes_exchange():
    """256 experts do split over 4 devices: the decode axis is left out of the group
    because it does not split the one new token, and the finding says exactly that."""
    cfg = _config(*DECODE_REPORTED)
    plan, found = analyse(cfg)
    group = exchange_group(cfg, plan.mesh)
    assert group.axes == () and "mode=decode" in group.left_out
    by_code = {f.code: f for f in found}
    assert "EXPERTS_NOT_DIVISIBLE_BY_GROUP" not in by_code
    empty = by_code["EXPERT_GROUP_EMPTY"]
    assert "mode=decode" in empty.message and "context_autoregressive=4" in empty.message
    exchanged = [f for f in empty.fixes if "expert_exchange=gather" not in f.render()]
    assert exchanged, empty.message
    for fix in exchanged:
        fixed_plan, after = analyse(cfg.apply(fix.overrides))
        assert "EXPERT_GROUP_EMPTY" not in codes(after), fix.render()
        placed = fixed_plan.placement
        assert placed.exchange is Exchange.all_to_all, fix.render()
        assert not set(placed.group_axes) & set(fixed_plan.mesh.sequence_axes)


GRID = list(
    itertools.product(
        ("train", "decode"),
        ("auto", "expert", "expert_and_sequence", "expert_sequence_and_fsdp"),
        ((1, 2), (2, 2), (2, 1), (1, 1), (1, 4)),  # (expert, context_autoregressive)
        (8, 6),  # num_experts
    )
)


@pytest.mark.parametrize("mode,group_rule,sizes,experts", GRID)
def test_the_check_and_the_placement_read_one_group(mode, group_rule, sizes, experts):
    """Where the exchange is placed, its group is exchange_group's (with
    expert_group=auto, one of the groups auto weighs, `expert_groups`); where it cannot
    be, the error names exchange_group's group and is the right one of the two."""
    expert, autoregressive = sizes
    cfg = typed(
        f"mode={mode}",
        f"expert_group={group_rule}",
        f"ici_expert_parallelism={expert}",
        f"ici_context_autoregressive_parallelism={autoregressive}",
        f"num_experts={experts}",
        "expert_exchange=all_to_all",
        "dispatch=megablox",
        "per_device_batch_size=1",
        "max_target_length=64",
        "allow_local_batch_inflation=true",
    )
    plan, found = analyse(cfg)
    group = exchange_group(cfg, plan.mesh)
    size = plan.mesh.product(group.axes)
    if mode == "decode":
        assert not set(group.axes) & set(plan.mesh.sequence_axes)
    exchange_errors = codes(found) & {"EXPERT_GROUP_EMPTY", "EXPERTS_NOT_DIVISIBLE_BY_GROUP"}
    weighed = expert_groups(cfg, plan.mesh)
    if group_rule == "auto" and weighed:
        assert not exchange_errors, [f.message for f in found]
        assert plan.placement.group_axes in {p.group_axes for p in weighed}
        assert experts % plan.mesh.product(plan.placement.group_axes) == 0
    elif size > 1 and experts % size == 0:
        assert not exchange_errors, [f.message for f in found]
        assert plan.placement.exchange is Exchange.all_to_all
        assert plan.placement.group_axes == group.axes
        assert plan.placement.experts_per_device == experts // size
    elif size <= 1:
        assert exchange_errors == {"EXPERT_GROUP_EMPTY"}
    else:
        assert exchange_errors == {"EXPERTS_NOT_DIVISIBLE_BY_GROUP"}
        (f,) = [f for f in found if f.code == "EXPERTS_NOT_DIVISIBLE_BY_GROUP"]
        assert f"= {size} devices" in f.message


# (mesh and mode, the group, the sequence axes folded, the router's and shared experts'
# embed axes) with expert_group=expert_sequence_and_fsdp.
FSDP_GROUPS = {
    "train": (
        ("ici_fsdp_parallelism=2", "ici_context_parallelism=4", "mode=train"),
        ("fsdp", "context"),
        ("context",),
        ("fsdp",),
    ),
    # At decode the context axes stay out (the one new token is not split by them).
    "decode": (
        ("ici_fsdp_parallelism=2", "ici_context_autoregressive_parallelism=4", "mode=decode"),
        ("fsdp",),
        (),
        ("fsdp", "context_autoregressive"),
    ),
    "no sequence axis": (("ici_fsdp_parallelism=8", "mode=train"), ("fsdp",), (), ("fsdp",)),
    # data splits the tokens but not the weights: it stays out.
    "data stays out": (
        ("ici_data_parallelism=2", "ici_fsdp_parallelism=2", "ici_context_parallelism=2"),
        ("fsdp", "context"),
        ("context",),
        ("fsdp",),
    ),
}


@pytest.mark.parametrize("case", list(FSDP_GROUPS))
def test_fsdp_joins_the_group_only_when_asked_and_the_experts_rest_split_over_it(case):
    """expert_group=expert_sequence_and_fsdp puts fsdp (it splits the tokens and the
    weights' embedding dim) first in the group: the experts rest split over it instead
    of the embedding dim, E / group a device, while the router and the shared experts
    keep it on their embedding dim; auto leaves fsdp out."""
    mesh, group, folded, shared = FSDP_GROUPS[case]
    more = ("per_device_batch_size=1", "max_target_length=64", "dispatch=megablox")
    more += ("allow_local_batch_inflation=true", "expert_exchange=all_to_all", "num_devices=8")
    asked = _config(*mesh, *more, "expert_group=expert_sequence_and_fsdp")
    plan, found = analyse(asked)
    placed = plan.placement
    assert placed.group_axes == group, [f.message for f in found]
    assert placed.folded_axes == folded
    assert placed.shared_embed_axes == shared
    assert placed.experts_axes == placed.group_axes
    assert "fsdp" not in placed.embed_axes
    size = plan.mesh.product(group)
    assert placed.experts_per_device == asked.num_experts // size
    auto = _config(*mesh, *more)
    assert "fsdp" not in exchange_group(auto, analyse(auto)[0].mesh).axes


# Triggers beyond CASES: the reported ones, and one per code CASES triggers only in part.
EXTRA_ERRORS = [
    ("ici_context_parallelism=3",),  # the reported MESH_NOT_DIVISIBLE, on 64 v5p chips
    DECODE_REPORTED,
    ("num_devices=64", "num_slices=3"),
    ("per_device_batch_size=inf",),
    ("routed_scaling_factor=nan",),
    ("hardware.memory_gib=inf",),
    ("axis_rules.batch=[data,fsdp,fsdp]",),
    ("axis_rules.experts=[tensor]", "ici_tensor_parallelism=2", "ici_fsdp_parallelism=2"),
    ("axis_rules.hidden=[fsdp]",),
    ("ici_fsdp_parallelism=-1", "ici_data_parallelism=-1"),
    ("dcn_data_parallelism=2",),
]


def _full(*overrides: str) -> tuple[str, ...]:
    """Compose from the tiny model on 8 CPUs unless the overrides pick a model."""
    picks_model = any(o.startswith("model=") for o in overrides)
    return overrides if picks_model else ("model=tiny", "mesh=cpu_8", *overrides)


@pytest.mark.parametrize(
    "overrides",
    [c[2] for c in CASES if c[1] == "error"] + EXTRA_ERRORS,
    ids=[c[0] for c in CASES if c[1] == "error"] + [" ".join(e)[:40] for e in EXTRA_ERRORS],
)
def test_every_error_offers_a_working_fix_or_says_why_none(overrides):
    if overrides == EXTRA_ERRORS[0]:
        found = selector.validate(selector.compose(list(overrides)))  # the default mesh
    else:
        found = selector.validate(selector.compose(list(_full(*overrides))))
    errors = [f for f in found if f.severity is Severity.error]
    assert errors, overrides
    for f in errors:
        assert f.fixes or f.no_fix, f"{f.code} offers no fix and says not why: {f.message}"
        if not f.fixes:
            assert f.no_fix in f.message and f.as_dict()["no_fix"] == f.no_fix


def test_the_reported_mesh_error_offers_a_verified_fix():
    (f,) = [f for f in selector.validate(selector.compose(["ici_context_parallelism=3"]))]
    assert f.code == "MESH_NOT_DIVISIBLE" and f.fixes
    for fix in f.fixes:
        assert not [
            e
            for e in selector.validate(_config(*fix.render().split()))
            if e.severity is Severity.error
        ], fix.render()


FLOAT_KNOBS = [
    f.name for f in dataclasses.fields(Config) if f.type == "float" and f.name != "capacity_factor"
] + ["hardware.memory_gib", "hardware.hbm_bandwidth_gbps"]


@pytest.mark.parametrize("knob,value", list(itertools.product(FLOAT_KNOBS, ("inf", "-inf", "nan"))))
def test_non_finite_numbers_get_their_own_message(knob, value):
    found = [f for f in selector.validate(typed(f"{knob}={value}")) if f.setting == knob]
    assert [f.code for f in found] == ["VALUE_NOT_FINITE"], [f.message for f in found]
    word = "NaN" if value == "nan" else "infinite"
    assert word in found[0].message and "positive" not in found[0].message


@pytest.mark.parametrize(
    "override,key,says",
    [
        ("per_device_batch_size=abc", "per_device_batch_size", "takes a number"),
        ("per_device_batch_size=", "per_device_batch_size", "takes a number"),
        ("num_devices=abc", "num_devices", "whole number or null"),
        ("dispatch=megabox", "dispatch", "Did you mean megablox"),
        ("mode=trian", "mode", "takes one of train, prefill, decode"),
        ("allow_local_batch_inflation=maybe", "allow_local_batch_inflation", "true or false"),
        ("axis_rules.batch=abc", "axis_rules.batch", "list of mesh axes"),
        ("hardware.memory_gib=abc", "hardware.memory_gib", "takes a number"),
        ("model=nope", "model", "Available model presets"),
        ("num_experts=1,2", "num_experts", "add -m"),
        ("x==", "x", "key=value"),
        ("num_experts=" + "9" * 5000, "num_experts", "whole number"),
        ("ici_contex_parallelism=4", "ici_contex_parallelism", "ici_context_parallelism"),
    ],
    ids=lambda v: v[:40] if isinstance(v, str) else None,
)
def test_compose_raises_config_error_naming_the_key_and_the_fix(override, key, says):
    with pytest.raises(selector.ConfigError) as caught:
        selector.compose([override])
    (f,) = caught.value.findings
    assert f.setting == key and says in f.message, f.message
    assert "\n" not in f.message


@pytest.mark.parametrize(
    "mapping,key,says",
    [
        ({"num_experts": "abc"}, "num_experts", "takes a whole number"),
        ({"dispatch": "megabox"}, "dispatch", "Did you mean megablox"),
        ({"hardware": {"memory_gib": "x"}}, "hardware.memory_gib", "takes a number"),
    ],
)
def test_to_config_raises_config_error_naming_the_key_and_the_fix(mapping, key, says):
    with pytest.raises(selector.ConfigError) as caught:
        selector.to_config(mapping)
    (f,) = caught.value.findings
    assert f.code == "VALUE_TYPE_INVALID" and f.setting == key and says in f.message


@pytest.mark.parametrize(
    "mapping,overrides",
    [
        ({"num_experts": 8}, ["num_experts=8"]),
        ({}, []),
        ({"model": "tiny"}, ["model=tiny"]),
        (
            {"mesh": "cpu_8", "per_device_batch_size": 0.5},
            ["mesh=cpu_8", "per_device_batch_size=0.5"],
        ),
    ],
)
def test_to_config_defaults_as_compose_does(mapping, overrides):
    assert selector.to_config(mapping) == selector.to_config(selector.compose(overrides))


# The auto pick and an explicit dispatch's exchange, each where the fastest candidate is
# not the first by name (a pick made without the time key would differ).
QWEN3_NEXT_CP4 = (
    "model=qwen3_next_80b_a3b",
    "ici_context_parallelism=4",
    "per_device_batch_size=0.25",
    "num_devices=64",
)
PICKS = [
    (QWEN3_NEXT_CP4, ("megablox", "all_to_all")),  # auto: dense/gather comes first by name
    (QWEN3_NEXT_CP4 + ("dispatch=megablox",), ("megablox", "all_to_all")),
    (("model=tiny", "ici_expert_parallelism=2", "dispatch=megablox"), ("megablox", "gather")),
]


@pytest.mark.parametrize("overrides,expected", PICKS)
def test_the_pick_is_the_fastest_candidate_it_may_run(overrides, expected):
    plan, _ = analyse(_config(*overrides))
    (chosen,) = [c for c in plan.candidates if c.chosen]
    assert (chosen.strategy.value, chosen.exchange.value) == expected
    asked = plan.config.dispatch
    may_run = [
        c
        for c in plan.candidates
        if c.estimate.fits
        and c.strategy.value != "subgroup_capacity"
        and (asked.value == "auto" or c.strategy is asked)
    ]
    assert len(may_run) > 1 and chosen in may_run
    assert chosen.estimate.time_s == min(c.estimate.time_s for c in may_run)
    for c in may_run:
        if c is not chosen:
            assert c.verdict == "slower (estimated)", c.estimate.name
    # The reason names the runner-up: the next fastest (by exchange when one dispatch
    # was asked for).
    runner_up = sorted(may_run, key=lambda c: c.estimate.time_s)[1]
    named = runner_up.estimate.name if asked.value == "auto" else runner_up.exchange.value
    assert f"; next: {named} (" in plan.reason or f" beat {named} (" in plan.reason


def test_auto_weighs_the_exchange_and_an_asked_exchange_narrows_every_dispatch():
    mesh = ("model=tiny", "ici_expert_parallelism=2")
    plan, _ = analyse(_config(*mesh))
    assert {(c.strategy.value, c.exchange.value) for c in plan.candidates} == {
        ("subgroup_capacity", "gather"),
        ("megablox", "gather"),
        ("megablox", "all_to_all"),
        ("dense", "gather"),
    }
    plan, _ = analyse(_config(*mesh, "expert_exchange=all_to_all"))
    assert [(c.strategy.value, c.exchange.value) for c in plan.candidates] == [
        ("megablox", "all_to_all")
    ]


def test_capacity_asked_by_name_without_a_capacity_factor_is_priced_and_refused():
    """dispatch=subgroup_capacity with capacity_factor=0: the plan shows what it would
    hold (the error's fixes compare against it) and the error says why not to run it."""
    plan, found = analyse(_config("model=tiny", "dispatch=subgroup_capacity", "capacity_factor=0"))
    (chosen,) = [c for c in plan.candidates if c.chosen]
    assert chosen.strategy.value == "subgroup_capacity" and chosen.estimate.fits
    assert chosen.verdict == "chosen"
    assert plan.reason == "requested explicitly with dispatch=subgroup_capacity"
    assert "CAPACITY_REQUIRED" in codes(found)


def test_the_analysis_runs_once_per_config_and_once_per_fix_it_checks(monkeypatch):
    """The README's error case: one analysis of the config, one more per fix a finding
    proposes (each checked by analysing the fixed config), none for the report; and the
    step outside the MoE blocks and the block's problem are counted once per analysis,
    not once per candidate."""
    import collections

    from selector import plan as plan_module
    from selector import step_memory as step_module

    calls = collections.Counter()

    def counted(name, fn):
        def wrapper(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)

        return wrapper

    analysed, original = [], plan_module._analyse

    def recorded(cfg, live_shape):
        analysed.append(cfg)
        return original(cfg, live_shape)

    monkeypatch.setattr(plan_module, "_analyse", counted("analyse", recorded))
    monkeypatch.setattr(plan_module, "estimate", counted("estimate", plan_module.estimate))
    monkeypatch.setattr(
        step_module, "model_params", counted("model_params", step_module.model_params)
    )
    monkeypatch.setattr(
        plan_module, "config_problem", counted("config_problem", plan_module.config_problem)
    )
    cfg = typed(
        "model=qwen3_next_80b_a3b",
        "ici_context_parallelism=4",
        "per_device_batch_size=1",
        "max_target_length=8192",
    )
    plan, findings = plan_module.analyse(cfg)
    proposed = sum(len(f.tried) for f in findings)
    errors = [f for f in findings if f.severity is Severity.error]
    assert proposed > 0 and errors
    # No config is analysed twice: the config, each fix checked (those proposed, and
    # those completed with a batch), and at most the joint fixes' merges of the errors.
    assert len(set(analysed)) == len(analysed) == calls["analyse"]
    joint = plan_module.JOINT_FIX_CHOICES ** len(errors) if len(errors) > 1 else 0
    assert 1 + proposed <= calls["analyse"] <= 1 + proposed + joint
    # The model's parameters are counted for the step once per analysis, not per
    # candidate; the block's problem is made once per analysis and placed per candidate.
    assert calls["model_params"] <= calls["analyse"] < calls["estimate"]
    assert calls["config_problem"] == calls["analyse"]


def _stops(cfg: Config) -> list[tuple[str, str]]:
    """The selector modules one analysis of `cfg` passes the config through, in order:
    each call that takes the config (a `Config` among its arguments) in a module other
    than the last one's starts a stop. Calls inside the config's own module (its
    properties and methods) are not stops."""
    import sys
    from pathlib import Path

    from selector import plan as plan_module

    root = Path(plan_module.__file__).parent
    stops: list[tuple[str, str]] = []

    def profile(frame, event, arg):
        if event != "call":
            return
        path = Path(frame.f_code.co_filename)
        if root not in path.parents or path.name == "config.py":
            return
        if any(isinstance(value, Config) for value in frame.f_locals.values()):
            module = str(path.relative_to(root))
            if not stops or stops[-1][0] != module:
                stops.append((module, frame.f_code.co_name))

    sys.setprofile(profile)
    try:
        plan_module._analyse(cfg, None)
    finally:
        sys.setprofile(None)
    return stops


@pytest.mark.parametrize(
    "overrides",
    [
        ("model=tiny", "mesh=cpu_8", "ici_context_parallelism=4", "per_device_batch_size=0.25"),
        ("model=qwen3_next_80b_a3b", "mesh=v5p_128", "hardware=v5p"),
        ("model=deepseek_v3", "mesh=v5p_128", "hardware=v5p", "mode=decode"),
        # Findings whose fixes move devices between axes and add slices.
        (
            "model=mixtral_8x7b",
            "mesh=h200_8",
            "hardware=h200",
            "ici_context_parallelism=2",
            "ici_fsdp_parallelism=4",
        ),
    ],
)
def test_one_analysis_passes_the_config_through_fewer_than_20_stops(overrides):
    """The analysis reads the config once per stage: the rules, the mesh, the per-device
    numbers, the placements, the step outside the MoE blocks (the model's layers walked
    once), the block's problem (made once, then placed per candidate, which reads the
    config no more), the choice and the findings. Re-reading it per candidate or per
    layer would bounce between modules (62 stops for the first case before the problem
    was made once per config)."""
    stops = _stops(typed(*overrides))
    modules = [module for module, _ in stops]
    assert len(stops) < 20, stops
    # Each candidate's count takes the problem, not the config.
    assert "cost.py" not in modules and "memory_model.py" not in modules, stops
    assert modules.count("problem.py") == 1 and modules.count("architecture.py") == 1, stops


@pytest.mark.parametrize(
    ("over", "target"),
    [
        (("mesh=v5p_128",), "v5p, 64 chips (4x4x4)"),
        (
            ("mesh=v5p_128", "num_slices=2", "dcn_fsdp_parallelism=2"),
            "v5p, 32 chips (2x4x4), 2 slices",
        ),
        (
            ("mesh=h200_8", "num_devices=16", "num_slices=2", "dcn_fsdp_parallelism=2"),
            "h200, 2 hosts x 8 GPUs",
        ),
    ],
)
def test_the_plan_names_the_target_it_compiles_for(over, target):
    """The plan says which chips, slices and slice shape its config compiles for."""
    plan, found = selector.api.analyse_any(
        selector.to_config(selector.compose(["model=qwen3_30b_a3b", *over]))
    )
    assert plan is not None, [f.code for f in found]
    assert plan.target == target


def test_a_candidate_lists_the_groups_it_weighed_only_where_there_was_a_choice():
    """Qwen3-30B-A3B on 64 v5p (fsdp 16 x context 4): the exchange weighs more than one
    expert group and lists each; a candidate with one possible placement lists none."""
    plan, _ = selector.api.analyse_any(
        selector.to_config(
            selector.compose(["model=qwen3_30b_a3b", "mesh=v5p_128", "ici_context_parallelism=4"])
        )
    )
    listed = {c.estimate.name: len(c.groups) for c in plan.candidates}
    assert listed["megablox/all_to_all"] >= 2, listed
    assert listed["dense"] == 0 and listed["megablox/gather"] == 0, listed
