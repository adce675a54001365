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
