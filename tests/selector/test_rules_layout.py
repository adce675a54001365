"""The batch and mesh rules a launch is checked against: the fixes each offers, as the
overrides a user would type, and the per-device numbers and device moves they rest on."""

from __future__ import annotations

import pytest
from helpers import typed

from selector.mesh import build_mesh_view
from selector.plan import analyse
from selector.rules.moves import move


def fixes_of(code: str, *overrides: str) -> list[dict]:
    _, found = analyse(typed(*overrides))
    (finding,) = [f for f in found if f.code == code]
    return [dict(x.overrides) for x in finding.fixes]


def test_an_inflated_local_batch_is_offered_the_batch_cut_and_the_context_devices_moved():
    """tiny on 8 devices at cp 4 with per_device_batch_size=1: 4 sequences a batch shard.
    The fixes: a quarter of the batch, or the same global batch with the context devices
    given to fsdp (the weights stay split) or to data."""
    assert fixes_of(
        "LOCAL_BATCH_INFLATION", "ici_context_parallelism=4", "per_device_batch_size=1"
    ) == [
        {"per_device_batch_size": 0.25},
        {"ici_fsdp_parallelism": 8, "ici_context_parallelism": 1},
        {"ici_data_parallelism": 4, "ici_fsdp_parallelism": 2, "ici_context_parallelism": 1},
    ]


def test_replicated_tokens_are_offered_the_batch_rule_or_the_devices_moved_to_data():
    """tensor=2 that splits no hidden dim (axis_rules.hidden=[]) repeats the tokens: name
    it in the batch rule, or give its devices to data."""
    over = ("ici_tensor_parallelism=2", "axis_rules.hidden=[]", "per_device_batch_size=1")
    assert fixes_of("TOKENS_REPLICATED", *over) == [
        {"axis_rules.batch": ["data", "fsdp", "expert", "tensor"]},
        {"ici_data_parallelism": 2, "ici_fsdp_parallelism": 4, "ici_tensor_parallelism": 1},
    ]


def test_replicated_tokens_at_half_a_sequence_a_device_are_offered_a_whole_batch():
    """At per_device_batch_size=0.5 the 4 sequences do not divide over the 8 batch shards
    either fix makes: each fix grows the global batch to 8 (per_device_batch_size=1),
    the same 2,048 tokens a device, no longer repeated, and each clears the warning."""
    over = ("ici_tensor_parallelism=2", "axis_rules.hidden=[]", "per_device_batch_size=0.5")
    fixes = fixes_of("TOKENS_REPLICATED", *over)
    assert fixes == [
        {"axis_rules.batch": ["data", "fsdp", "expert", "tensor"], "per_device_batch_size": 1},
        {
            "ici_data_parallelism": 2,
            "ici_fsdp_parallelism": 4,
            "ici_tensor_parallelism": 1,
            "per_device_batch_size": 1,
        },
    ]
    for applied in fixes:
        rendered = [f"{k}={v}".replace("'", "").replace(" ", "") for k, v in applied.items()]
        plan, found = analyse(typed(*over[:2], *rendered))
        assert not found
        assert plan.per_device.tokens_per_device == 2048
        assert plan.per_device.replication == 1


def test_experts_that_do_not_divide_the_expert_axis_are_offered_a_smaller_axis():
    """6 experts over expert=4 (fsdp 2): the expert axis shrinks to 2 (the largest size
    both divide) and its other devices go to fsdp or data, or the experts rest unsplit."""
    over = ("ici_expert_parallelism=4", "num_experts=6", "ici_fsdp_parallelism=2")
    assert fixes_of("EXPERTS_NOT_DIVISIBLE", *over) == [
        {"ici_fsdp_parallelism": 4, "ici_expert_parallelism": 2},
        {"ici_data_parallelism": 2, "ici_expert_parallelism": 2},
        {"axis_rules.experts": []},
    ]


def test_a_repeated_decode_token_is_offered_the_decode_axis_in_the_batch_rule():
    """At decode, context_autoregressive=2 repeats each new token on its devices: the
    MoE block names it in its batch rule, and the sequence rule keeps the other axes."""
    over = ("mode=decode", "ici_context_autoregressive_parallelism=2", "per_device_batch_size=1")
    assert fixes_of("DECODE_TOKEN_REPEATED", *over) == [
        {
            "axis_rules.batch": ["data", "fsdp", "expert", "context_autoregressive"],
            "axis_rules.sequence": ["context", "context_usp_ulysses"],
        }
    ]


@pytest.mark.parametrize(
    ("overrides", "replication"),
    [
        (("ici_context_parallelism=4", "per_device_batch_size=0.25"), 1),
        (("ici_context_parallelism=2", "ici_tensor_parallelism=2", "per_device_batch_size=0.5"), 2),
        (("ici_tensor_parallelism=4", "per_device_batch_size=0.25"), 4),
    ],
)
def test_devices_holding_the_same_tokens_are_counted(overrides, replication):
    """A device's tokens are shared by the devices that split neither batch nor
    sequence: none at cp 4, the tensor pair at cp 2 x tensor 2, all four at tensor 4."""
    plan, _ = analyse(typed(*overrides))
    assert plan.per_device.replication == replication


def test_a_move_keeps_the_device_count_in_whole_devices():
    """fsdp=8 on 8 devices: context 4 with fsdp 2 leaves data at 1; context 2 and expert
    2 together leave fsdp a quarter of its devices; a move that would leave a fraction or
    less than one device on the receiving axis is refused."""
    cfg = typed()
    mesh, _ = build_mesh_view(cfg, None)
    assert dict(move(cfg, mesh, {"context": 4, "fsdp": 2}, to="data")) == {
        "ici_fsdp_parallelism": 2,
        "ici_context_parallelism": 4,
    }
    # context 2 and expert 2 free a quarter of fsdp: it keeps 2 devices.
    assert dict(move(cfg, mesh, {"context": 2, "expert": 2}, to="fsdp")) == {
        "ici_fsdp_parallelism": 2,
        "ici_expert_parallelism": 2,
        "ici_context_parallelism": 2,
    }
    # Exactly one device left on the receiving axis is a move; none or a fraction is not.
    assert dict(move(cfg, mesh, {"context": 8}, to="fsdp")) == {
        "ici_fsdp_parallelism": 1,
        "ici_context_parallelism": 8,
    }
    assert move(cfg, mesh, {"context": 16}, to="fsdp") is None
    assert move(cfg, mesh, {"context": 3}, to="fsdp") is None


def test_a_batch_that_does_not_divide_is_offered_one_sequence_a_shard():
    """4 sequences over 8 batch shards (per_device_batch_size=0.5, fsdp 8): the fix is
    the least batch that divides, one sequence a shard."""
    assert fixes_of("BATCH_NOT_DIVISIBLE", "per_device_batch_size=0.5") == [
        {"per_device_batch_size": 1.0}
    ]


@pytest.mark.parametrize(("mode", "seq_len", "sub_seq"), [("train", 256, 64), ("decode", 1, 1)])
def test_a_decode_step_holds_one_token_a_sequence(mode, seq_len, sub_seq):
    """Training splits each 256-token sequence over cp 4; a decode step (cp 1, the
    decode axis 4) has one new token a sequence, whatever max_target_length says."""
    axis = "context" if mode == "train" else "context_autoregressive"
    over = (f"mode={mode}", f"ici_{axis}_parallelism=4", "max_target_length=256")
    plan, _ = analyse(typed(*over, "per_device_batch_size=0.25"))
    assert (plan.per_device.seq_len, plan.per_device.sub_seq) == (seq_len, sub_seq)


def test_a_fractional_global_batch_is_offered_each_batch_once():
    """tiny at cp 4 (2 batch shards) with per_device_batch_size=0.3: 2.4 sequences. One
    sequence a shard and the nearest whole batch are both 0.25: offered once."""
    over = ("ici_context_parallelism=4", "max_target_length=8192", "per_device_batch_size=0.3")
    assert fixes_of("GLOBAL_BATCH_FRACTIONAL", *over) == [{"per_device_batch_size": 0.25}]
    # At cp 8 on one batch shard, the nearest whole batch (2 sequences on the one shard)
    # inflates the local batch: it comes with that error's fix, half the sequence
    # devices moved to fsdp so the 2 sequences take 2 batch shards.
    over = ("ici_context_parallelism=8", "max_target_length=8192", "per_device_batch_size=0.3")
    assert fixes_of("GLOBAL_BATCH_FRACTIONAL", *over) == [
        {"per_device_batch_size": 0.125},
        {"per_device_batch_size": 0.25, "ici_fsdp_parallelism": 2, "ici_context_parallelism": 4},
    ]


def test_an_inflated_local_batch_takes_its_devices_from_the_largest_sharing_axis_first():
    """context=2 x tensor=4 share one batch shard's 2 sequences: the same global batch,
    one sequence a shard, takes the 2 devices from tensor (the larger axis), not from
    context, whose split the sequence needs."""
    over = (
        "ici_context_parallelism=2",
        "ici_tensor_parallelism=4",
        "ici_fsdp_parallelism=1",
        "per_device_batch_size=0.25",
    )
    assert fixes_of("LOCAL_BATCH_INFLATION", *over) == [
        {"per_device_batch_size": 0.125},
        {"ici_fsdp_parallelism": 2, "ici_tensor_parallelism": 2},
        {"ici_data_parallelism": 2, "ici_tensor_parallelism": 2},
    ]


def test_a_weight_dim_over_two_axes_keeps_the_axes_that_divide_it():
    """base_emb_dim=36 over fsdp=2 x context=4 (8 shards) does not divide; fsdp alone
    does, so the embed rule keeps fsdp and rests the weights unsplit over context."""
    over = (
        "ici_fsdp_parallelism=2",
        "ici_context_parallelism=4",
        "base_emb_dim=36",
        "per_device_batch_size=0.25",
        "axis_rules.embed=[fsdp,context]",
    )
    assert fixes_of("EMBED_NOT_DIVISIBLE", *over) == [{"axis_rules.embed": ["fsdp"]}]


def test_gpus_of_two_hosts_in_one_slice_are_offered_the_hosts_as_slices():
    """16 H200s in one slice would price fsdp's collectives at NVLink's bandwidth over
    two hosts: the warning offers the hosts as 2 slices with fsdp across them, which
    prices the crossing at the network's and clears it; 8 GPUs (one host) say nothing."""
    over = ("hardware=h200", "num_devices=16")
    (spelled,) = fixes_of("GPU_HOSTS_IN_ONE_SLICE", *over)
    assert spelled == {
        "num_slices": 2,
        "dcn_data_parallelism": 1,
        "dcn_fsdp_parallelism": 2,
        "ici_fsdp_parallelism": 8,
    }
    one, found = analyse(typed(*over))
    fixed, after = analyse(typed(*over, *(f"{k}={v}" for k, v in spelled.items())))
    assert "GPU_HOSTS_IN_ONE_SLICE" not in {f.code for f in after}
    assert fixed.chosen_estimate.time_s > one.chosen_estimate.time_s  # the network is slower
    _, eight = analyse(typed("hardware=h200"))
    assert "GPU_HOSTS_IN_ONE_SLICE" not in {f.code for f in eight}


def test_context_devices_at_decode_are_offered_the_decode_axis_or_data():
    """cp=4 at decode cannot split one new token: its devices move to
    context_autoregressive (MaxText's decode axis; the cache stays split over them, the
    lighter fix) or to data (four times the sequences a shard holds)."""
    over = ("mode=decode", "ici_context_parallelism=4", "per_device_batch_size=1")
    assert fixes_of("DECODE_CONTEXT_PARALLEL", *over) == [
        {
            "ici_fsdp_parallelism": 2,
            "ici_context_parallelism": 1,
            "ici_context_autoregressive_parallelism": 4,
        },
        {"ici_data_parallelism": 4, "ici_fsdp_parallelism": 2, "ici_context_parallelism": 1},
    ]


def test_gpus_that_are_not_whole_hosts_or_span_them_only_by_context_are_said_so():
    """16 H100s whose only split is context=16: context spans the two hosts. 12 H100s
    in one slice are not whole hosts: the warning says why it offers no fix."""
    over = ("hardware=h100", "num_devices=16", "ici_fsdp_parallelism=1")
    over += ("ici_context_parallelism=16", "per_device_batch_size=0.0625")
    assert fixes_of("GPU_HOSTS_IN_ONE_SLICE", *over) == [
        {
            "num_slices": 2,
            "dcn_data_parallelism": 1,
            "dcn_context_parallelism": 2,
            "ici_context_parallelism": 8,
        }
    ]
    _, found = analyse(typed("hardware=h100", "num_devices=12"))
    (hosts,) = [f for f in found if f.code == "GPU_HOSTS_IN_ONE_SLICE"]
    assert not hosts.fixes and "12 GPUs a slice are not whole hosts of 8" in hosts.no_fix
