"""The routing of MaxText's shipped MoE models, in our block, against the plain
reference: DeepSeek-V3 (sigmoid scores, a routed bias that steers selection only,
group-limited top-k, routed_scaling_factor, a shared expert), DeepSeek-V2 (softmax
without renormalisation, scaling, two shared experts) and Qwen3-Next (softmax top-10
renormalised, a shared expert behind a sigmoid gate: the Qwen3NextSparseMoeBlock of
the bug report), under cp = 4 and with tensor and expert parallelism."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from layer_helpers import (
    ROUTINGS,
    assert_close,
    build,
    host_weights,
    inputs,
    loss_and_grads,
    reference_grads,
)
from reference import reference_choices, reference_moe

BATCH, SEQ = 8, 32
MESHES = {
    "data2_cp4": {"data": 2, "context": 4},
    "tensor2_cp4": {"context": 4, "tensor": 2},
}


def with_bias(model, seed: int = 3):
    """A nonzero routed bias, so it really changes which experts are chosen."""
    if model.gate.bias is None:
        return
    bias = np.random.default_rng(seed).normal(0, 0.2, model.spec.num_experts)
    model.gate.bias[...] = jnp.asarray(bias, jnp.float32)


def check(model, x, cot, what):
    y, stats, gw, gx = loss_and_grads(model, x, cot)
    ry, rgw, rgx = reference_grads(model, x, cot, model.layout.size(model.layout.sequence))
    assert_close(y, ry, what=f"{what} output")
    assert_close(gx, rgx, what=f"{what} d/dx")
    for name, ref in vars(rgw).items():
        if ref is not None and name != "bias_E":
            assert_close(getattr(gw, name), ref, what=f"{what} d/d{name}")
    if model.gate.bias is not None:  # selection only: no gradient reaches the bias
        assert float(jnp.abs(gw.bias_E).max()) == 0.0
    return stats


# Every strategy under cp = 4; megablox also with tensor splitting the routed and the
# shared experts' hidden dims (the other strategies' tensor split is in test_layers_parity).
CASES = [
    (strategy, routing, "data2_cp4")
    for strategy in ("megablox", "dense", "subgroup_capacity")
    for routing in ROUTINGS
] + [("megablox", routing, "tensor2_cp4") for routing in ROUTINGS]


@pytest.mark.parametrize("strategy,routing,mesh_name", CASES)
def test_routing_matches_reference(jax_cpu8, strategy, routing, mesh_name):
    model = build(strategy, MESHES[mesh_name], BATCH, SEQ, *ROUTINGS[routing])
    with_bias(model)
    x, cot = inputs(BATCH, SEQ)
    check(model, x, cot, f"{strategy} {routing} {mesh_name}")


def test_routed_bias_and_groups_change_the_choice(jax_cpu8):
    """Guards the test above: the bias and the group limit really move experts."""
    model = build("megablox", MESHES["data2_cp4"], BATCH, SEQ, *ROUTINGS["deepseek_v3"])
    x, _ = inputs(BATCH, SEQ)
    plain = reference_choices(host_weights(model), x, model.spec)
    with_bias(model)
    biased = reference_choices(host_weights(model), x, model.spec)
    assert (np.sort(plain, -1) != np.sort(biased, -1)).any(axis=-1).mean() > 0.2
    groups = np.asarray(biased) // 4  # 4 experts per group, 2 groups allowed
    assert all(len(set(row)) <= 2 for row in groups)


def test_expert_parallel_with_deepseek_routing(jax_cpu8):
    model = build(
        "megablox",
        MESHES["data2_cp4"],
        BATCH,
        SEQ,
        *ROUTINGS["deepseek_v3"],
        "expert_exchange=all_to_all",
    )
    assert model.plan.placement.group_axes == ("context",)
    with_bias(model)
    x, cot = inputs(BATCH, SEQ)
    check(model, x, cot, "deepseek_v3 expert parallel")


@pytest.mark.parametrize("rounding,expected", [("ours", 7), ("maxtext", 6)])
def test_capacity_rounding_drops_what_each_formula_drops(jax_cpu8, rounding, expected):
    """Sub-sequences of 50 tokens, k=2, E=8, capacity factor 0.5: ours keeps 7 per
    expert, MaxText's int(max(ceil(g k / E) x cf, cf)) keeps 6; the block drops exactly
    what the reference of each formula drops."""
    model = build(
        "subgroup_capacity",
        {"data": 2},
        2,
        50,
        f"capacity_rounding={rounding}",
        capacity_factor=0.5,
    )
    assert model.spec.capacity(50) == expected
    x, cot = inputs(2, 50)
    _, stats, _, _ = loss_and_grads(model, x, cot)
    from reference import reference_keep

    keep = reference_keep(host_weights(model), x, model.spec, 1)
    _, ref = reference_moe(host_weights(model), x, model.spec, keep)
    assert ref["dropped_tokens"] > 0 and float(stats["dropped_tokens"]) == ref["dropped_tokens"]


def test_routed_bias_update_moves_load_towards_balance(jax_cpu8):
    """Aux-loss-free balancing: an under-loaded expert's bias rises by the rate, an
    over-loaded one's falls, one at the mean stays; applied step after step to a router
    whose bias starts skewed towards expert 0 (DeepSeek-V3 routing, where the bias only
    chooses), expert 0's load comes at least half-way back to the mean."""
    from layers.programs import block_forward
    from layers.router import update_routed_bias

    bias = jnp.zeros((4,), jnp.float32)
    new = update_routed_bias(bias, jnp.asarray([10.0, 2.0, 6.0, 6.0]), 0.5)
    np.testing.assert_array_equal(np.asarray(new), [-0.5, 0.5, 0.0, 0.0])

    model = build("megablox", {"data": 8}, 8, 32, *ROUTINGS["deepseek_v3"])
    model.gate.bias[...] = jnp.zeros((16,), jnp.float32).at[0].set(0.3)  # expert 0 favoured
    x, _ = inputs(8, 32)
    forward = jax.jit(block_forward(model))  # one program; the bias is an input
    loads = []
    for _ in range(8):
        _, stats = forward(model.weights(), x)
        loads.append(np.asarray(stats["tokens_per_expert"]))
        model.gate.bias[...] = update_routed_bias(
            model.gate.bias[...], stats["tokens_per_expert"], 0.05
        )
    mean = loads[0].mean()
    assert loads[0][0] > 2 * mean  # the bias did skew the choice
    assert abs(loads[-1][0] - mean) < 0.5 * abs(loads[0][0] - mean), [ld[0] for ld in loads]
