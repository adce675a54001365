"""The counted memory model: what a block's program holds, counted by hand from the
layers, and held against the real layers XLA compiled for v5p and H200 (the stored
judge set of bench.calibration.memory_holdout; nothing here is fitted)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import problem, typed

import selector
from selector.memory_model import held_buffers, weight_copy_bytes
from selector.problem import buffer_rows
from selector.traits import PLATFORMS

HOLDOUT = Path(__file__).resolve().parents[2] / "bench" / "results" / "memory_holdout.json"
ROOT = HOLDOUT.parents[2]
RESULTS = HOLDOUT.parent
QWEN3_30B = (  # one layer of the preset on 64 v5p chips, cp=2, one 8,192-token sequence a shard
    "model=qwen3_30b_a3b",
    "hardware=v5p",
    "num_devices=64",
    "ici_fsdp_parallelism=32",
    "ici_context_parallelism=2",
    "per_device_batch_size=0.5",
    "max_target_length=8192",
    "dispatch=megablox",
    "dtype=bfloat16",
    "param_dtype=bfloat16",
    "hardware.memory_gib=1000000",
)


def held(*over, release=(0, 12)):
    cfg, plan, p = problem(*QWEN3_30B, *over)
    platform = cfg.hardware.platform
    return held_buffers(plan.strategy, plan.placement.exchange, p, platform, release), plan


def test_gathered_prefill_holds_the_weights_and_the_rows_of_the_first_two_matmuls():
    """4,096 tokens a device, k=8, emb 2048, hidden 768, 128 experts: every expert's
    three bf16 matrices gathered, the sorted rows and both hidden products, the float32
    router probabilities; no gradient."""
    h, plan = held("mode=prefill", "expert_exchange=gather")
    assert plan.per_device.tokens_per_device == 4096
    assert h.weights == 128 * 3 * 2048 * 768 * 2
    assert h.gradients == 0
    assert h.activations == 4096 * 8 * (2048 + 2 * 768) * 2 + 4096 * 128 * 4


def test_exchanged_training_holds_every_local_accumulator_in_float32():
    """The exchange over context=2: 64 local experts, their gathered bf16 copy, their
    float32 gradient accumulators and one matrix's bf16 cast on its way out; three round
    buffers of G x B rows on XLA:TPU (the cotangents' send and receive beside the rows
    received), one slot's hidden products, and the tokens' dx and dy. XLA:GPU holds one
    round buffer more (its ragged_all_to_all's output operand apart from the result)."""
    h, plan = held("mode=train", "expert_exchange=all_to_all")
    local = 64 * 3 * 2048 * 768
    assert h.weights == local * 2
    assert h.gradients == local * 4 + local * 2 / 3
    b = 9216  # 1.125 x 4,096 x 8 / 2, a multiple of 8
    tokens = 2 * 4096 * 2048 * 2
    router = 4096 * 128 * 4
    assert h.activations == (3 * 2 * b * 2048 + 2 * b * 768) * 2 + tokens + router
    g, _ = held("mode=train", "expert_exchange=all_to_all", "hardware=h200")
    assert g.activations - h.activations == 2 * b * 2048 * 2
    for over, rounds in (((), 2), (("hardware=h200",), 3)):  # serving: no dx, dy
        cfg, plan, p = problem(*QWEN3_30B, "mode=prefill", "expert_exchange=all_to_all", *over)
        f = held_buffers(plan.strategy, plan.placement.exchange, p, cfg.hardware.platform)
        b = buffer_rows(p)
        assert f.activations == (rounds * p.group * b * 2048 + 2 * b * 768) * 2 + p.T * 128 * 4


def test_xla_cpu_counts_the_weights_copy_in_float32_and_xla_tpu_fuses_a_cast():
    """XLA:CPU multiplies half-precision weights in float32: its copy is 4 bytes an
    element, and a copy exists even where nothing is gathered. XLA:TPU fuses the cast of
    weights it does not gather into the dots: no copy; gathered, the copy is bf16."""
    assert weight_copy_bytes("cpu", 2) == 4 and weight_copy_bytes("tpu", 2) == 2
    one = (
        "ici_fsdp_parallelism=1",
        "ici_context_parallelism=1",
        "ici_data_parallelism=64",
        "per_device_batch_size=1",
    )
    for platform, hardware, copy in (("tpu", "v5p", 0), ("cpu", "cpu", 4)):
        h, _ = held("mode=prefill", *one, f"hardware={hardware}", "param_dtype=float32")
        assert h.weights == 128 * 3 * 2048 * 768 * copy, platform
    h, _ = held("mode=prefill", "param_dtype=float32", "expert_exchange=gather")
    assert h.weights == 128 * 3 * 2048 * 768 * 2


def test_one_constant_per_compiler():
    """Every compiler has traits, and one temp factor whatever the jax release."""
    from selector.traits import TRAITS

    assert set(PLATFORMS) == {"cpu", "gpu", "tpu"}
    for platform in PLATFORMS:
        factors = {row.compiler_factor for (name, _), row in TRAITS.items() if name == platform}
        assert len(factors) == 1, platform


def stored_programs():
    from bench.calibration import memory_holdout

    payload = json.loads(HOLDOUT.read_text())
    for stack, compiled in sorted(payload["stacks"].items()):
        for program in memory_holdout.programs():
            got = compiled.get(memory_holdout.key(*program))
            if got and "temp_bytes" in got:
                yield stack, program, got["temp_bytes"]


@pytest.mark.parametrize(
    "stack, judged",
    [
        *((s, "first") for s in sorted(json.loads(HOLDOUT.read_text())["stacks"])),
        *((s, "fsdp folded") for s in sorted(json.loads(HOLDOUT.read_text())["stacks"])),
    ],
)
def test_count_holds_to_the_real_layers_compiled_for_v5p_and_h200(stack, judged):
    """Issue 29's bar on every stack stored: the count within 20% of XLA's temp for at
    least 90% of the real presets' layers (cp 1, 2, 4; gathered and exchanged; training
    and prefill; 64 v5p and 8 H200, compiled ahead of time by bench.calibration.memory_holdout).
    The fsdp-folded group's set (issue 48 line 3) is held to the same bar: 40 of 42 on
    jax 0.10.2 and 38 of 42 on jax 0.12.0.1, with libtpu's and XLA:GPU's heap laws."""
    from bench.calibration import memory_holdout

    rows = [
        (p, t)
        for s, p, t in stored_programs()
        if s == stack and memory_holdout.judged_set(p[3]) == judged
    ]
    assert len(rows) >= (60 if judged == "first" else 30), len(rows)  # both chips, presets
    ratios = {
        memory_holdout.key(*p): memory_holdout.estimate_temp(memory_holdout.overrides(*p), stack)
        / t
        for p, t in rows
    }
    off = {k: round(r, 3) for k, r in ratios.items() if abs(r - 1) > memory_holdout.WITHIN}
    assert len(off) <= (1 - memory_holdout.SHARE) * len(ratios), off


def test_xla_gpu_gathered_programs_follow_their_jax_release():
    """Read in XLA:GPU's buffer assignments (Qwen3-30B-A3B, cp=2, 8 H200). jax 0.10.2:
    the forward holds four 384 MiB weight buffers where three are gathered and the
    expert outputs (T k x M) beside the sorted rows; training's peak is the backward's,
    with the three gradients whole. jax 0.12.0.1: the forward holds the three gathered
    matrices and the rows as on TPU; the backward one gradient at a time."""
    gpu = ("hardware=h200", "num_devices=8", "ici_fsdp_parallelism=4")
    matrix = 128 * 2048 * 768 * 2
    rows = 4096 * 8 * (2048 + 2 * 768) * 2 + 4096 * 128 * 4
    old, new = (0, 10), (0, 12)
    h, _ = held("mode=prefill", "expert_exchange=gather", *gpu, release=old)
    assert (h.weights, h.activations) == (4 * matrix, rows + 4096 * 8 * 2048 * 2)
    h, _ = held("mode=train", "expert_exchange=gather", *gpu, release=old)
    assert (h.weights, h.gradients) == (3 * matrix, 3 * matrix)
    h, _ = held("mode=prefill", "expert_exchange=gather", *gpu, release=new)
    assert (h.weights, h.activations) == (3 * matrix, rows)
    h, _ = held("mode=train", "expert_exchange=gather", *gpu, release=new)
    assert (h.weights, h.gradients) == (3 * matrix, matrix)


def test_the_jax_release_is_read_without_importing_jax():
    from selector.traits import jax_release

    assert jax_release("0.10.2") == (0, 10) and jax_release("0.12.0.1") == (0, 12)
    with pytest.raises(ValueError, match="hardware.jax_version"):
        jax_release("latest")
    found = selector.validate(typed(*QWEN3_30B, "hardware.jax_version=latest"))
    assert [f.setting for f in found] == ["hardware.jax_version"], found


def _tiny_held(*over, platform="tpu", release=(0, 12)):
    _, plan, p = problem("ici_data_parallelism=1", *over)
    return held_buffers(plan.strategy, plan.placement.exchange, p, platform, release), p


def test_one_expert_holds_one_experts_weights():
    """num_experts=1 runs a plain SwiGLU: its three (emb 64, hidden 128) matrices, the
    float32 copy gathered over fsdp=8."""
    h, p = _tiny_held("num_experts=1", "num_experts_per_tok=1", "ici_fsdp_parallelism=8")
    assert p.gathered == 8 and p.xb == 4
    assert h.weights == 3 * 64 * 128 * 4


@pytest.mark.parametrize("shared", [1, 2])
def test_shared_experts_weights_are_held_beside_the_routed(shared):
    """Gathered over fsdp=8: the shared SwiGLU's three (64, shared x 128) matrices join
    the routed experts' copy (and their gradients, training, where the compiler holds
    the gathered gradients: jax 0.10's XLA:GPU)."""
    over = ("ici_fsdp_parallelism=8", "expert_exchange=gather")
    h0, _ = _tiny_held(*over, platform="gpu", release=(0, 10))
    h, p = _tiny_held(*over, f"shared_experts={shared}", platform="gpu", release=(0, 10))
    assert p.Hs == shared * 128
    assert h.weights - h0.weights == 3 * 64 * shared * 128 * 4
    assert h.gradients - h0.gradients == 3 * 64 * shared * 128 * 4


def test_exchanged_training_holds_shared_gradients_only_where_they_are_gathered():
    """The exchange keeps every local expert's float32 accumulator and one matrix's
    cast; the shared experts' gradients (two of three matrices held) only where their
    weights were gathered (fsdp=2 here; on context=8 alone nothing is gathered)."""
    for mesh, gathered in (
        (("ici_fsdp_parallelism=1", "ici_context_parallelism=8"), 1),
        (("ici_fsdp_parallelism=2", "ici_context_parallelism=4"), 2),
    ):
        h, p = _tiny_held(
            *mesh,
            "expert_exchange=all_to_all",
            "shared_experts=1",
            "allow_local_batch_inflation=true",
        )
        assert p.gathered == gathered and p.E_c == 8 // (8 // gathered)
        routed = p.E_c * 3 * 64 * 128
        shared = 3 * 64 * 128 * 4 * 2 / 3 if gathered > 1 else 0.0
        assert h.gradients == routed * 4 + routed * 4 / 3 + shared


@pytest.mark.parametrize(
    "dtype, family", [("float32", "cpu"), ("bfloat16", "cpu_half"), ("float16", "cpu_half")]
)
def test_xla_cpu_at_half_precision_is_its_own_program_family(dtype, family):
    from selector.config import Dispatch, Exchange
    from selector.memory_model import program_key

    cfg = typed(f"dtype={dtype}")
    assert program_key(Dispatch.megablox, Exchange.gather, cfg) == f"{family} train megablox"
    tpu = typed("hardware=v5p", "num_devices=8", f"dtype={dtype}")
    assert program_key(Dispatch.dense, Exchange.gather, tpu) == "tpu train dense"


def test_dense_and_capacity_activations_counted_by_hand():
    """tiny (emb 64, hidden 128, 8 experts, k 2, float32) on fsdp=8, 512 tokens a
    device: dense holds every expert's (tokens, 2 hidden + emb) products; the capacity
    path its (subgroups, experts, capacity) buffers of 2 emb + 2 hidden; both the float32
    router probabilities (tokens, experts)."""
    from selector.block_arrays import block_arrays, held_bytes
    from selector.config import Dispatch, Exchange
    from selector.traits import traits

    over = ("ici_fsdp_parallelism=8", "max_target_length=512", "per_device_batch_size=1")
    _, p = _tiny_held(*over)
    assert (p.T, p.E, p.E_c, p.xb) == (512, 8, 8, 4)
    router = 512 * 8 * 4
    dense = held_bytes(
        block_arrays(Dispatch.dense, Exchange.gather, p, traits(p.hardware.platform))
    )
    assert dense == 512 * 8 * (2 * 128 + 64) * 4 + router
    _, q = _tiny_held(*over, "dispatch=subgroup_capacity", "capacity_factor=1.0")
    assert (q.G, q.C) == (1, 128)  # one 512-token subgroup, capacity 512 x 2 / 8
    capacity = held_bytes(
        block_arrays(Dispatch.subgroup_capacity, Exchange.gather, q, traits(q.hardware.platform))
    )
    assert capacity == 1 * 8 * 128 * (2 * 64 + 2 * 128) * 4 + router


def test_shared_experts_follow_their_own_split_not_the_routed_experts():
    """The shared experts' copy and gradients are held where they are gathered (over
    `gate_shards`), whatever the routed experts do. fsdp in the expert group: no routed
    weight is gathered, the shared ones still are (fsdp=2), so their copy and two of
    their three gradients are held. Experts gathered over the expert axis alone: the
    routed ones are, the shared ones rest whole and are read in place."""
    shared = 3 * 64 * 128 * 4
    h, p = _tiny_held(
        "ici_fsdp_parallelism=2",
        "ici_context_parallelism=4",
        "expert_exchange=all_to_all",
        "expert_group=expert_sequence_and_fsdp",
        "shared_experts=1",
        "allow_local_batch_inflation=true",
    )
    assert (p.gathered, p.gate_shards, p.E_c) == (1, 2, 1)
    routed = 3 * 64 * 128
    assert h.weights == shared
    assert h.gradients == routed * 4 + routed * 4 / 3 + shared * 2 / 3
    for experts in (0, 1):
        h, p = _tiny_held(
            "ici_expert_parallelism=8",
            "expert_exchange=gather",
            f"shared_experts={experts}",
            "allow_local_batch_inflation=true",
            platform="gpu",  # jax 0.10's XLA:GPU holds the gathered gradients
            release=(0, 10),
        )
        assert (p.gathered, p.gate_shards) == (8, 1)
        routed = 8 * 3 * 64 * 128 * 4
        assert (h.weights, h.gradients) == (routed, routed)


def test_one_plain_mlp_holds_its_hidden_products_and_the_shared_experts():
    """One expert runs a plain SwiGLU: its weights, its two (tokens, hidden) products
    and the shared expert's two beside them; no router."""
    from selector.block_arrays import block_arrays, held_bytes
    from selector.config import Dispatch, Exchange
    from selector.traits import traits

    h, p = _tiny_held(
        "ici_fsdp_parallelism=8",
        "max_target_length=512",
        "per_device_batch_size=1",
        "num_experts=1",
        "num_experts_per_tok=1",
        "shared_experts=1",
    )
    assert (p.T, p.H, p.Hs, p.xb) == (512, 128, 128, 4)
    assert (
        held_bytes(block_arrays(Dispatch.mlp, Exchange.gather, p, traits(p.hardware.platform)))
        == 512 * 2 * (128 + 128) * 4
    )
    assert h.weights == 2 * 3 * 64 * 128 * 4  # the expert and the shared one, gathered


def test_routed_dispatch_holds_the_shared_products_beside_the_router():
    """A routed dispatch with a shared expert: the shared (tokens, 2 hidden) products and
    the float32 router probabilities, both beside the rows."""
    from selector.block_arrays import block_arrays, held_bytes
    from selector.config import Dispatch, Exchange
    from selector.traits import traits

    over = ("ici_fsdp_parallelism=8", "max_target_length=512", "per_device_batch_size=1")
    _, p0 = _tiny_held(*over)
    _, p1 = _tiny_held(*over, "shared_experts=1")
    for strategy in (Dispatch.dense, Dispatch.megablox):
        without = held_bytes(
            block_arrays(strategy, Exchange.gather, p0, traits(p0.hardware.platform))
        )
        with_shared = held_bytes(
            block_arrays(strategy, Exchange.gather, p1, traits(p1.hardware.platform))
        )
        assert with_shared - without == 512 * 2 * 128 * 4
    assert (
        held_bytes(block_arrays(Dispatch.dense, Exchange.gather, p0, traits(p0.hardware.platform)))
        > 512 * 8 * 4
    )  # the router


@pytest.mark.parametrize(
    "platform, dtype, param_dtype, copy",
    [
        ("cpu", "bfloat16", "bfloat16", True),  # XLA:CPU multiplies in float32
        ("gpu", "bfloat16", "float32", True),  # a cast XLA:GPU keeps apart
        ("gpu", "bfloat16", "bfloat16", False),  # read in place
        ("tpu", "bfloat16", "float32", False),  # XLA:TPU fuses the cast into the dots
    ],
)
def test_weights_not_gathered_are_copied_only_where_the_compiler_keeps_a_cast(
    platform, dtype, param_dtype, copy
):
    """Nothing gathered (the experts split over expert=8, exchanged): the routed and the
    shared weights are held once more only where the platform's compiler keeps a cast,
    in its compute element size (4 bytes on XLA:CPU)."""
    from selector.config import Dispatch, Exchange
    from selector.memory_model import has_weight_copy

    h, p = _tiny_held(
        "ici_expert_parallelism=8",
        "expert_exchange=all_to_all",
        "shared_experts=1",
        f"dtype={dtype}",
        f"param_dtype={param_dtype}",
        "mode=prefill",
    )
    assert (p.gathered, p.gate_shards, p.E_c) == (1, 1, 1)
    assert has_weight_copy(p, platform) is copy
    got = held_buffers(Dispatch.megablox, Exchange.all_to_all, p, platform)
    size = weight_copy_bytes(platform, p.xb)
    assert got.weights == (2 * 3 * 64 * 128 * size if copy else 0)


@pytest.mark.parametrize(
    "axis, gate_shards, matrices",
    [
        ("ici_fsdp_parallelism", 2, 8 + 1),  # the routed experts' and the shared one's
        ("ici_expert_parallelism", 1, 8),  # the shared expert rests whole: an output
    ],
)
def test_gathered_training_holds_the_gradients_from_two_devices_up(axis, gate_shards, matrices):
    """The smallest gathers, where the compiler holds the gathered gradients (jax 0.10's
    XLA:GPU): over fsdp=2 the three weight gradients (and the shared expert's) are held
    full size before their reduce-scatter; over expert=2 alone the routed experts' are,
    while the shared expert rests whole and its gradient is an output. XLA:TPU, which
    gathers over 2 of 8 devices by an all-gather, holds none of them."""
    over = (f"{axis}=2", "ici_data_parallelism=4", "expert_exchange=gather", "shared_experts=1")
    h, p = _tiny_held(*over, platform="gpu", release=(0, 10))
    assert (p.gathered, p.gate_shards, p.train) == (2, gate_shards, True)
    assert h.gradients == matrices * 3 * 64 * 128 * 4
    assert _tiny_held(*over)[0].gradients == 0


def test_temp_is_the_count_times_the_compilers_constant():
    from selector.config import Dispatch, Exchange
    from selector.memory_model import program_key, temp_bytes

    cfg, plan, p = problem("ici_data_parallelism=1", "ici_fsdp_parallelism=8")
    h = held_buffers(plan.strategy, plan.placement.exchange, p, "cpu")
    assert temp_bytes(h, cfg.hardware.platform) == pytest.approx(h.total * 1.45)
    tpu = typed("hardware=v5p", "num_devices=8")
    assert program_key(Dispatch.mlp, Exchange.gather, tpu) == "tpu train dense"


@pytest.mark.parametrize(
    "platform, train, per_element",
    [("tpu", True, 0), ("gpu", True, 2 * 2), ("gpu", False, 2), ("cpu", True, 3 * 4 + 2)],
)
def test_capacity_masks_are_held_as_the_compiler_holds_them(platform, train, per_element):
    """The capacity path's (tokens, E, C) dispatch masks, counted by hand from the traits
    (XLA:TPU fuses them; XLA:GPU two bfloat16 copies training, one forward; XLA:CPU three
    float32 and one bfloat16 copy training), added after the compiler's constant."""
    from selector.config import Dispatch, Exchange
    from selector.memory_model import temp_bytes

    mode = "train" if train else "prefill"
    over = ("dispatch=subgroup_capacity", "capacity_factor=1.0", "dtype=bfloat16")
    cfg, plan, p = problem(*over, f"mode={mode}")
    got = held_buffers(Dispatch.subgroup_capacity, Exchange.gather, p, platform)
    assert got.masks == p.T * p.E * p.C * per_element
    plain = held_buffers(Dispatch.megablox, Exchange.gather, p, platform)
    assert plain.masks == 0
    assert temp_bytes(got, cfg.hardware.platform) == pytest.approx(
        (got.total - got.masks) * 1.45 + got.masks
    )


def test_capacity_block_counted_within_20_percent_of_xla_gpu():
    """The capacity block compiled for 4 abstract H200s (context 4, 32,768 tokens, E 16,
    k 2: 8,192 tokens and C 1,280 a shard, bfloat16): XLA:GPU holds two bfloat16 copies
    of its one-hot masks (320 MiB each) at the peak; counted without them the estimate
    was 52 MiB of 725 (-93%). A shape the masks' law was not read from."""
    pytest.importorskip("jax_plugins.xla_cuda12", reason="the gpu extra (JAX's CUDA plugin)")
    from bench.points import Point, measure

    point = Point(
        "subgroup_capacity",
        {"data": 1, "context": 4},
        seq=32768,
        emb=256,
        hidden=256,
        experts=16,
        top_k=2,
        hardware="h200",
        dtype="bfloat16",
    )
    m = measure(point)
    assert m["predicted_temp"] == pytest.approx(m["temp"], rel=0.20)


EXCHANGE_ROWS = {  # stored study -> (chip's platform, jax release)
    "exchange_rows_v5p": ("tpu", (0, 10)),
    "exchange_rows_h200": ("gpu", (0, 10)),
    "exchange_rows_v5p_jax012": ("tpu", (0, 12)),
    "exchange_rows_h200_jax012": ("gpu", (0, 12)),
}


@pytest.mark.parametrize("study", sorted(EXCHANGE_ROWS))
def test_the_exchange_holds_the_round_buffers_its_compiler_holds(study):
    """`Traits.exchange_row_buffers` (forward, training): the most (G, B, M) round
    buffers any exchanged layer of `bench.calibration.exchange_rows` (real presets on 4
    to 128 chips, in no judge set) held at its heap's peak, read in its live ranges; a
    peak inside a slot's kernels holds fewer. jax 0.12's XLA:GPU live ranges list one
    more, a copy its memory analysis does not hold: there, and on every XLA:GPU serving
    point, the temp is the round buffers alone, `trait` of them."""
    from selector.traits import jax_release, traits

    payload = json.loads((RESULTS / f"{study}.json").read_text())
    platform, release = EXCHANGE_ROWS[study]
    assert jax_release(payload["stack"].removeprefix("jax ")) == release
    held = traits(platform, release).exchange_row_buffers
    rows = [r for r in payload["rows"] if r.get("status") == "ok"]
    assert {r["mode"] for r in rows} == {"prefill", "train"}
    read = tuple(
        max(r["round_buffers"] for r in rows if r["mode"] == mode) for mode in ("prefill", "train")
    )
    if platform == "gpu":
        for r in rows:
            if r["mode"] == "prefill":
                assert round(r["temp_mib"] / r["round_mib"]) == held[0], r
        if release >= (0, 12):
            read = (read[0] - 1, read[1] - 1)
    assert held == read


# study -> (chip, platform, jax release)
EXCHANGE_HEAP = {
    "exchange_heap": ("v5p", "tpu", (0, 10)),
    "exchange_heap_jax012": ("v5p", "tpu", (0, 12)),
    "exchange_heap_h200": ("h200", "gpu", (0, 10)),
    "exchange_heap_h200_jax012": ("h200", "gpu", (0, 12)),
}


def study_rows(study: str, release: tuple[int, int]) -> dict[str, dict]:
    """The stored rows of one study that compiled, by point, after checking the study ran
    on jax `release`."""
    payload = json.loads((RESULTS / f"{study}.json").read_text())
    assert selector.traits.jax_release(payload["stack"].removeprefix("jax ")) == release
    return {r["point"]: r for r in payload["rows"] if r["status"] == "ok"}


def heap_study_rows(study: str) -> dict[str, dict]:
    """`study_rows` of one `exchange_heap` study, on the release `EXCHANGE_HEAP` names."""
    return study_rows(study, EXCHANGE_HEAP[study][2])


@pytest.mark.parametrize("study", sorted(EXCHANGE_HEAP))
def test_the_exchanged_training_heap_is_its_studys_median(study):
    """`Traits.exchange_heap` on XLA:TPU and XLA:GPU: for each side of the point where a
    round's rows outweigh one local expert matrix, the median of XLA's temp over the
    count without it, on the small exchanged training blocks with fsdp folded in of
    `bench.calibration.exchange_heap` (in no judge set) that hold more than one local
    expert. With it every such block is counted within 22% of the temp (the worst:
    libtpu 0.0.50, E 64); without it the count misses by up to 52% (libtpu 0.0.50) and
    45% (XLA:GPU, jax 0.10). The blocks with one local expert keep the count alone:
    within 25% (the worst, XLA:GPU: k 2, M 4,096, H 12,288, -24%)."""
    from statistics import median

    from bench.calibration import exchange_heap
    from selector.memory_model import temp_bytes
    from selector.traits import traits

    chip, platform, release = EXCHANGE_HEAP[study]
    rows = heap_study_rows(study)
    ratios, errors, alone = {False: [], True: []}, [], []
    for point in exchange_heap.CHIPS[chip]:
        if point[:2] != ("folded", "train"):
            continue
        cfg, plan, p = problem(*exchange_heap.overrides(point))
        h = held_buffers(plan.strategy, plan.placement.exchange, p, platform, release)
        row = rows[exchange_heap.label(point)]
        temp = row["temp_mib"] * 2**20
        error = temp_bytes(h, cfg.hardware.platform) / temp - 1
        if point[3]["E"] == point[3]["devices"]:  # one local expert: no law
            assert h.heap == 1.0
            alone.append(error)
            continue
        above = 3 * row["round_mib"] > row["weights_mib"]  # the side the study recorded
        ratios[above].append(temp / (h.total * traits(platform).compiler_factor))
        errors.append(error)
    assert min(map(len, ratios.values())) >= 9  # both sides measured
    law = traits(platform, release).exchange_heap
    assert law == tuple(round(median(ratios[side]), 2) for side in (False, True))
    assert max(map(abs, errors)) <= 0.22, errors
    assert max(map(abs, alone), default=0) <= 0.25, alone


@pytest.mark.parametrize("study", ["exchange_heap", "exchange_heap_jax012"])
def test_the_exchanged_serving_heap_is_its_studys_median(study):
    """`Traits.exchange_serving_heap` on XLA:TPU: outside and inside the window of
    `Traits.exchange_serving_window`, the median of XLA's temp over the count without
    it, on the small exchanged serving forwards with fsdp folded in of
    `bench.calibration.exchange_heap`. libtpu 0.0.42 holds what is counted (factor 1,
    every point within 15%); on libtpu 0.0.50 every point is counted within 20% with
    the law, where the count alone misses inside the window by more than half."""
    from statistics import median

    from bench.calibration import exchange_heap
    from selector.memory_model import temp_bytes
    from selector.traits import traits

    _, _, release = EXCHANGE_HEAP[study]
    rows = heap_study_rows(study)
    compiler = traits("tpu", release)
    low, high, tokens_below = compiler.exchange_serving_window
    ratios, errors = {False: [], True: []}, []
    for point in exchange_heap.POINTS:
        if point[:2] != ("folded", "prefill"):
            continue
        cfg, plan, p = problem(*exchange_heap.overrides(point))
        h = held_buffers(plan.strategy, plan.placement.exchange, p, "tpu", release)
        row, shape = rows[exchange_heap.label(point)], point[3]
        round_bytes = row["round_mib"] * 2**20  # the side the study recorded
        inside = low <= round_bytes < high and shape["tokens"] * shape["M"] * 2 < tokens_below
        inside = inside and shape.get("shared") != 1
        temp = row["temp_mib"] * 2**20
        ratios[inside].append(temp / h.total)
        errors.append(temp_bytes(h, cfg.hardware.platform) / temp - 1)
    assert len(errors) >= 30
    if compiler.exchange_serving_window == (0, 0, 0):
        assert compiler.exchange_serving_heap == (1.0, 1.0)
        assert max(map(abs, errors)) <= 0.15, errors
        return
    assert min(map(len, ratios.values())) >= 10  # both sides measured
    medians = tuple(round(median(ratios[side]), 2) for side in (False, True))
    assert compiler.exchange_serving_heap == medians
    assert max(map(abs, errors)) <= 0.20, errors


# study -> jax release of the stack it ran on (bench.calibration.gathered_gradients)
GATHERED_GRADIENTS = {"gathered_gradients": (0, 10), "gathered_gradients_jax012": (0, 12)}


@pytest.mark.parametrize("study", sorted(GATHERED_GRADIENTS))
def test_xla_tpu_holds_the_gathered_gradients_only_where_it_gathers_by_all_reduce(study):
    """`Traits.all_gather_gradients_held` and `gathered_gradients_held` on XLA:TPU, read
    from the small gathered training blocks of `bench.calibration.gathered_gradients`
    (in no judge set). What a block holds beyond its count without gradients, in units
    of its three gathered matrices, is, as a median rounded to thirds: none where the
    gather is an all-gather (under 64 chips, or a data axis beside fsdp); four thirds
    where it is an all-reduce (fsdp over a whole slice of 64 or more): the three
    gradients, and the all-reduce's own buffer of one matrix, which the whole step
    counts (`all_reduce_copy`) and the block's count leaves out. With the traits every
    block is counted within 15% but the two of 8,192 tokens a device, within 35% (the
    activations are under-counted there: gathered by all-gather -22% on libtpu 0.0.42 and
    -32% on 0.0.50, by all-reduce +19% and +3%, where the gradients and the activations
    do not peak together); counting the three everywhere (the old cover) misses the
    all-gathered blocks by more than half, and counting none the all-reduced ones by
    more than 40%."""
    import dataclasses
    from statistics import median

    from bench.calibration import gathered_gradients
    from selector.memory_model import gathers_by_all_reduce, temp_bytes
    from selector.traits import traits

    release = GATHERED_GRADIENTS[study]
    rows = study_rows(study, release)
    compiler = traits("tpu", release)
    shares, errors, worst = {False: [], True: []}, {}, {False: 0.0, True: 0.0}
    for name, shape in gathered_gradients.POINTS:
        row = rows[name]
        _, plan, p = problem(*gathered_gradients.overrides(shape))
        all_reduce = gathers_by_all_reduce(compiler, plan.mesh, p.gathered)
        assert all_reduce is row["all_reduce"], name
        h = held_buffers(plan.strategy, plan.placement.exchange, p, "tpu", release)
        temp, weights = row["temp_mib"] * 2**20, row["weights_mib"] * 2**20
        without = temp_bytes(dataclasses.replace(h, gradients=0.0), "tpu")
        shares[all_reduce].append((temp - without) / weights)
        errors[name] = temp_bytes(h, "tpu") / temp - 1
        # the other side's trait: the three where the study saw none, none where three
        other = 0.0 if all_reduce else weights
        miss = temp_bytes(dataclasses.replace(h, gradients=other), "tpu") / temp - 1
        worst[all_reduce] = max(worst[all_reduce], abs(miss))
    assert min(map(len, shares.values())) >= 5  # both ways measured
    read = {side: round(3 * median(shares[side])) / 3 for side in (False, True)}
    assert compiler.all_gather_gradients_held == read[False] == 0
    assert compiler.gathered_gradients_held + 1 / 3 == pytest.approx(read[True])
    long_ones = {name for name in errors if name.endswith("tokens8192")}
    assert max(abs(e) for name, e in errors.items() if name not in long_ones) <= 0.15, errors
    assert max(abs(errors[name]) for name in long_ones) <= 0.35, errors
    assert worst[False] > 0.5 and worst[True] > 0.4, worst


def test_the_gathered_gradients_tables_on_the_holdout_page_are_the_stored_rows():
    from bench import common
    from bench.calibration import gathered_gradients

    page = (ROOT / "docs" / "results" / "memory-holdout.md").read_text()
    for study in GATHERED_GRADIENTS:
        rows = [r for r in common.load(study)["rows"] if r.get("status") == "ok"]
        assert len(rows) == len(gathered_gradients.POINTS), study
        assert common.table(rows, gathered_gradients.COLUMNS) in page, study


def test_xla_tpu_keeps_the_gathered_gradients_across_slices_where_nothing_was_measured():
    """The gathered gradients' law was read on one slice: weights gathered over fsdp 8
    within a slice are all-gathered and none of their gradients is counted; the same
    gather with fsdp spread over two slices keeps the three, as before the law."""
    over = ("ici_fsdp_parallelism=8", "expert_exchange=gather", "hardware=v5p")
    one, p = _tiny_held(*over)
    assert p.gathered == 8 and one.gradients == 0
    two, p = _tiny_held(*over, "num_devices=16", "num_slices=2", "dcn_fsdp_parallelism=2")
    assert p.gathered == 16 and two.gradients == 8 * 3 * 64 * 128 * 4


def test_a_tensor_is_gathered_by_all_reduce_only_over_a_whole_slice_of_64_on_xla_tpu():
    """`gathers_by_all_reduce`: XLA:TPU, one slice, every one of its 64 chips: yes; 32
    of them (a data axis beside), or 64 spread over two slices: no; XLA:GPU never; a
    problem with no mesh: no."""
    from selector.memory_model import gathers_by_all_reduce
    from selector.traits import traits

    tpu, gpu = traits("tpu"), traits("gpu")
    common = ("hardware=v5p", "num_devices=64", "per_device_batch_size=1")
    _, whole, _ = problem(*common, "ici_fsdp_parallelism=64")
    _, half, _ = problem(*common, "ici_fsdp_parallelism=32", "ici_data_parallelism=2")
    _, two, _ = problem(
        *common, "num_slices=2", "ici_fsdp_parallelism=32", "dcn_fsdp_parallelism=2"
    )
    assert gathers_by_all_reduce(tpu, whole.mesh, 64)
    assert not gathers_by_all_reduce(tpu, whole.mesh, 32)
    assert not gathers_by_all_reduce(tpu, half.mesh, 32)
    assert not gathers_by_all_reduce(tpu, two.mesh, 64)
    assert not gathers_by_all_reduce(gpu, whole.mesh, 64)
    assert not gathers_by_all_reduce(tpu, None, 64)
