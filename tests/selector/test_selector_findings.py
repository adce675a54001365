"""Each finding: one config that triggers it and a near one that does not."""

import dataclasses

import pytest
from helpers import TWELVE_EXPERTS_ON_EIGHT, codes, typed

import selector
from selector import Severity

CP4 = ("ici_context_parallelism=4", "max_target_length=8192")
# 8 devices that only split the batch (no fsdp, whose devices can hold the experts).
DATA_ONLY = ("ici_fsdp_parallelism=1", "ici_data_parallelism=-1")
NEXT_CP4 = ("model=qwen3_next_80b_a3b", "mesh=v5p_128", *CP4, "per_device_batch_size=0.25")
# Decode with experts exchanged over expert=2 beside the decode axis (2 devices).
DECODE_EP = (
    "mode=decode",
    "expert_exchange=all_to_all",
    "ici_expert_parallelism=2",
    "ici_context_autoregressive_parallelism=2",
)

# (code, severity, overrides that trigger it, near overrides that do not)
CASES = [
    (
        "ULYSSES_SPLITS_HEADS",
        "error",
        # Ulysses over context=4 with the tiny model's 2 key/value heads; over 2 they divide.
        (
            "context_parallel_strategy=ulysses",
            "ici_context_parallelism=4",
            "per_device_batch_size=0.25",
        ),
        (
            "context_parallel_strategy=ulysses",
            "ici_context_parallelism=2",
            "per_device_batch_size=0.5",
        ),
    ),
    (
        "ULYSSES_SPLITS_HEADS",
        "error",
        # usp: the Ulysses share is context_usp_ulysses; context=4 beside it is a ring.
        (
            "context_parallel_strategy=usp",
            "ici_context_usp_ulysses_parallelism=4",
            "per_device_batch_size=0.25",
        ),
        (
            "context_parallel_strategy=usp",
            "ici_context_parallelism=2",
            "ici_context_usp_ulysses_parallelism=2",
            "per_device_batch_size=0.25",
        ),
    ),
    (
        "CONTEXT_STRATEGY_AXES",
        "error",
        # usp needs both its axes split: context=4 alone is not usp.
        (
            "context_parallel_strategy=usp",
            "ici_context_parallelism=4",
            "per_device_batch_size=0.25",
        ),
        (
            "context_parallel_strategy=ring",
            "ici_context_parallelism=4",
            "per_device_batch_size=0.25",
        ),
    ),
    (
        "TENSOR_SPLITS_HEADS",
        "error",
        # 2 key/value heads over tensor=4 (MaxText's compile refused it for Qwen3-Next).
        ("ici_tensor_parallelism=4", "ici_fsdp_parallelism=2", "per_device_batch_size=0.25"),
        ("ici_tensor_parallelism=2", "ici_fsdp_parallelism=4", "per_device_batch_size=0.5"),
    ),
    (
        "RECURRENCE_LOAD_BALANCED",
        "error",
        (*NEXT_CP4, "context_parallel_load_balance=true"),
        (*NEXT_CP4, "context_parallel_load_balance=false"),
    ),
    (
        "GMM_ROW_TILE_UNUSED",
        "warning",
        ("hardware=h100", "gmm_row_tile=64"),
        ("hardware=h100", "gmm_row_tile=0"),
    ),
    (
        "LOCAL_BATCH_INFLATION",
        "error",
        (*CP4, "per_device_batch_size=1"),
        (*CP4, "per_device_batch_size=0.25"),
    ),
    (
        "GLOBAL_BATCH_FRACTIONAL",
        "error",
        ("per_device_batch_size=0.3",),
        (
            "per_device_batch_size=0.25",
            "ici_fsdp_parallelism=2",
            "ici_data_parallelism=1",
            "ici_context_parallelism=4",
            "max_target_length=8192",
        ),
    ),
    (
        "GLOBAL_BATCH_EMPTY",
        "error",
        ("per_device_batch_size=1e-12",),
        ("per_device_batch_size=1",),
    ),
    ("VALUE_TOO_LARGE", "error", ("num_experts=100000",), ("num_experts=8",)),
    (
        "BATCH_NOT_DIVISIBLE",
        "error",
        ("per_device_batch_size=0.125",),
        ("per_device_batch_size=1",),
    ),
    (
        "SEQUENCE_NOT_DIVISIBLE",
        "error",
        ("ici_context_parallelism=4", "max_target_length=8190", "per_device_batch_size=0.25"),
        (
            "ici_context_parallelism=4",
            "max_target_length=8200",
            "per_device_batch_size=0.25",
            "context_parallel_load_balance=false",
        ),
    ),
    (
        "SEQUENCE_NOT_DIVISIBLE_LOAD_BALANCE",
        "error",
        ("ici_context_parallelism=4", "max_target_length=8196", "per_device_batch_size=0.25"),
        (
            "ici_context_parallelism=4",
            "max_target_length=8196",
            "per_device_batch_size=0.25",
            "context_parallel_load_balance=false",
        ),
    ),
    (
        "EXPERTS_NOT_DIVISIBLE",
        "error",
        ("num_devices=12", "ici_expert_parallelism=3"),
        ("num_devices=12", "ici_expert_parallelism=3", "num_experts=12"),
    ),
    (
        "HIDDEN_NOT_DIVISIBLE",
        "error",
        ("ici_tensor_parallelism=2", "base_moe_mlp_dim=129", "per_device_batch_size=0.5"),
        ("ici_tensor_parallelism=2", "base_moe_mlp_dim=130", "per_device_batch_size=0.5"),
    ),
    ("EMBED_NOT_DIVISIBLE", "error", ("base_emb_dim=60",), ("base_emb_dim=56",)),
    (
        "TOKENS_REPLICATED",
        "warning",
        ("ici_tensor_parallelism=2", "axis_rules.hidden=[]", "per_device_batch_size=0.5"),
        ("ici_tensor_parallelism=2", "per_device_batch_size=0.5"),
    ),
    (
        "CAPACITY_IGNORED",
        "warning",
        ("capacity_factor=1.25", "dispatch=megablox"),
        ("capacity_factor=-1", "dispatch=megablox"),
    ),
    (
        "CAPACITY_REQUIRED",
        "error",
        ("capacity_factor=-1", "dispatch=subgroup_capacity"),
        ("capacity_factor=1.5", "dispatch=subgroup_capacity"),
    ),
    (
        "CAPACITY_BELOW_ONE",
        "warning",
        (
            "capacity_factor=1",
            "max_target_length=16",
            "ici_context_parallelism=8",
            "per_device_batch_size=0.125",
        ),
        (
            "capacity_factor=1",
            "max_target_length=64",
            "ici_context_parallelism=8",
            "per_device_batch_size=0.125",
        ),
    ),
    (
        "DROPS_LIKELY",
        "warning",
        ("capacity_factor=1", "max_target_length=16"),
        ("capacity_factor=1.25", "max_target_length=4096"),
    ),
    (
        "MEMORY_EXCEEDED",
        "error",
        ("hardware.memory_gib=0.01", "max_target_length=8192"),
        ("hardware.memory_gib=16", "max_target_length=8192"),
    ),
    ("MESH_DEVICE_MISMATCH", "error", ("ici_fsdp_parallelism=4",), ("ici_fsdp_parallelism=8",)),
    ("MESH_FILL_AMBIGUOUS", "error", ("ici_data_parallelism=-1",), ("ici_data_parallelism=1",)),
    (
        "MESH_NOT_DIVISIBLE",
        "error",
        ("ici_context_parallelism=3",),
        ("ici_context_parallelism=2", "per_device_batch_size=0.5"),
    ),
    ("MESH_AXIS_INVALID", "error", ("ici_context_parallelism=0",), ("ici_context_parallelism=1",)),
    (
        "NUM_DEVICES_UNKNOWN",
        "error",
        ("num_devices=null",),
        ("num_devices=null", "ici_fsdp_parallelism=8"),
    ),
    ("NUM_DEVICES_INVALID", "error", ("num_devices=-8",), ("num_devices=8",)),
    ("VALUE_NOT_POSITIVE", "error", ("max_target_length=0",), ("max_target_length=1",)),
    (
        "VALUE_TOO_LARGE",
        "error",
        ("per_device_batch_size=1e300",),
        ("per_device_batch_size=1",),
    ),
    ("CAPACITY_FACTOR_INVALID", "error", ("capacity_factor=nan",), ("capacity_factor=1.5",)),
    ("TOPK_EXCEEDS_EXPERTS", "error", ("num_experts_per_tok=9",), ("num_experts_per_tok=8",)),
    ("DTYPE_UNKNOWN", "error", ("dtype=float64x",), ("dtype=bfloat16",)),
    ("DTYPE_UNKNOWN", "error", ("dtype=float8_e4m3fn",), ("param_dtype=float8_e4m3fn",)),
    ("PARAM_DTYPE_UNKNOWN", "error", ("param_dtype=fp8",), ("param_dtype=bfloat16",)),
    (
        "CAPACITY_COSTLY",
        "warning",
        (
            "model=qwen3_next_80b_a3b",
            "mesh=v5p_128",
            "capacity_factor=1.25",
            "max_target_length=16384",
        ),
        (
            "model=qwen3_next_80b_a3b",
            "mesh=v5p_128",
            "capacity_factor=1.25",
            "max_target_length=2048",
        ),
    ),
    ("HARDWARE_INVALID", "error", ("hardware.memory_gib=0",), ("hardware.memory_gib=1",)),
    (
        "DISPATCH_MLP_WITH_EXPERTS",
        "error",
        ("dispatch=mlp",),
        ("dispatch=mlp", "num_experts=1", "num_experts_per_tok=1"),
    ),
    (
        "DECODE_CONTEXT_PARALLEL",
        "error",
        ("mode=decode", "ici_context_parallelism=2", "per_device_batch_size=0.5"),
        ("mode=decode", "per_device_batch_size=1"),
    ),
    (
        "DECODE_TOKEN_REPEATED",
        "warning",
        ("mode=decode", "ici_context_autoregressive_parallelism=2", "per_device_batch_size=1"),
        (
            "mode=decode",
            "ici_context_autoregressive_parallelism=2",
            "per_device_batch_size=1",
            "axis_rules.batch=[data,fsdp,expert,context_autoregressive]",
            "axis_rules.sequence=[context,context_usp_ulysses]",
        ),
    ),
    (
        "AXIS_RULE_UNKNOWN_AXIS",
        "error",
        ("axis_rules.sequence=[context,contxt]",),
        ("axis_rules.sequence=[context]",),
    ),
    (
        "AXIS_RULE_CONFLICT",
        "error",
        ("axis_rules.batch=[data,fsdp,context]",),
        ("axis_rules.batch=[data,fsdp]",),
    ),
    (
        "EXCHANGE_NEEDS_MEGABLOX",
        "error",
        ("expert_exchange=all_to_all", "dispatch=dense", *CP4, "per_device_batch_size=0.25"),
        ("expert_exchange=all_to_all", "dispatch=megablox", *CP4, "per_device_batch_size=0.25"),
    ),
    (
        "EXPERT_GROUP_EMPTY",
        "error",
        ("expert_exchange=all_to_all", "dispatch=megablox", *DATA_ONLY),
        ("expert_exchange=all_to_all", "dispatch=megablox", *DATA_ONLY, "ici_expert_parallelism=2"),
    ),
    (
        "EXPERTS_NOT_DIVISIBLE_BY_GROUP",
        "error",
        (
            "expert_exchange=all_to_all",
            "expert_group=expert_and_sequence",
            "ici_context_parallelism=8",
            "num_experts=12",
            "per_device_batch_size=0.125",
        ),
        (
            "expert_exchange=all_to_all",
            "expert_group=expert_and_sequence",
            "ici_context_parallelism=4",
            "num_experts=12",
            "per_device_batch_size=0.25",
        ),
    ),
    (
        "EXPERT_GROUP_UNFOLDED",
        "warning",
        (*DECODE_EP, "expert_group=expert_and_sequence"),
        (*DECODE_EP, "expert_group=expert"),
    ),
    (
        "ROUTING_GROUPS_INVALID",
        "error",
        ("n_routing_groups=3", "topk_routing_group=1"),
        ("n_routing_groups=4", "topk_routing_group=2"),
    ),
    (
        "GMM_BACKEND_PLATFORM",
        "error",
        ("mesh=h100_8", "gmm_backend=pallas_megablox"),
        ("mesh=h100_8", "gmm_backend=tiled_gmm"),
    ),
    (
        "GMM_BACKEND_DENSE_WORK",
        "warning",
        ("mesh=h100_8", "gmm_backend=ragged_dot"),
        ("mesh=h100_8", "gmm_backend=auto"),
    ),
    (
        "SHARED_GATE_WITHOUT_EXPERTS",
        "error",
        ("shared_expert_gate=true",),
        ("shared_expert_gate=true", "shared_experts=1"),
    ),
    (
        "CAPACITY_ZERO",
        "warning",
        (
            "capacity_factor=0.5",
            "capacity_rounding=maxtext",
            "num_experts_per_tok=1",
            "max_target_length=8",
        ),
        (
            "capacity_factor=0.5",
            "capacity_rounding=ours",
            "num_experts_per_tok=1",
            "max_target_length=8",
        ),
    ),
    (
        "AXIS_RULE_DUPLICATE",
        "error",
        ("ici_expert_parallelism=2", "axis_rules.embed=[fsdp,expert]"),
        ("ici_expert_parallelism=2", "axis_rules.embed=[fsdp]"),
    ),
    (
        "AXIS_RULE_WEIGHTS_OFF_TOKENS",
        "error",
        ("axis_rules.batch=[data]",),
        ("axis_rules.batch=[data,fsdp]",),
    ),
]


@pytest.mark.parametrize("code,severity,trigger,near", CASES, ids=[c[0] for c in CASES])
def test_finding_triggers_and_near_miss_does_not(code, severity, trigger, near):
    found = selector.validate(typed(*trigger))
    hits = [f for f in found if f.code == code]
    assert hits, f"{code} not raised; got {codes(found)}"
    assert hits[0].severity is Severity(severity)
    assert hits[0].setting and len(hits[0].message) > 40
    # The setting names a knob of the config (a nested one by its root).
    knobs = {f.name for f in dataclasses.fields(selector.Config)}
    assert hits[0].setting.split(".")[0] in knobs, hits[0].setting
    if code in ("CAPACITY_ZERO", "CAPACITY_BELOW_ONE"):
        assert hits[0].fixes, f"{code} offers no fix"
    if hits[0].severity is Severity.error:  # a fix that works, or why there is none
        assert hits[0].fixes or hits[0].no_fix, code
    # The near config is valid, so the rule really ran on it and stayed quiet.
    near_found = selector.validate(typed(*near))
    assert code not in codes(near_found)
    assert not [f for f in near_found if f.severity is Severity.error], codes(near_found)


def test_every_rule_code_is_covered():
    """Every code any selector module emits (the first argument of an error( or
    warning( call) is triggered by a case above or named by another test module."""
    import re
    from pathlib import Path

    root = Path(selector.__file__).parent
    sources = "".join(p.read_text() for p in sorted(root.rglob("*.py")))
    # (?!XX): under mutation testing the source holds mutmut's copies of each function,
    # whose strings it wraps in XX...XX; those are not codes.
    emitted = set(re.findall(r'(?:error|warning)\(\s*"(?!XX)([A-Z][A-Z_]+)"', sources))
    assert len(emitted) > 50  # the pattern still finds them
    tests = "".join(p.read_text() for p in Path(__file__).parents[1].rglob("test_*.py"))
    # A code is covered by a CASES entry or named, quoted, by some test.
    covered = {c[0] for c in CASES} | {c for c in emitted if f'"{c}"' in tests}
    assert emitted <= covered, f"findings without a test: {sorted(emitted - covered)}"


def test_adding_a_setting_that_exists_is_override_invalid():
    with pytest.raises(selector.ConfigError) as caught:
        selector.compose(["+num_experts=4"])
    assert codes(caught.value.findings) == {"OVERRIDE_INVALID"}
    assert "num_experts=4 instead" in caught.value.findings[0].message


def test_inflation_message_gives_numbers_and_fix():
    (f,) = [
        x
        for x in selector.validate(typed(*CP4, "per_device_batch_size=1"))
        if x.code == "LOCAL_BATCH_INFLATION"
    ]
    assert "4 sequences" in f.message and "8,192 tokens" in f.message
    assert "per_device_batch_size=0.25" in f.message


def test_inflation_can_be_accepted_knowingly():
    cfg = typed(*CP4, "per_device_batch_size=1", "allow_local_batch_inflation=true")
    (f,) = [x for x in selector.validate(cfg) if x.code == "LOCAL_BATCH_INFLATION"]
    assert f.severity is Severity.warning
    assert selector.resolve(cfg).per_device.tokens_per_device == 8192


def test_resolve_raises_with_every_error():
    cfg = typed(
        "ici_context_parallelism=4",
        "max_target_length=8190",
        "dtype=nope",
        "per_device_batch_size=0.25",
    )
    with pytest.raises(selector.ConfigError) as info:
        selector.resolve(cfg)
    assert {"DTYPE_UNKNOWN"} <= codes(info.value.findings)
    cfg = typed("ici_context_parallelism=4", "max_target_length=8190", "per_device_batch_size=0.3")
    with pytest.raises(selector.ConfigError) as info:
        selector.resolve(cfg)
    assert {"SEQUENCE_NOT_DIVISIBLE", "GLOBAL_BATCH_FRACTIONAL"} <= codes(info.value.findings)


def test_warnings_never_block():
    plan = selector.resolve(typed("capacity_factor=1.25", "dispatch=megablox"))
    assert plan.warnings and not plan.errors


def test_live_mesh_findings():
    mesh = {"data": 2, "context": 2, "stage": 2}
    found = selector.validate(typed("per_device_batch_size=0.5"), mesh)
    assert "MESH_UNKNOWN_AXIS" in codes(found)
    found = selector.validate(
        typed("num_devices=16", "per_device_batch_size=0.5"), {"data": 2, "context": 4}
    )
    assert "NUM_DEVICES_FROM_MESH" in codes(found)
    assert "NUM_DEVICES_FROM_MESH" not in codes(
        selector.validate(typed("per_device_batch_size=0.5"), {"data": 2, "context": 4})
    )


def test_hidden_axis_cannot_also_split_the_tokens():
    found = selector.validate(
        typed(
            "ici_tensor_parallelism=2",
            "axis_rules.sequence=[context,tensor]",
            "per_device_batch_size=0.5",
        )
    )
    hits = [f for f in found if f.code == "AXIS_RULE_CONFLICT"]
    assert hits and hits[0].setting == "axis_rules.hidden"
    ok = typed(
        "ici_tensor_parallelism=2",
        "axis_rules.sequence=[context,tensor]",
        "axis_rules.hidden=[]",
        "per_device_batch_size=0.5",
    )
    assert "AXIS_RULE_CONFLICT" not in codes(selector.validate(ok))


def test_mesh_fill_ambiguous_names_the_knob():
    """The setting a user changes is the knob, not the bare axis name."""
    (f,) = [
        f
        for f in selector.validate(typed("ici_data_parallelism=-1"))
        if f.code == "MESH_FILL_AMBIGUOUS"
    ]
    assert f.setting.endswith("_parallelism") and f.setting.startswith("ici_"), f.setting


def test_a_rendered_fix_carries_the_value_that_was_checked():
    """A float in a fix renders short only where short is exact: per_device_batch_size
    0.01171875 rendered as 0.0117188 gave 256 devices a global batch of 3.0000128, so
    the fix as a user types it raised GLOBAL_BATCH_FRACTIONAL (found by the fix
    property test)."""
    from selector.findings import render_value

    for value in (0.01171875, 1 / 3, 0.25, 2.0, 1e-7, 12345678.5):
        assert float(render_value(value)) == value, value
    assert render_value(2.0) == "2"
    assert render_value(0.25) == "0.25"


def test_a_fractional_global_batch_is_shown_as_it_is_not_rounded_whole():
    """256 devices at per_device_batch_size 3.0000001/256: the global batch is not whole
    (GLOBAL_BATCH_FRACTIONAL), and the message must not print it as 3 sequences."""
    value = 3.0000001 / 256
    cfg = typed(
        "hardware=cpu",
        "num_devices=256",
        "ici_data_parallelism=256",
        f"per_device_batch_size={value!r}",
    )
    (f,) = [f for f in selector.validate(cfg) if f.code == "GLOBAL_BATCH_FRACTIONAL"]
    assert f"per_device_batch_size={value!r}" in f.message, f.message
    assert "= 3 sequences" not in f.message and "= 3.0000001" in f.message, f.message


def test_a_fix_that_unsets_a_setting_is_spelled_as_hydra_reads_it():
    """None is Hydra's `null` on the command line (a fix rendered `num_devices=None` did
    not parse; hypothesis found it through the fix-verification property)."""
    from selector.findings import fix, render_value

    assert render_value(None) == "null"
    rendered = fix(num_devices=None).render()
    assert rendered == "num_devices=null"
    assert selector.to_config(selector.compose(["model=tiny", rendered])).num_devices is None


def test_sizes_past_the_count_are_refused_at_their_bound():
    """num_experts is counted up to MAX_EXPERTS and refused past it, on its own setting
    with the bound in the message; where the schema default fails the next check (the
    default model routes 10 a token), the finding says what to do instead. The tokens
    bound names per_device_batch_size and offers the defaults. A non-finite size is
    VALUE_NOT_FINITE's alone."""
    from selector.rules.settings import MAX_EXPERTS, MAX_TOKENS

    assert "VALUE_TOO_LARGE" not in codes(selector.validate(typed(f"num_experts={MAX_EXPERTS}")))
    (found,) = [
        f
        for f in selector.validate(typed(f"num_experts={MAX_EXPERTS + 1}"))
        if f.code == "VALUE_TOO_LARGE"
    ]
    assert found.setting == "num_experts" and f"{MAX_EXPERTS:,} experts" in found.message
    assert [dict(f.overrides) for f in found.fixes] == [{"num_experts": 8}]
    (alone,) = selector.validate({"num_experts": 2**31})  # the default model, k = 10
    assert alone.code == "VALUE_TOO_LARGE" and not alone.fixes
    assert alone.message.endswith(
        "give num_experts the model's own value, or pick its preset with model=<name>."
    )
    seq = 8192
    (tokens,) = [
        f
        for f in selector.validate(
            typed(f"max_target_length={seq}", f"per_device_batch_size={MAX_TOKENS // seq + 1}")
        )
        if f.code == "VALUE_TOO_LARGE"
    ]
    assert tokens.setting == "per_device_batch_size" and f"{MAX_TOKENS:,} tokens" in tokens.message
    assert {k for f in tokens.fixes for k, _ in f.overrides} >= {"per_device_batch_size"}
    edge = typed(f"max_target_length={seq}", f"per_device_batch_size={MAX_TOKENS // seq}")
    assert "VALUE_TOO_LARGE" not in codes(selector.validate(edge))
    assert codes(selector.validate(typed("per_device_batch_size=inf"))) == {"VALUE_NOT_FINITE"}


def test_tokamax_backend_without_the_package_is_refused(monkeypatch):
    """gmm_backend=tokamax where tokamax is not installed: an error naming the setting
    and the install, not an ImportError when the layer first runs."""
    from selector.rules import settings as rule_settings

    real = rule_settings.importlib.util.find_spec
    monkeypatch.setattr(
        rule_settings.importlib.util,
        "find_spec",
        lambda name, *a: None if name == "tokamax" else real(name, *a),
    )
    found = selector.validate(typed("mesh=h100_8", "gmm_backend=tokamax"))
    hit = [f for f in found if f.code == "GMM_BACKEND_MISSING"]
    assert hit and hit[0].severity is Severity.error and hit[0].setting == "gmm_backend"
    assert "pip install tokamax" in hit[0].message
    assert "GMM_BACKEND_MISSING" not in codes(
        selector.validate(typed("mesh=h100_8", "gmm_backend=auto"))
    )


def test_the_capacity_below_one_fix_is_the_least_factor_that_clears_it():
    """Per-subgroup capacity is sub_seq x k / E x capacity_factor: the factor offered
    brings it to one token (E / (sub_seq x k), up to the hundredth), and a hundredth
    less leaves it under one. 2 tokens a subgroup x 2 / 8 experts: 2.0."""
    trigger = (
        "capacity_factor=1",
        "max_target_length=16",
        "ici_context_parallelism=8",
        "per_device_batch_size=0.125",
    )
    cfg = typed(*trigger)
    (hit,) = [f for f in selector.validate(cfg) if f.code == "CAPACITY_BELOW_ONE"]
    offered = [dict(x.overrides).get("capacity_factor", -1.0) for x in hit.fixes]
    (factor,) = [f for f in offered if f > 0]  # the other fix is dropless routing (-1)
    assert factor == pytest.approx(cfg.num_experts / (2 * cfg.num_experts_per_tok))
    fixed = typed(*trigger[1:], f"capacity_factor={factor}")
    assert "CAPACITY_BELOW_ONE" not in codes(selector.validate(fixed))
    short = typed(*trigger[1:], f"capacity_factor={factor - 0.01:.2f}")
    assert "CAPACITY_BELOW_ONE" in codes(selector.validate(short))


@pytest.mark.parametrize(("experts", "split"), [(64, 8), (6, 2)])
def test_an_empty_expert_group_is_offered_the_data_devices_as_experts(experts, split):
    """expert_exchange=all_to_all on 8 devices that only split the batch: the fix moves
    as many data devices to an expert axis as num_experts and data have in common (all
    8 for 64 experts, 2 for 6), and the fixed config has its expert group."""
    over = (*DATA_ONLY, "expert_exchange=all_to_all", f"num_experts={experts}")
    (hit,) = [f for f in selector.validate(typed(*over)) if f.code == "EXPERT_GROUP_EMPTY"]
    moves = [dict(x.overrides) for x in hit.fixes if "ici_expert_parallelism" in dict(x.overrides)]
    assert moves == [{"ici_data_parallelism": 8 // split, "ici_expert_parallelism": split}]
    fixed = typed(*over, f"ici_data_parallelism={8 // split}", f"ici_expert_parallelism={split}")
    assert "EXPERT_GROUP_EMPTY" not in codes(selector.validate(fixed))


def test_a_finding_whose_fixes_all_fail_says_what_was_checked():
    """A finding whose fixes the fix search ran and dropped names them, in its message
    and as its `no_fix` in the JSON: a user sees what was tried rather than a finding
    with no way out and no word why."""
    from selector.findings import fix, warning

    proposed = warning("X", "per_device_batch_size", "Something is off.", [fix(a=1), fix(b=2)])
    kept = proposed.with_fixes((), failed=proposed.fixes)
    assert kept.fixes == ()
    why = "No fix was found: each one checked (a=1; b=2) leaves it standing or adds an error."
    assert kept.message == f"Something is off. {why}"
    assert kept.as_dict()["no_fix"] == why
    # A reason given beside the fixes is said instead, and verified fixes are spelled.
    reasoned = dataclasses.replace(proposed, no_fix="Use a larger chip.")
    assert reasoned.with_fixes((), failed=proposed.fixes).message == (
        "Something is off. Use a larger chip."
    )
    assert proposed.with_fixes((fix(a=1),)).message == "Something is off. Fix: a=1."
    many = warning("X", "s", "Off.", [fix(a=n) for n in range(5)])
    assert "(a=0; a=1; a=2; and 2 more)" in many.with_fixes((), failed=many.fixes).message
    # Nothing run (no fix the route could spell): nothing claimed.
    assert proposed.with_fixes(()).message == "Something is off."


@pytest.mark.parametrize(
    ("overrides", "code", "completed"),
    [
        # fsdp=16 x context=2 on the default 64 chips: fsdp filling them puts 2 sequences
        # on each batch shard (LOCAL_BATCH_INFLATION), unless the batch halves too.
        (
            ("ici_fsdp_parallelism=16", "ici_context_parallelism=2"),
            "MESH_DEVICE_MISMATCH",
            "ici_fsdp_parallelism=-1 per_device_batch_size=0.5",
        ),
        # cp=3 does not divide 64 chips; cp=2 alone leaves 2 sequences a batch shard.
        (
            ("ici_context_parallelism=3", "max_target_length=8190", "per_device_batch_size=0.25"),
            "MESH_NOT_DIVISIBLE",
            "ici_context_parallelism=2 per_device_batch_size=0.5",
        ),
    ],
)
def test_a_mesh_fix_comes_with_the_batch_its_new_shards_need(overrides, code, completed):
    """A fix that moves devices changes the batch shards; where the only error it leaves
    is the batch's, it is offered with that error's batch fix, and applied it leaves no
    error (these two findings offered no fix before)."""
    found = selector.validate(selector.to_config(selector.compose(list(overrides))))
    (hit,) = [f for f in found if f.code == code]
    assert completed in [x.render() for x in hit.fixes]
    fixed = selector.to_config(selector.compose([*overrides, *completed.split()]))
    assert not [f for f in selector.validate(fixed) if f.severity is Severity.error]


def test_a_fix_is_completed_with_a_batch_only_where_a_new_batch_error_alone_stops_it():
    """`_with_batch_fix` on hand-made findings: a move left with only a new
    BATCH_NOT_DIVISIBLE takes that error's batch; not a fix that sets the batch itself,
    not one whose finding is a batch error, and not one that adds another error too."""
    from selector.findings import error, fix
    from selector.plan import _with_batch_fix

    mesh = error("MESH_DEVICE_MISMATCH", "num_devices", "m.", [fix(ici_fsdp_parallelism=-1)])
    move = mesh.fixes[0]
    batch = error(
        "BATCH_NOT_DIVISIBLE", "per_device_batch_size", "b.", [fix(per_device_batch_size=0.5)]
    )
    other = error("TENSOR_SPLITS_HEADS", "ici_tensor_parallelism", "t.", [])
    completed = _with_batch_fix(mesh, move, [batch], set())
    assert completed.overrides == (("ici_fsdp_parallelism", -1), ("per_device_batch_size", 0.5))
    assert completed.note == "per_device_batch_size=0.5 for the new batch shards"
    noted = _with_batch_fix(mesh, fix("fsdp fills them", ici_fsdp_parallelism=-1), [batch], set())
    assert noted.note == "fsdp fills them, per_device_batch_size=0.5 for the new batch shards"
    # The batch error's own note says what the batch becomes, where it has one.
    said = error(
        "BATCH_NOT_DIVISIBLE",
        "per_device_batch_size",
        "b.",
        [fix("global batch 8", per_device_batch_size=0.5)],
    )
    assert _with_batch_fix(mesh, move, [said], set()).note == "global batch 8"
    assert _with_batch_fix(mesh, move, [batch], {"BATCH_NOT_DIVISIBLE"}) is None  # not new
    assert _with_batch_fix(mesh, move, [batch, other], set()) is None
    assert _with_batch_fix(mesh, fix(per_device_batch_size=0.25), [batch], set()) is None
    inflated = error("LOCAL_BATCH_INFLATION", "per_device_batch_size", "i.", [move])
    assert _with_batch_fix(inflated, move, [batch], set()) is None  # a batch finding's own
    assert _with_batch_fix(mesh, move, [mesh, batch], set()) is None  # still standing


# Decode at cp 4 on a mesh of 16 devices (fsdp 4 x context 4) where there are 8.
DECODE_CP4_ON_16 = (
    "model=tiny",
    "mesh=cpu_8",
    "mode=decode",
    "ici_context_parallelism=4",
    "ici_fsdp_parallelism=4",
)


def test_an_error_a_fix_uncovers_is_fixed_after_it():
    """Decode at cp 4 on a mesh of 16 devices for 8: every mesh fix makes the mesh whole
    and leaves the sequence split at decode (DECODE_CONTEXT_PARALLEL), which the first
    error hid. Each such fix is offered followed by a fix of the error it uncovers, and
    applied, leaves no error (the finding said "No fix was found" before)."""
    over = (*DECODE_CP4_ON_16, "per_device_batch_size=1")
    (hit,) = [f for f in selector.validate(typed(*over)) if f.code == "MESH_DEVICE_MISMATCH"]
    assert len(hit.fixes) == 3 and not hit.no_fix
    # The one that doubles the devices says what that does to the global batch.
    said = [x.render() for x in hit.fixes if "global batch goes from 8 to 16" in x.note]
    assert said == ["num_devices=16 ici_data_parallelism=4 ici_context_parallelism=1"]
    for offered in hit.fixes:
        assert "alone leaves DECODE_CONTEXT_PARALLEL, which the rest clears" in offered.note
        fixed = typed(*over, *offered.render().split())
        assert not [f for f in selector.validate(fixed) if f.severity is Severity.error]


def test_a_fix_is_followed_only_by_the_fixes_of_the_one_error_it_uncovers():
    """`_then_fixes` on hand-made findings: the first two fixes of the one new error,
    each applied after the fix (its overrides winning where both set a knob); nothing
    where the finding stands, where the error was there before, or where two are new."""
    from selector.findings import error, fix
    from selector.plan import _lays_out_only, _then_fixes

    mesh = error("MESH_DEVICE_MISMATCH", "num_devices", "m.", [fix(ici_fsdp_parallelism=-1)])
    move = mesh.fixes[0]
    seconds = [
        fix("to data", ici_context_parallelism=1, ici_fsdp_parallelism=2),
        fix(num_experts_per_tok=1),  # changes the model: never a follow-up
        fix(ici_data_parallelism=4),
        fix(ici_tensor_parallelism=2),
    ]
    decode = error("DECODE_CONTEXT_PARALLEL", "ici_context_parallelism", "d.", seconds)
    other = error("TENSOR_SPLITS_HEADS", "ici_tensor_parallelism", "t.", [])
    then = _then_fixes(mesh, move, [decode], set())
    assert [x.overrides for x in then] == [
        (("ici_fsdp_parallelism", 2), ("ici_context_parallelism", 1)),
        (("ici_fsdp_parallelism", -1), ("ici_data_parallelism", 4)),
    ]
    assert then[0].note == (
        "ici_fsdp_parallelism=-1 alone leaves DECODE_CONTEXT_PARALLEL, which the rest clears"
    )
    assert then[1].note == then[0].note
    # Where the work runs, and only that, may follow: mesh axes, devices, slices, batch.
    for knob in ("ici_tensor_parallelism", "dcn_data_parallelism", "num_devices", "num_slices"):
        assert _lays_out_only(fix(**{knob: 2}))
    assert _lays_out_only(fix(per_device_batch_size=0.5, ici_data_parallelism=2))
    for knob in ("num_experts", "base_emb_dim", "param_dtype", "capacity_factor"):
        assert not _lays_out_only(fix(**{knob: 2}, ici_data_parallelism=2))
    assert _then_fixes(mesh, move, [mesh, decode], set()) == []  # still standing
    assert _then_fixes(mesh, move, [decode], {"DECODE_CONTEXT_PARALLEL"}) == []  # not new
    assert _then_fixes(mesh, move, [decode, other], set()) == []
    assert _then_fixes(mesh, move, [], set()) == []


def test_a_fix_that_uncovers_two_errors_is_named_with_what_it_adds():
    """Decode at cp 4 with a fractional batch on a 16-device mesh for 8: each mesh fix
    adds two errors, which one follow-up cannot clear. "No fix was found" then names
    each fix with the errors it adds, not only that it failed."""
    over = (*DECODE_CP4_ON_16, "per_device_batch_size=0.3")
    (hit,) = [f for f in selector.validate(typed(*over)) if f.code == "MESH_DEVICE_MISMATCH"]
    assert not hit.fixes
    assert hit.no_fix.startswith("No fix was found: ici_fsdp_parallelism=-1 adds ")
    assert hit.no_fix.count("GLOBAL_BATCH_FRACTIONAL and DECODE_CONTEXT_PARALLEL") == 3


def test_a_joint_fix_says_what_it_does_to_the_global_batch():
    """DeepSeek-V3 on 64 v5p at cp 4 with one sequence a device: the fix that clears
    the inflated batch and the memory together takes 256 chips, so the global batch goes
    from 64 to 256 sequences; the joint fix says so (a rule's own batch fix says it in
    its note, a joint one had not)."""
    over = ("model=deepseek_v3", "hardware=v5p", "ici_context_parallelism=4")
    over += ("per_device_batch_size=1", "max_target_length=8192")
    found = selector.validate(selector.to_config(selector.compose(list(over))))
    joint = {x for f in found for x in f.fixes if x.joint}
    assert joint and all("the global batch goes from 64 to 256 sequences" in x.note for x in joint)


def test_a_fix_made_by_the_search_says_the_batch_only_where_it_changes():
    """`_FixSearch._batch_said` on the tiny model's plan (global batch 8): nothing said
    without a plan, without a known batch, or where the batch stays; otherwise the change,
    after the fix's own note where it has one."""
    from selector.findings import fix
    from selector.plan import _FixSearch, analyse, native_route

    cfg = typed("model=tiny", "mesh=cpu_8")
    plan, _ = analyse(cfg)
    bigger, _ = analyse(typed("model=tiny", "mesh=cpu_8", "per_device_batch_size=2"))
    search = _FixSearch(native_route(cfg), None, [], cfg, plan)
    assert search.batch == 8
    plain, noted = fix(per_device_batch_size=2), fix("twice", per_device_batch_size=2)
    assert search._batch_said(plain, plan) is plain
    assert search._batch_said(plain, None) is plain
    said = "the global batch goes from 8 to 16 sequences"
    assert search._batch_said(plain, bigger).note == said
    assert search._batch_said(noted, bigger).note == f"twice; {said}"
    search.batch = None  # a live mesh with no plan: the batch is not known
    assert search._batch_said(plain, bigger) is plain
    # Without a plan, the config's own knobs give the batch, where they are known.
    assert _FixSearch(native_route(cfg), None, [], cfg).batch == 8
    assert _FixSearch(native_route(cfg), {"data": 8}, [], cfg).batch is None
    from selector.plan import _config_batch

    assert _config_batch(dataclasses.replace(cfg, per_device_batch_size=0.5)) == 4
    assert _config_batch(dataclasses.replace(cfg, per_device_batch_size=float("inf"))) is None
    assert _config_batch(dataclasses.replace(cfg, num_devices=None)) is None


def test_no_fix_offers_a_size_no_setting_takes():
    """tensor = expert = 2**40 (hypothesis's find): TENSOR_SPLITS_HEADS moved tensor's
    devices to expert, 2**79 of them, which the fix search ran (the config takes any int)
    and offered, though a config read from settings refuses a size past 2**63. Each fix
    offered now converts as a user's settings do."""
    over = [
        "model=tiny",
        "base_emb_dim=1",
        "base_moe_mlp_dim=1",
        "num_experts=1",
        "num_experts_per_tok=1",
        "base_num_decoder_layers=1",
        "per_device_batch_size=0.125",
        "max_target_length=1",
        f"ici_tensor_parallelism={2**40}",
        f"ici_expert_parallelism={2**40}",
        "ici_fsdp_parallelism=1",
        "hardware=cpu",
        "num_slices=1",
    ]
    cfg = dataclasses.replace(selector.to_config(selector.compose(over)), num_devices=None)
    found = selector.validate(cfg)
    assert "TENSOR_SPLITS_HEADS" in {f.code for f in found}
    settings = dataclasses.asdict(cfg)
    for f in found:
        for offered in f.fixes:
            fixed = {**settings, **{k: v for k, v in offered.overrides if "." not in k}}
            selector.to_config(fixed)  # raises ConfigError (VALUE_TOO_LARGE) if refused


def test_every_checked_fix_says_what_a_device_then_holds_and_whether_it_fits():
    """The README's error case (Qwen3-Next, cp 4, one sequence of 8,192 a device, 8 v5p
    chips by default): every fix the search keeps was analysed, so each says what a
    device then holds, whether that fits the chip and the verdict with its margin; and
    `fits` agrees with the held bytes against the chip's HBM."""
    over = ["model=qwen3_next_80b_a3b", "ici_context_parallelism=4"]
    over += ["per_device_batch_size=1", "max_target_length=8192"]
    cfg = selector.to_config(selector.compose(over))
    found = selector.validate(cfg)
    fixes = [x for f in found if f.severity.value == "error" for x in f.fixes]
    assert fixes
    chip = cfg.hardware.memory_gib * 2**30
    for fix in fixes:
        assert fix.held_bytes is not None and fix.verdict is not None, fix.render()
        assert fix.fits is (fix.held_bytes <= chip), (fix.render(), fix.held_bytes, fix.fits)


def test_no_joint_fix_where_the_merge_uncovers_an_error_the_plan_finds():
    """Two errors found before a plan is made (per_device_batch_size=0, a misspelt
    remat_policy) hide a third that the plan finds (E=12 on expert=8). Each error's own
    fix is offered, since it leaves the other standing; merged, they leave the experts'
    error, which comes with a plan. So no fix claims to clear both errors together."""
    cfg = typed(*TWELVE_EXPERTS_ON_EIGHT, "per_device_batch_size=0", "remat_policy=fulll")
    found = {f.code: f for f in selector.validate(cfg) if f.severity.value == "error"}
    assert set(found) == {"VALUE_NOT_POSITIVE", "REMAT_POLICY_UNKNOWN"}
    batch_fix, remat_fix = (
        next(x.render() for x in found[code].fixes if not x.joint)
        for code in ("VALUE_NOT_POSITIVE", "REMAT_POLICY_UNKNOWN")
    )
    assert (batch_fix, remat_fix) == ("per_device_batch_size=1", "remat_policy=full")
    merged = cfg.apply((("per_device_batch_size", 1), ("remat_policy", "full")))
    plan, after = selector.api.analyse_any(merged)
    assert plan is not None
    assert {f.code for f in after if f.severity.value == "error"} == {"EXPERTS_NOT_DIVISIBLE"}
    offered = [x for f in found.values() for x in f.fixes]
    assert not [x.render() for x in offered if x.joint or x.note.startswith("clears ")]
