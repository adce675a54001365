"""What the plan says in words and in JSON: the placement sentence, the placement's JSON
keys, and each candidate's verdict and the reason the pick won. Users and scripts read
these (the report, `output=json`), so they are pinned here word for word; mutation
testing (`nox -s mutate`) found every one of them unguarded."""

import dataclasses

import pytest
from helpers import typed

import selector
from selector.placement import describe
from selector.plan import analyse

BASE = ("allow_local_batch_inflation=true", "ici_data_parallelism=1")  # beside typed's
FSDP2_CP4 = (*BASE, "ici_fsdp_parallelism=2", "ici_context_parallelism=4")


def _plan(*overrides: str):
    cfg = typed(*overrides)
    return cfg, selector.resolve(cfg)


PLACEMENTS = {
    "gathered, training": (
        (*FSDP2_CP4, "expert_exchange=gather"),
        "rest sharded (embed over fsdp=2xcontext=4); the block all-gathers "
        "fsdp=2xcontext=4 once per step (FSDP-style), every device computes with all "
        "experts, and gradients come back reduce-scattered",
        {
            "exchange": "gather",
            "experts_axes": [],
            "embed_axes": ["fsdp", "context"],
            "hidden_axes": [],
            "group_axes": [],
            "folded_axes": [],
            "shared_embed_axes": ["fsdp", "context"],
            "experts_per_device": 8,
            "expert_group": "auto",
        },
    ),
    "exchanged": (
        (*FSDP2_CP4, "expert_exchange=all_to_all", "expert_group=expert_and_sequence"),
        "rest sharded (experts over context=4, embed over fsdp=2); expert parallel over "
        "context=4: each device computes with its 2 experts and routed rows travel to "
        "them by all-to-all and back",
        {
            "exchange": "all_to_all",
            "experts_axes": ["context"],
            "embed_axes": ["fsdp"],
            "hidden_axes": [],
            "group_axes": ["context"],
            "folded_axes": ["context"],
            "shared_embed_axes": ["fsdp"],
            "experts_per_device": 2,
            "expert_group": "expert_and_sequence",
        },
    ),
    "gathered, prefill, tensor": (
        (
            *BASE,
            "ici_fsdp_parallelism=1",
            "ici_tensor_parallelism=2",
            "ici_context_parallelism=4",
            "expert_exchange=gather",
            "mode=prefill",
        ),
        "rest sharded (embed over context=4, hidden over tensor=2); the block all-gathers "
        "context=4 once per step (FSDP-style), every device computes with all experts; "
        "the hidden dim stays split over tensor=2 inside the block (each shard computes "
        "its slice of every expert, the output is summed once)",
        {
            "exchange": "gather",
            "experts_axes": [],
            "embed_axes": ["context"],
            "hidden_axes": ["tensor"],
            "group_axes": [],
            "folded_axes": [],
            "shared_embed_axes": ["context"],
            "experts_per_device": 8,
            "expert_group": "auto",
        },
    ),
    "exchanged, fsdp in the group": (
        (*FSDP2_CP4, "expert_exchange=all_to_all", "expert_group=expert_sequence_and_fsdp"),
        "rest sharded (experts over fsdp=2xcontext=4); expert parallel over "
        "fsdp=2xcontext=4: each device computes with its 1 experts and routed rows "
        "travel to them by all-to-all and back",
        {
            "exchange": "all_to_all",
            "experts_axes": ["fsdp", "context"],
            "embed_axes": [],
            "hidden_axes": [],
            "group_axes": ["fsdp", "context"],
            "folded_axes": ["context"],
            "shared_embed_axes": ["fsdp"],
            "experts_per_device": 1,
            "expert_group": "expert_sequence_and_fsdp",
        },
    ),
    "replicated": (
        (*BASE, "ici_data_parallelism=8", "ici_fsdp_parallelism=1", "expert_exchange=gather"),
        "rest replicated; every device computes with all experts",
        {
            "exchange": "gather",
            "experts_axes": [],
            "embed_axes": [],
            "hidden_axes": [],
            "group_axes": [],
            "folded_axes": [],
            "shared_embed_axes": [],
            "experts_per_device": 8,
            "expert_group": "auto",
        },
    ),
}


@pytest.mark.parametrize("case", list(PLACEMENTS))
def test_placement_sentence_and_json(case):
    overrides, sentence, as_json = PLACEMENTS[case]
    cfg, plan = _plan(*overrides)
    training = cfg.mode.value == "train"
    assert describe(plan.placement, plan.mesh, training) == sentence
    assert plan.placement.as_dict() == as_json
    # The default speaks for training: the gradients' clause is there unless told.
    gathered = plan.placement.exchange.value == "gather" and plan.placement.embed_axes
    assert (", and gradients come back" in describe(plan.placement, plan.mesh)) == bool(gathered)


def _ms(x: float) -> str:
    return f"{x * 1e3:.3g}"


def _why(est) -> str:
    t = est.time_parts
    return (
        f"{_ms(est.time_s)} ms: compute {_ms(t.compute)}, memory {_ms(t.memory)}, "
        f"network {_ms(t.network)}, overhead {_ms(t.overhead)}"
    )


@pytest.mark.parametrize("capacity_factor", ["-1", "0"])  # both ask for dropless
def test_auto_pick_names_its_time_and_the_runner_up(capacity_factor):
    cfg, plan = _plan(*FSDP2_CP4, f"capacity_factor={capacity_factor}")
    by_name = {c.estimate.name: c for c in plan.candidates}
    chosen = plan.chosen_estimate
    others = [
        c.estimate
        for c in plan.candidates
        if c.estimate.name not in (chosen.name, "subgroup_capacity")
    ]
    runner_up = min(others, key=lambda e: e.time_s)
    assert plan.reason == (
        f"fastest dropless candidate that fits ({_why(chosen)}); "
        f"next: {runner_up.name} ({_why(runner_up)})"
    )
    assert by_name["subgroup_capacity"].verdict == (
        "drops tokens, but capacity_factor <= 0 asks for dropless"
    )
    assert {c.verdict for c in plan.candidates if c.estimate.name not in (chosen.name,)} == {
        "drops tokens, but capacity_factor <= 0 asks for dropless",
        "slower (estimated)",
    }


def test_explicit_dispatch_names_both_placements():
    cfg, plan = _plan(*FSDP2_CP4, "dispatch=megablox")
    ests = {(c.strategy.value, c.exchange.value): c.estimate for c in plan.candidates}
    chosen = plan.chosen_estimate
    other = ests[("megablox", "all_to_all" if chosen.name.endswith("gather") else "gather")]
    assert plan.reason == (
        f"requested explicitly with dispatch=megablox; weights "
        f"{chosen.name.split('/')[1]} ({_why(chosen)}) beat {other.name.split('/')[1]} "
        f"({_why(other)})"
    )
    verdicts = {c.estimate.name: c.verdict for c in plan.candidates}
    assert verdicts["dense"] == verdicts["subgroup_capacity"] == "not requested"
    assert verdicts[other.name] == "slower (estimated)"


def test_capacity_pick_and_what_the_others_would_do():
    _, plan = _plan(*FSDP2_CP4, "capacity_factor=1.5")
    assert plan.reason == (
        "capacity_factor=1.5 asks for capacity-limited routing; subgroup_capacity applies "
        "it per sequence shard and keeps the sequence sharded"
    )
    verdicts = {c.estimate.name: c.verdict for c in plan.candidates}
    assert verdicts.pop("subgroup_capacity") == "chosen"
    assert set(verdicts.values()) == {"dropless: would ignore capacity_factor"}


def _gib(x: float) -> str:
    return f"{x / 2**30:.3g} GiB"


@pytest.mark.parametrize("memory_gib", [0.015, 0.0001])
def test_over_the_chip_says_what_it_needs(memory_gib):
    """At 0.015 GiB only the exchange fits and wins; at 0.0001 nothing fits and the
    least-holding candidate is shown."""
    cfg = typed(*FSDP2_CP4, f"hardware.memory_gib={memory_gib}")
    plan, _ = analyse(cfg)
    limit = _gib(memory_gib * 2**30)
    fits = [c for c in plan.candidates if c.estimate.fits]
    for c in plan.candidates:
        if c.estimate.name == "subgroup_capacity" or c.estimate.fits:
            continue
        if c.estimate.name != plan.chosen_estimate.name:
            assert c.verdict == f"needs {_gib(c.estimate.device_bytes)} > {limit}"
    if fits:
        assert plan.reason.startswith("fastest dropless candidate that fits")
    else:
        assert plan.reason == "no candidate fits in memory; the one holding the least is shown"
        least = min(
            (c for c in plan.candidates if c.estimate.name != "subgroup_capacity"),
            key=lambda c: c.estimate.device_bytes,
        )
        assert least.verdict == "chosen: holds the least, still too much"


@pytest.mark.parametrize("hardware", ["cpu", "v5p"])
def test_candidate_json_carries_the_derived_numbers(hardware):
    """Each candidate's JSON holds the numbers the report prints: its names, what a
    device holds (with the breakdown, not the step object), the program's peak, the
    network split into weights and rows, and every tile priced."""
    _, plan = _plan(*FSDP2_CP4, f"hardware={hardware}", "num_devices=8")
    tiles = 0
    for c in plan.candidates:
        e = c.estimate
        d = e.as_dict()
        assert "step" not in d
        assert (d["strategy"], d["exchange"], d["name"]) == (
            e.strategy.value,
            e.exchange.value,
            e.name,
        )
        # Plain names, not the enums (which compare equal to them but are not JSON's).
        assert type(d["strategy"]) is str and type(d["exchange"]) is str
        assert d["device_bytes"] == e.device_bytes > 0
        assert d["device_breakdown"] == e.device_breakdown is not None
        assert d["memory"] == {**dataclasses.asdict(e.memory), "peak": e.memory.peak}
        assert d["traffic"] == {
            **dataclasses.asdict(e.traffic),
            "network": e.traffic.network,
            "weights_bytes": e.traffic.weights_bytes,
            "rows_bytes": e.traffic.rows_bytes,
        }
        assert d["tile_options"] == [
            {**dataclasses.asdict(o), "time_s": o.time_s} for o in e.tile_options
        ]
        assert d["flops"] == e.flops and d["rows"] == e.rows and d["fits"] == e.fits
        tiles += len(d["tile_options"])
        # The grouped matmul's tiling is the megablox candidates' (and reported).
        megablox = e.strategy.value == "megablox"
        assert (e.tiling is not None) == megablox, e.name
        assert d["tiling"] == (dataclasses.asdict(e.tiling) if megablox else None)
    assert (tiles > 0) == (hardware == "v5p")


@pytest.mark.parametrize(
    "hardware, backend",
    [("cpu", "all_to_all"), ("v5p", "ragged_all_to_all"), ("h200", "ragged_all_to_all")],
)
def test_rows_cross_by_the_platforms_collective(hardware, backend):
    """XLA:CPU has no ragged all-to-all: the exchange pads its buffers there; TPU and
    GPU send exactly the rows (the layers build the collective the plan names)."""
    _, plan = _plan(*FSDP2_CP4, f"hardware={hardware}", "num_devices=8")
    assert plan.exchange_backend == plan.as_dict()["exchange_backend"] == backend


def test_one_expert_is_a_plain_mlp_and_says_so():
    _, plan = _plan(*FSDP2_CP4, "num_experts=1", "num_experts_per_tok=1")
    assert plan.strategy.value == "mlp"
    assert plan.reason == "num_experts=1: a plain SwiGLU MLP, nothing to route"
    verdicts = {c.estimate.name: c.verdict for c in plan.candidates}
    assert verdicts.pop("mlp") == "chosen"
    assert set(verdicts.values()) == {"one expert: nothing to route"}


def test_nothing_fits_and_dropless_asked_the_capacity_path_is_not_the_pick():
    """capacity_factor <= 0 asks for dropless routing: when nothing fits, the candidate
    shown is the dropless one holding the least, even where the capacity path would hold
    less (its estimate set to the least here)."""
    from selector.policy import choose

    cfg, plan = _plan(*FSDP2_CP4)
    estimates = {}
    for i, c in enumerate(plan.candidates):
        held = 1.0 if c.strategy.value == "subgroup_capacity" else 2.0**30 * (i + 1)
        estimates[(c.strategy, c.exchange)] = dataclasses.replace(
            c.estimate, fits=False, compiled_step_bytes=held
        )
    chosen, reason, verdicts = choose(cfg, estimates)
    least = min(
        (k for k in estimates if k[0].value != "subgroup_capacity"),
        key=lambda k: estimates[k].device_bytes,
    )
    assert chosen == least
    assert reason == "no candidate fits in memory; the one holding the least is shown"
    assert verdicts[chosen] == "chosen: holds the least, still too much"


def test_capacity_asked_but_over_the_chip_falls_back_to_the_fastest_dropless():
    """capacity_factor=1.5 with the capacity path over the chip (26.5 MB a device at
    0.022 GiB = 23.6 MB) and the dropless ones under it: the fastest dropless runs."""
    cfg = typed(*FSDP2_CP4, "capacity_factor=1.5", "hardware.memory_gib=0.022")
    plan, _ = analyse(cfg)
    by_name = {c.estimate.name: c for c in plan.candidates}
    assert not by_name["subgroup_capacity"].estimate.fits
    assert plan.strategy.value == "megablox"
    assert plan.reason.startswith("fastest dropless candidate that fits")


GROUPS = {
    "decode": (
        ("mode=decode", "ici_fsdp_parallelism=2", "ici_context_autoregressive_parallelism=4"),
        (),
        "at mode=decode each sequence feeds one new token, which the sequence axes "
        "(context_autoregressive=4) do not split, so they cannot join the expert group",
    ),
    "expert only": (
        (
            "expert_group=expert",
            "ici_fsdp_parallelism=2",
            "ici_context_parallelism=2",
            "ici_context_usp_ulysses_parallelism=2",
        ),
        (),
        "expert_group=expert leaves the sequence axes (context=2 x context_usp_ulysses=2) out",
    ),
    "auto, indivisible": (
        ("num_experts=12", "ici_expert_parallelism=2", "ici_context_parallelism=4"),
        ("expert",),
        "expert_group=auto leaves the sequence axes (context=4) out, since with them the "
        "group of 8 devices would not split num_experts=12",
    ),
    "auto, folded": (
        ("ici_expert_parallelism=2", "ici_context_parallelism=4"),
        ("expert", "context"),
        "",
    ),
}


@pytest.mark.parametrize("case", list(GROUPS))
def test_the_expert_group_and_why_sequence_axes_stay_out(case):
    from selector.placement import GroupAxes, exchange_group

    overrides, axes, why = GROUPS[case]
    cfg = typed(*BASE, "ici_fsdp_parallelism=1", *overrides)
    plan, _ = analyse(cfg)
    folded = tuple(a for a in axes if a != "expert")
    assert exchange_group(cfg, plan.mesh) == GroupAxes(axes, folded, why)
