"""The dispatch rules' decisions, called directly where a whole config would reach
them only at a boundary no preset sits on."""

from __future__ import annotations

import dataclasses
import re

import pytest
from helpers import DEEPSEEK_DECODE, typed

import selector
from selector.architecture import model_params
from selector.plan import analyse
from selector.rules import decode_gathers_weights
from selector.rules.strategy import _lighter_step

TRAIN = typed("mode=train", "remat_policy=full", "num_vocab_tiling=1")


@pytest.mark.parametrize(
    ("parts", "tiles"),
    [
        ({"logits": 5.0, "attention_peak": 2.0, "moe_block": 2.0}, True),
        # The logits beat the attention alone but not the attention and the MoE block.
        ({"logits": 3.0, "attention_peak": 2.0, "moe_block": 2.0}, False),
        ({"logits": 3.0, "attention_peak": 4.0, "moe_block": 0.0}, False),
    ],
)
def test_the_logits_are_tiled_only_when_they_outweigh_a_layer(parts, tiles):
    """A layer's peak is its attention and its MoE block; tiling the vocabulary is
    offered (4 and 16 tiles) only when the logits are larger than that."""
    offered = [dict(f.overrides).get("num_vocab_tiling") for f in _lighter_step(TRAIN, parts)]
    assert offered == ([4, 16] if tiles else [])


def test_decode_with_enough_tokens_a_step_is_not_told_its_gather_dominates():
    """DeepSeek-V3 decode on v5p-128, the experts gathered: 22.3 GB of weights a layer
    for 2 tokens' rows warns. The same plan whose tokens weigh just over a hundredth of
    the gathered weights stays quiet even with a faster exchange on offer; just under a
    hundredth, it warns."""
    cfg = typed(*DEEPSEEK_DECODE, "expert_exchange=gather")
    plan = selector.resolve(cfg)
    chosen = plan.chosen_estimate
    faster = dataclasses.replace(chosen, time_s=chosen.time_s / 10)

    def offer():
        return {"expert_exchange": "auto"}, faster

    gathered = chosen.traffic.weight_gather
    assert decode_gathers_weights(cfg, chosen, offer)  # a few tokens' bytes
    many = dataclasses.replace(chosen, input_bytes=gathered / 99)
    assert decode_gathers_weights(cfg, many, offer) == []
    some = dataclasses.replace(chosen, input_bytes=gathered / 101)
    assert decode_gathers_weights(cfg, some, offer)


def test_the_parameter_counts_as_the_report_writes_them():
    params = model_params(typed("model=mixtral_8x7b"))
    written = params.as_dict()
    assert (written["params_total"], written["params_active"]) == (params.total, params.active)
    assert written["routed_experts"] == params.routed_experts


def _gib(message: str, before: str) -> list[float]:
    """The numbers a message quotes in GiB after `before`."""
    tail = message.split(before, 1)[1]
    return [float(x) for x in re.findall(r"([0-9.e+-]+) (?:to ([0-9.e+-]+) )?GiB", tail)[0] if x]


def test_the_memory_messages_quote_the_estimate_in_gib():
    """MEMORY_EXCEEDED quotes the whole step's bytes a device, and MEMORY_WITHIN_MARGIN
    the estimate and the range the margin gives, in GiB (2**30 bytes), to 3 digits."""
    over = typed("hardware.memory_gib=0.01", "max_target_length=8192")
    plan, _ = analyse(over)
    (hit,) = [f for f in selector.validate(over) if f.code == "MEMORY_EXCEEDED"]
    assert _gib(hit.message, "needs about") == [
        float(f"{plan.chosen_estimate.device_bytes / 2**30:.3g}")
    ]
    near = typed("model=qwen3_30b_a3b", "mesh=v5p_128", "per_device_batch_size=1")
    near = near.replace(max_target_length=4096, num_devices=8)
    plan, _ = analyse(near)
    (hit,) = [f for f in selector.validate(near) if f.code == "MEMORY_WITHIN_MARGIN"]
    held = plan.chosen_estimate.device_bytes / 2**30
    assert _gib(hit.message, "estimated at") == [float(f"{held:.3g}")]
    low, high = _gib(hit.message, "a device holds")
    assert low < held < high < 2 * held


@pytest.mark.parametrize(
    "rounding, asked, least", [("ours", 1, 1.7), ("maxtext", 1, 1.85), ("ours", 1.65, 1.7)]
)
def test_the_drops_fix_is_the_least_factor_that_clears_them_under_the_rounding_asked(
    rounding, asked, least
):
    """tiny (8 experts, k 2), one 24-token subgroup at capacity_factor=1: uniform routing
    drops too much. The fix offered is the least factor (in steps of 0.05) whose
    capacity, rounded the way the config rounds it, clears the warning: MaxText 0.2.5's
    truncating rule needs more than ours. Asked for 1.65, one step below the least,
    the fix is that next step."""
    over = [f"capacity_factor={asked}", "max_target_length=24", "dispatch=subgroup_capacity"]
    over.append(f"capacity_rounding={rounding}")

    def drops(*extra):
        _, found = analyse(typed(*over, *extra))
        return [f for f in found if f.code == "DROPS_LIKELY"]

    (warned,) = drops()
    (offered,) = [dict(x.overrides) for x in warned.fixes if len(x.overrides) == 1]
    assert offered["capacity_factor"] == pytest.approx(least)
    assert drops(f"capacity_factor={least}") == []
    assert drops(f"capacity_factor={least - 0.05:.2f}") != []


def test_a_gather_asked_for_is_offered_the_exchange_with_fsdp_in_the_expert_group():
    """Qwen3-30B-A3B on 16 H100s (fsdp 4 x context 4), 8,192 tokens a device, the experts
    gathered as asked: the step is within the margin of the chip. Exchanging them over
    the expert group with fsdp folded in is offered (both keys: the group alone leaves
    the gather asked for), and with it the step leaves the margin."""
    over = ["model=qwen3_30b_a3b", "num_devices=16", "hardware=h100", "ici_fsdp_parallelism=4"]
    over += ["ici_context_parallelism=4", "per_device_batch_size=0.25"]
    over += ["max_target_length=32768", "param_dtype=bfloat16", "expert_exchange=gather"]
    _, found = analyse(selector.to_config(selector.compose(over)))
    (memory,) = [f for f in found if f.code == "MEMORY_WITHIN_MARGIN"]
    folded = "expert_exchange=all_to_all expert_group=expert_sequence_and_fsdp"
    assert folded in [x.render() for x in memory.fixes]
    plan, after = analyse(selector.to_config(selector.compose([*over, *folded.split()])))
    assert not [f for f in after if f.code.startswith("MEMORY")]
    assert plan.chosen_estimate.name == "megablox/all_to_all"


def test_a_gather_asked_for_is_offered_the_exchange_over_experts_and_sequence():
    """Mixtral-8x7B on 16 v5p chips (fsdp 2 x context 4 x expert 2), float32 weights,
    one sequence of 32k tokens a device, the experts gathered as asked: the step is
    within the margin of the chip. Exchanging them over the expert and context axes is
    offered with both keys (the group alone leaves the gather asked for, and the step in
    the margin), and with it the step leaves the margin."""
    over = ["model=mixtral_8x7b", "num_devices=16", "hardware=v5p"]
    over += ["ici_fsdp_parallelism=2", "ici_context_parallelism=4", "ici_expert_parallelism=2"]
    over += ["per_device_batch_size=1", "max_target_length=32768", "param_dtype=float32"]
    _, found = analyse(selector.to_config(selector.compose([*over, "expert_exchange=gather"])))
    (memory,) = [f for f in found if f.code == "MEMORY_WITHIN_MARGIN"]
    exchanged = "expert_exchange=all_to_all expert_group=expert_and_sequence"
    assert exchanged in [x.render() for x in memory.fixes]
    plan, after = analyse(
        selector.to_config(selector.compose([*over, "expert_exchange=gather", *exchanged.split()]))
    )
    assert not [f for f in after if f.code.startswith("MEMORY")]
    assert plan.chosen_estimate.name == "megablox/all_to_all"


def test_without_fsdp_on_the_mesh_the_exchange_is_offered_over_one_group():
    """fsdp=1: folding fsdp into the expert group adds no device, so the exchange is
    offered once (Qwen3-30B-A3B on 16 H100s, context 8 x expert 2, gathered as asked)."""
    over = ["model=qwen3_30b_a3b", "num_devices=16", "hardware=h100", "ici_fsdp_parallelism=1"]
    over += ["ici_context_parallelism=8", "ici_expert_parallelism=2", "per_device_batch_size=1"]
    over += ["max_target_length=8192", "param_dtype=bfloat16", "expert_exchange=gather"]
    _, found = analyse(selector.to_config(selector.compose(over)))
    (memory,) = [f for f in found if f.code == "MEMORY_WITHIN_MARGIN"]
    exchanges = [x.render() for x in memory.fixes if "expert_exchange" in x.render()]
    assert exchanges == ["expert_exchange=all_to_all expert_group=expert_and_sequence"]


def test_a_model_without_decoder_layers_is_refused():
    """base_num_decoder_layers=0 sizes nothing (no layer holds the attention the step's
    peak is counted at): refused, with the schema's default as the fix."""
    from selector.findings import errors_in

    _, found = analyse(typed("base_num_decoder_layers=0"))
    (refused,) = errors_in(found)
    assert (refused.code, refused.setting) == ("VALUE_NOT_POSITIVE", "base_num_decoder_layers")
    assert [x.render() for x in refused.fixes] == ["base_num_decoder_layers=1"]


def test_the_capacity_path_costly_is_offered_dropless_routing():
    """Qwen3-Next on v5p-128 at 16,384 tokens with capacity_factor=1.25: the capacity
    path runs as asked, with a warning whose one fix is dropless routing
    (capacity_factor=-1), which then picks a dropless dispatch."""
    over = ["model=qwen3_next_80b_a3b", "mesh=v5p_128", "max_target_length=16384"]
    _, found = analyse(selector.to_config(selector.compose([*over, "capacity_factor=1.25"])))
    (costly,) = [f for f in found if f.code == "CAPACITY_COSTLY"]
    assert [dict(x.overrides) for x in costly.fixes] == [{"capacity_factor": -1}]
    plan, found = analyse(selector.to_config(selector.compose([*over, "capacity_factor=-1"])))
    assert plan.strategy is not selector.Dispatch.subgroup_capacity
    assert "CAPACITY_COSTLY" not in {f.code for f in found}
    # Asked for by name, the capacity path is what the user chose: no warning.
    named = [*over, "capacity_factor=1.25", "dispatch=subgroup_capacity"]
    plan, found = analyse(selector.to_config(selector.compose(named)))
    assert plan.strategy is selector.Dispatch.subgroup_capacity
    assert "CAPACITY_COSTLY" not in {f.code for f in found}


def test_an_exchange_asked_of_the_dense_dispatch_is_offered_megablox_or_the_gather():
    """expert_exchange=all_to_all with dispatch=dense (tiny at cp 4) is an error; its
    fixes are the megablox dispatch, dropless, which does exchange, or the gather."""
    over = ["expert_exchange=all_to_all", "ici_context_parallelism=4", "max_target_length=8192"]
    over.append("per_device_batch_size=0.25")
    _, found = analyse(typed(*over, "dispatch=dense"))
    (needs,) = [f for f in found if f.code == "EXCHANGE_NEEDS_MEGABLOX"]
    assert [dict(x.overrides) for x in needs.fixes] == [
        {"dispatch": selector.Dispatch.megablox, "capacity_factor": -1},
        {"expert_exchange": selector.Exchange.gather},
    ]


@pytest.mark.parametrize("factor", ["0", "-1"])
def test_a_dropless_factor_of_zero_or_below_raises_no_capacity_warning(factor):
    """capacity_factor=0 and -1 both spell dropless routing (MaxText's convention):
    the dropless dispatch runs and no capacity finding is raised; 0.5 is a capacity
    that the dropless dispatch ignores, which is said."""
    _, found = analyse(typed("dispatch=megablox", f"capacity_factor={factor}"))
    assert not {"CAPACITY_IGNORED", "CAPACITY_REQUIRED"} & {f.code for f in found}
    _, found = analyse(typed("dispatch=megablox", "capacity_factor=0.5"))
    assert "CAPACITY_IGNORED" in {f.code for f in found}


def test_memory_exceeded_offers_as_many_slices_as_the_state_needs():
    """DeepSeek-V3 on one 8-H200 host at cp 2 and 64k tokens holds about 1,470 GiB a
    device, 1,411 of it at rest: 2x or 4x the hosts cannot help, and the error used to
    say only a bigger chip could. The least power of two whose split of the resting state
    gets under the chip is offered (32 hosts), and its preview is what the re-run says."""
    over = [
        "model=deepseek_v3",
        "mesh=h200_8",
        "ici_context_parallelism=2",
        "per_device_batch_size=0.5",
        "max_target_length=65536",
    ]
    _, found = analyse(selector.to_config(selector.compose(over)))
    (memory,) = [f for f in found if f.code == "MEMORY_EXCEEDED"]
    (chips,) = [x for x in memory.fixes if dict(x.overrides).get("num_slices")]
    assert dict(chips.overrides)["num_slices"] == 32
    assert dict(chips.overrides)["num_devices"] == 256
    plan, after = analyse(selector.to_config(selector.compose([*over, *chips.render().split()])))
    assert "MEMORY_EXCEEDED" not in {f.code for f in after}
    assert plan.chosen_estimate.device_bytes == pytest.approx(chips.held_bytes)
    # 16 hosts (the next power of two down) still leave the error.
    sixteen = chips.render().replace("256", "128").replace("32", "16")
    _, short = analyse(selector.to_config(selector.compose([*over, *sixteen.split()])))
    assert "MEMORY_EXCEEDED" in {f.code for f in short}


def test_a_fix_that_changes_nothing_is_neither_offered_nor_named():
    """DeepSeek-V3 on 64 v5p already in bfloat16, 2 sequences a device, is within the
    margin; the memory rule proposes param_dtype=bfloat16 among its fixes, which here
    is the config as it is: it is not run, and the finding's list of what was checked
    does not name it."""
    over = ["model=deepseek_v3", "hardware=v5p", "mesh=v5p_128", "per_device_batch_size=2"]
    over += ["param_dtype=bfloat16", "dtype=bfloat16"]
    _, found = analyse(selector.to_config(selector.compose(over)))
    (margin,) = [f for f in found if f.code == "MEMORY_WITHIN_MARGIN"]
    assert "param_dtype=bfloat16" in [x.render() for x in margin.tried]
    assert margin.no_fix.startswith(
        "No fix was found: param_dtype=float8_e4m3fn leaves it standing;"
    )
    assert "param_dtype=bfloat16" not in margin.message


@pytest.mark.parametrize(
    ("mesh", "groups"),
    [
        # fsdp 4 x expert 2 (8 devices) does not split 12 experts; the expert axis does.
        (("ici_fsdp_parallelism=4", "ici_expert_parallelism=2"), ["expert"]),
        # fsdp 2 x expert 2 x context 2: without fsdp (4 devices) or the expert axis alone.
        (
            (
                "ici_fsdp_parallelism=2",
                "ici_expert_parallelism=2",
                "ici_context_parallelism=2",
                "per_device_batch_size=0.5",
            ),
            ["expert_and_sequence", "expert"],
        ),
    ],
)
def test_a_folded_group_that_does_not_split_the_experts_is_offered_the_narrower_groups(
    mesh, groups
):
    """expert_group=expert_sequence_and_fsdp over a group whose devices do not divide
    num_experts=12: each narrower group that does is offered, then the gather."""
    over = ["num_experts=12", "expert_exchange=all_to_all", "dispatch=megablox"]
    _, found = analyse(typed(*mesh, *over, "expert_group=expert_sequence_and_fsdp"))
    (split,) = [f for f in found if f.code == "EXPERTS_NOT_DIVISIBLE_BY_GROUP"]
    assert [dict(x.overrides) for x in split.fixes] == [
        *({"expert_group": selector.ExpertGroup(g)} for g in groups),
        {"expert_exchange": selector.Exchange.gather},
    ]


def test_a_group_of_two_that_does_not_split_the_experts_is_not_called_empty():
    """expert=2 is a group (2 devices) that 5 experts do not split: the finding says so,
    not that the mesh gives no group."""
    over = ["ici_fsdp_parallelism=4", "ici_expert_parallelism=2", "num_experts=5"]
    over += ["num_experts_per_tok=2", "expert_exchange=all_to_all", "dispatch=megablox"]
    _, found = analyse(typed(*over))
    codes = {f.code for f in found}
    assert "EXPERTS_NOT_DIVISIBLE_BY_GROUP" in codes and "EXPERT_GROUP_EMPTY" not in codes
