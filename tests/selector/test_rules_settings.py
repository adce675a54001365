"""The rules on plain values and on the decoder's settings: the setting each finding
names and the fixes it offers, as the overrides a user would type (each checked by the
fix search, so a fix that does not clear its finding is not offered)."""

from __future__ import annotations

import pytest
from helpers import typed

from selector.config import GmmBackend
from selector.plan import analyse


def found_of(code: str, *overrides: str):
    _, found = analyse(typed(*overrides))
    (finding,) = [f for f in found if f.code == code]
    return finding.setting, [dict(x.overrides) for x in finding.fixes]


@pytest.mark.parametrize(
    ("code", "overrides", "setting", "fixes"),
    [
        (
            "ATTENTION_TYPE_UNKNOWN",
            ("attention_type=foo",),
            "attention_type",
            [{"attention_type": "global"}, {"attention_type": "mla"}],
        ),
        (
            "VALUE_TYPE_INVALID",
            ("hardware.jax_version=abc",),
            "hardware.jax_version",
            [{"hardware.jax_version": "auto"}],
        ),
        (
            "SHARED_GATE_WITHOUT_EXPERTS",
            ("shared_expert_gate=true", "shared_experts=0"),
            "shared_expert_gate",
            [{"shared_expert_gate": False}, {"shared_experts": 1}],
        ),
        (
            "GMM_BACKEND_DENSE_WORK",
            ("gmm_backend=ragged_dot",),
            "gmm_backend",
            [{"gmm_backend": GmmBackend.tiled_gmm}],
        ),
        # A row tile rounded up to whole sublanes: 8 rows of float32, 16 of bfloat16.
        (
            "GMM_ROW_TILE_UNSUPPORTED",
            ("gmm_row_tile=20",),
            "gmm_row_tile",
            [{"gmm_row_tile": 0}, {"gmm_row_tile": 24}],
        ),
        (
            "GMM_ROW_TILE_UNSUPPORTED",
            ("gmm_row_tile=20", "dtype=bfloat16"),
            "gmm_row_tile",
            [{"gmm_row_tile": 0}, {"gmm_row_tile": 32}],
        ),
        ("DTYPE_UNKNOWN", ("dtype=foo",), "dtype", [{"dtype": "bfloat16"}, {"dtype": "float32"}]),
        (
            "PARAM_DTYPE_UNKNOWN",
            ("param_dtype=foo",),
            "param_dtype",
            [{"param_dtype": "bfloat16"}, {"param_dtype": "float32"}],
        ),
        (
            "CAPACITY_FACTOR_INVALID",
            ("capacity_factor=inf",),
            "capacity_factor",
            [{"capacity_factor": -1.0}, {"capacity_factor": 1.25}],
        ),
        (
            "TOPK_EXCEEDS_EXPERTS",
            ("num_experts=1", "num_experts_per_tok=2"),
            "num_experts_per_tok",
            [{"num_experts_per_tok": 1}],
        ),
        (
            "REMAT_POLICY_UNKNOWN",
            ("remat_policy=fastest",),
            "remat_policy",
            [{"remat_policy": "full"}, {"remat_policy": "minimal"}],
        ),
        # 2 key/value heads over tensor=4: tensor 2, its other devices to context, fsdp,
        # expert or data (the last three with the batch their new shards need).
        (
            "TENSOR_SPLITS_HEADS",
            ("ici_tensor_parallelism=4", "ici_fsdp_parallelism=2", "per_device_batch_size=0.25"),
            "ici_tensor_parallelism",
            [
                {"ici_context_parallelism": 2, "ici_tensor_parallelism": 2},
                {
                    "ici_fsdp_parallelism": 4,
                    "ici_tensor_parallelism": 2,
                    "per_device_batch_size": 0.5,
                },
                {
                    "ici_tensor_parallelism": 2,
                    "ici_expert_parallelism": 2,
                    "per_device_batch_size": 0.5,
                },
                {
                    "ici_data_parallelism": 2,
                    "ici_tensor_parallelism": 2,
                    "per_device_batch_size": 0.5,
                },
            ],
        ),
    ],
)
def test_a_settings_finding_names_its_setting_and_offers_its_fixes(code, overrides, setting, fixes):
    assert found_of(code, *overrides) == (setting, fixes)


def test_tensor_splits_heads_names_the_heads_it_cannot_split():
    """The tiny model's 4 query heads divide over tensor=4, its 2 key/value heads do not:
    the message names the key/value heads and their number."""
    _, found = analyse(
        typed("ici_tensor_parallelism=4", "ici_fsdp_parallelism=2", "per_device_batch_size=0.25")
    )
    (heads,) = [f for f in found if f.code == "TENSOR_SPLITS_HEADS"]
    assert "base_num_kv_heads=2" in heads.message


@pytest.mark.parametrize(
    "overrides",
    [
        # 6 experts do not split into 4 groups, though 4 groups of one would hold k=2.
        ("num_experts=6", "n_routing_groups=4", "topk_routing_group=4"),
        # One expert cannot split into 2 groups.
        ("num_experts=1", "num_experts_per_tok=1", "n_routing_groups=2", "topk_routing_group=1"),
        # 8 experts split into 4 groups, but 5 of the 4 groups allowed.
        ("num_experts=8", "n_routing_groups=4", "topk_routing_group=5"),
        # The one group allowed holds 2 experts, fewer than k=4.
        ("num_experts=8", "n_routing_groups=4", "topk_routing_group=1", "num_experts_per_tok=4"),
    ],
)
def test_routing_groups_that_do_not_split_the_experts_are_an_error(overrides):
    setting, fixes = found_of("ROUTING_GROUPS_INVALID", *overrides)
    assert setting == "n_routing_groups"
    assert fixes == [{"n_routing_groups": -1, "topk_routing_group": -1}]


def test_mla_sizes_are_checked_only_for_mla():
    """kv_lora_rank=0 cannot size MLA's latent; under global attention MLA's sizes are
    not read, and the same value says nothing. Under MLA the sizes every decoder has are
    checked as well."""
    setting, _ = found_of("DECODER_SIZE_INVALID", "attention_type=mla", "kv_lora_rank=0")
    assert setting == "kv_lora_rank"
    setting, _ = found_of("DECODER_SIZE_INVALID", "attention_type=mla", "vocab_size=0")
    assert setting == "vocab_size"
    _, found = analyse(typed("kv_lora_rank=0"))
    assert "DECODER_SIZE_INVALID" not in {f.code for f in found}


@pytest.mark.parametrize(
    "overrides",
    [
        # Every group allowed (topk_routing_group = n_routing_groups).
        ("num_experts=8", "n_routing_groups=4", "topk_routing_group=4", "num_experts_per_tok=2"),
        # The allowed groups hold exactly k experts (2 groups of 2 for k=4).
        ("num_experts=8", "n_routing_groups=4", "topk_routing_group=2", "num_experts_per_tok=4"),
    ],
)
def test_routing_groups_at_their_limits_are_accepted(overrides):
    _, found = analyse(typed(*overrides))
    assert "ROUTING_GROUPS_INVALID" not in {f.code for f in found}


def test_ulysses_shares_the_heads_left_after_the_tensor_split():
    """The tiny model's 2 key/value heads split over tensor=2 leave one a device, which
    context=2 cannot share out under Ulysses (without the tensor split 2 would divide)."""
    over = ("ici_context_parallelism=2", "ici_tensor_parallelism=2", "per_device_batch_size=0.25")
    _, found = analyse(typed(*over, "context_parallel_strategy=ulysses"))
    (heads,) = [f for f in found if f.code == "ULYSSES_SPLITS_HEADS"]
    assert "base_num_kv_heads=2 leaves 1 a device after tensor=2" in heads.message
    assert [dict(x.overrides) for x in heads.fixes] == [{"context_parallel_strategy": "all_gather"}]
    _, found = analyse(
        typed(*over[:1], "per_device_batch_size=0.5", "context_parallel_strategy=ulysses")
    )
    assert "ULYSSES_SPLITS_HEADS" not in {f.code for f in found}


def test_mla_query_heads_over_tensor_are_checked_and_named():
    """MLA's heads are all query heads: 6 over tensor=4 do not divide, and the fixes keep
    the tensor axis that divides them (2), not the heads' own count."""
    over = ("attention_type=mla", "base_num_query_heads=6", "ici_tensor_parallelism=4")
    _, found = analyse(typed(*over, "ici_fsdp_parallelism=2", "per_device_batch_size=0.25"))
    (heads,) = [f for f in found if f.code == "TENSOR_SPLITS_HEADS"]
    assert "base_num_query_heads=6 is not a multiple" in heads.message
    assert all(dict(x.overrides)["ici_tensor_parallelism"] == 2 for x in heads.fixes)
    assert heads.fixes


def test_a_capacity_factor_that_is_not_finite_is_one_finding():
    _, found = analyse(typed("capacity_factor=inf"))
    codes = [f.code for f in found if f.setting == "capacity_factor"]
    assert codes == ["CAPACITY_FACTOR_INVALID"]


def test_every_chip_number_that_is_not_finite_is_named():
    _, found = analyse(typed("hardware.memory_gib=inf", "hardware.matmul_tflops=nan"))
    named = [f.setting for f in found if f.code == "VALUE_NOT_FINITE"]
    assert named == ["hardware.memory_gib", "hardware.matmul_tflops"]


def test_the_recurrence_is_refused_load_balanced_from_two_context_devices():
    """Qwen3-Next's Gated DeltaNet under the load-balanced order: refused at cp=2 as at
    cp=4 (two devices already swap a chunk), fixed by the plain order."""
    over = ("model=qwen3_next_80b_a3b", "mesh=v5p_128", "max_target_length=8192")
    over += ("ici_context_parallelism=2", "per_device_batch_size=0.5")
    setting, fixes = found_of(
        "RECURRENCE_LOAD_BALANCED", *over, "context_parallel_load_balance=true"
    )
    assert setting == "context_parallel_load_balance"
    assert fixes == [{"context_parallel_load_balance": False}]
