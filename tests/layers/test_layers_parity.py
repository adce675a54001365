"""Every dispatch against the plain reference MoE, forward and gradients, on many meshes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from layer_helpers import (
    assert_close,
    build,
    host_weights,
    inputs,
    loss_and_grads,
    reference_grads,
)
from reference import reference_choices, reference_keep, reference_moe

from layers.programs import block_forward

BATCH, SEQ = 8, 32
STRATEGIES = ["dense", "megablox", "subgroup_capacity"]
MESHES = {
    "data8": {"data": 8, "context": 1},
    "data4_cp2": {"data": 4, "context": 2},
    "data2_cp4": {"data": 2, "context": 4},
    "cp8": {"data": 1, "context": 8},
    "ulysses4": {"data": 2, "context_usp_ulysses": 4},
    "autoregressive4": {"data": 2, "context_autoregressive": 4},
    "mixed_cp": {"data": 2, "context": 2, "context_usp_ulysses": 2},
    "fsdp2_cp4": {"fsdp": 2, "context": 4},
    "tensor2": {"data": 2, "context": 2, "tensor": 2},
    "tensor2_cp4": {"context": 4, "tensor": 2},
    "fsdp2_tensor2_cp2": {"fsdp": 2, "tensor": 2, "context": 2},
    "expert2": {"data": 2, "expert": 2, "context": 2},
}
# Every mesh but data8 rests the weights sharded (over fsdp, the context axes, tensor or
# expert): the block gathers them inside and the gradients come back reduce-scattered.
REPLICATED_AT_REST = {"data8"}


@pytest.mark.parametrize("mesh_name", list(MESHES))
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_matches_reference_forward_and_gradients(jax_cpu8, strategy, mesh_name):
    model = build(strategy, MESHES[mesh_name], BATCH, SEQ)
    assert model.plan.strategy.value == strategy
    replicated = model.wi_0[...].sharding.is_fully_replicated
    assert replicated == (mesh_name in REPLICATED_AT_REST)
    x, cot = inputs(BATCH, SEQ)
    y, stats, gw, gx = loss_and_grads(model, x, cot)
    ry, rgw, rgx = reference_grads(model, x, cot, model.layout.size(model.layout.sequence))
    assert float(stats["dropped_fraction"]) == 0.0
    assert_close(y, ry, what="output")
    assert_close(gx, rgx, what="d/dx")
    for name in ("gate_ME", "wi_0_EMH", "wi_1_EMH", "wo_EHM"):
        assert_close(getattr(gw, name), getattr(rgw, name), what=f"d/d{name}")


@pytest.mark.parametrize("mesh_name", ["data8", "data2_cp4", "cp8"])
def test_capacity_drops_exactly_what_a_per_subgroup_reference_drops(jax_cpu8, mesh_name):
    model = build("subgroup_capacity", MESHES[mesh_name], BATCH, SEQ, capacity_factor=0.5)
    x, cot = inputs(BATCH, SEQ)
    y, stats, _, _ = loss_and_grads(model, x, cot)
    cp = model.layout.size(model.layout.sequence)
    keep = reference_keep(host_weights(model), x, model.spec, cp)
    ry, rstats = reference_moe(host_weights(model), x, model.spec, keep)
    assert rstats["dropped_tokens"] > 0  # the test must exercise drops
    assert float(stats["dropped_tokens"]) == rstats["dropped_tokens"]
    np.testing.assert_allclose(
        float(stats["dropped_fraction"]), rstats["dropped_fraction"], rtol=1e-6
    )
    assert_close(y, ry, what="output with drops")


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_statistics_are_global_across_cp(jax_cpu8, strategy):
    """cp = 1 and cp = 4 report the same statistics for the same global batch."""
    x, cot = inputs(2, 64)
    results = []
    for sizes in ({"data": 2, "context": 1}, {"data": 2, "context": 4}):
        model = build(strategy, sizes, 2, 64)
        _, stats, _, _ = loss_and_grads(model, x, cot)
        results.append(stats)
    ref_model = build(strategy, {"data": 2, "context": 1}, 2, 64)
    _, ref_stats = reference_moe(ref_model.weights(), x, ref_model.spec)
    for key in ("load_balance_loss", "tokens_per_expert"):
        np.testing.assert_allclose(results[0][key], results[1][key], rtol=1e-6, atol=0)
        np.testing.assert_allclose(results[1][key], ref_stats[key], rtol=1e-6, atol=0)
    assert float(np.sum(results[1]["tokens_per_expert"])) == 2 * 64 * 2


@pytest.mark.parametrize("strategy", ["dense", "megablox"])
def test_decode_on_the_decode_axis_repeats_the_token_and_matches(jax_cpu8, strategy):
    """At decode the context_autoregressive axis (MaxText's decode axis) holds the one
    new token repeated: the block runs (weights rest split over it too), every copy of
    the output matches the reference, and the statistics count each token once."""
    model = build(strategy, {"fsdp": 4, "context_autoregressive": 2}, BATCH, SEQ, "mode=decode")
    assert model.layout.sequence == () and "context_autoregressive" in model.layout.embed
    assert not model.wi_0[...].sharding.is_fully_replicated
    x, _ = inputs(BATCH, 1)
    x = jax.device_put(x, model.layout.named(model.layout.x_BSM))
    y, stats = jax.jit(block_forward(model))(model.weights(), x)
    ry, rstats = reference_moe(host_weights(model), x, model.spec)
    assert_close(y, ry, what="decode output")
    for shard in y.addressable_shards:  # each device's copy of its tokens, not one of them
        assert_close(shard.data, np.asarray(ry)[shard.index], what=f"copy on {shard.device}")
    np.testing.assert_allclose(stats["tokens_per_expert"], rstats["tokens_per_expert"], rtol=0)
    assert float(np.sum(stats["tokens_per_expert"])) == BATCH * model.spec.top_k


# bfloat16 keeps 8 bits of mantissa (relative rounding 2**-9 = 0.2%); the block rounds
# its inputs, weights, hidden activations and outputs to it, so outputs and gradients
# carry a few tenths of a percent of error against float32. 2% of the output's scale
# bounds it with room for the sums; a wrong routing or a missed term shows up at 10-100%.
BF16_TOLERANCE = 2e-2  # measured: 0.4% to 1.0% on these shapes


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_bfloat16_block_matches_float32_reference(jax_cpu8, strategy):
    model = build(
        strategy, MESHES["data2_cp4"], BATCH, SEQ, "dtype=bfloat16", "param_dtype=bfloat16"
    )
    assert model.wi_0[...].dtype == jnp.bfloat16 and model.gate.kernel[...].dtype == jnp.bfloat16
    x, cot = inputs(BATCH, SEQ)
    y, stats, gw, gx = loss_and_grads(model, x, cot)
    assert gw.wi_0_EMH.dtype == jnp.bfloat16
    w32 = jax.tree.map(lambda a: a.astype(jnp.float32), model.weights())
    spec, ids = model.spec, reference_choices(w32, x, model.spec)
    keep = reference_keep(w32, x, spec, 4, ids)

    def loss(w, x):
        y, _ = reference_moe(w, x, spec, keep, ids)
        return jnp.sum(y * cot), y

    (_, ry), (rgw, rgx) = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(w32, x)
    assert_close(y, ry, rel=BF16_TOLERANCE, what="bf16 output")
    assert_close(gx, rgx, rel=BF16_TOLERANCE, what="bf16 d/dx")
    for name in ("wi_0_EMH", "wi_1_EMH", "wo_EHM"):
        assert_close(getattr(gw, name), getattr(rgw, name), rel=BF16_TOLERANCE, what=name)


@pytest.mark.parametrize(
    "mesh_name, exchange",
    [("fsdp2_cp4", "gather"), ("fsdp2_cp4", "all_to_all"), ("tensor2_cp4", "gather")],
)
def test_pallas_kernels_inside_the_block_match_the_reference(jax_cpu8, mesh_name, exchange):
    """The TPU backend (JAX's Pallas megablox kernels with our VJP wiring) inside the
    block's check_vma shard_map, gathered and exchanged, forward and backward: run here
    in Pallas interpret mode, the same kernels XLA:TPU compiles (tests/selector/test_targets.py)."""
    model = build(
        "megablox",
        MESHES[mesh_name],
        BATCH,
        SEQ,
        "gmm_backend=pallas_megablox",
        f"expert_exchange={exchange}",
    )
    assert model.plan.gmm_backend == "pallas_megablox"
    assert (model.spec.exchange is not None) == (exchange == "all_to_all")
    x, cot = inputs(BATCH, SEQ)
    y, _, gw, gx = loss_and_grads(model, x, cot)
    ry, rgw, rgx = reference_grads(model, x, cot, model.layout.size(model.layout.sequence))
    assert_close(y, ry, what="output")
    assert_close(gx, rgx, what="d/dx")
    for name in ("gate_ME", "wi_0_EMH", "wi_1_EMH", "wo_EHM"):
        assert_close(getattr(gw, name), getattr(rgw, name), what=f"d/d{name}")


@pytest.mark.parametrize("exchange", ["gather", "all_to_all"])
def test_the_plans_row_tile_reaches_the_pallas_kernels(jax_cpu8, monkeypatch, exchange):
    """The block passes the plan's row tile (`plan.gmm_tiling.tm`, here forced by
    gmm_row_tile) to every Pallas kernel call, gathered and exchanged, forward and
    backward, and still equals the reference; exchanged, tgmm adds into the
    accumulators it is given."""
    from test_grouped_matmul import _recording_kernels

    model = build(
        "megablox",
        MESHES["fsdp2_cp4"],
        BATCH,
        SEQ,
        "gmm_backend=pallas_megablox",
        "gmm_row_tile=16",
        f"expert_exchange={exchange}",
    )
    assert model.plan.gmm_tiling.tm == 16 and model.plan.gmm_tiling.source == "gmm_row_tile"
    seen = _recording_kernels(monkeypatch)
    x, cot = inputs(BATCH, SEQ)
    y, _, gw, gx = loss_and_grads(model, x, cot)
    assert {name for name, _, _, _ in seen} == {"gmm", "tgmm"}
    assert {tiling[0] for _, tiling, _, _ in seen} == {16}
    assert all(rows % 16 == 0 for _, _, rows, _ in seen)
    # Exchanged, each slot's weight gradient is added by tgmm into the float32
    # accumulators in place, not returned a slot at a time and added afterwards (what
    # jax.vjp of the kernel does, as the gathered block's backward does once).
    into = {acc for name, _, _, acc in seen if name == "tgmm"}
    assert into == {exchange == "all_to_all"}, into
    ry, rgw, rgx = reference_grads(model, x, cot, model.layout.size(model.layout.sequence))
    assert_close(y, ry, what="output")
    assert_close(gx, rgx, what="d/dx")
    for name in ("gate_ME", "wi_0_EMH", "wi_1_EMH", "wo_EHM"):
        assert_close(getattr(gw, name), getattr(rgw, name), what=f"d/d{name}")
