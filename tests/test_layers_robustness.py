"""No token lost silently: dropless paths route all tokens x k assignments, the capacity
path counts its drops, and non-finite inputs have one documented behaviour."""

import jax.numpy as jnp
import numpy as np
import pytest
from layer_helpers import assert_close, build, host_weights, inputs, loss_and_grads

from layers.reference import reference_keep, reference_moe

MESH = {"data": 2, "context": 4}
BATCH, SEQ = 2, 64


def route_like(model, routing: str):
    """Bias the router: uniform (as initialised), skewed towards expert 0, or every
    token's first choice on expert 0."""
    if routing == "uniform":
        return
    kernel = np.array(model.gate.kernel[...])
    kernel[:, 0] += 0.3 if routing == "skewed" else 0.0
    if routing == "single":
        kernel[0, :] = -50.0
        kernel[0, 0] = 50.0
    model.gate.kernel[...] = jnp.asarray(kernel)


def routed_inputs(routing: str):
    x, cot = inputs(BATCH, SEQ)
    if routing == "single":
        x = x.at[..., 0].set(4.0)  # with the kernel above: expert 0 scores 200 higher
    return x, cot


@pytest.mark.parametrize("routing", ["uniform", "skewed", "single"])
@pytest.mark.parametrize("strategy,top_k", [("megablox", 2), ("dense", 2), ("megablox", 1)])
def test_dropless_paths_route_every_assignment(jax_cpu8, strategy, top_k, routing):
    model = build(strategy, MESH, BATCH, SEQ, f"num_experts_per_tok={top_k}")
    route_like(model, routing)
    x, cot = routed_inputs(routing)
    y, stats, _, _ = loss_and_grads(model, x, cot)
    counts = np.asarray(stats["tokens_per_expert"])
    assert counts.sum() == BATCH * SEQ * top_k and float(stats["dropped_tokens"]) == 0
    if routing == "single":
        assert counts[0] == BATCH * SEQ  # every token's first choice
    ry, rstats = reference_moe(host_weights(model), x, model.spec)
    np.testing.assert_array_equal(counts, rstats["tokens_per_expert"])
    assert_close(y, ry, what=f"{strategy} {routing}")


@pytest.mark.parametrize("routing", ["skewed", "single"])
def test_capacity_path_counts_exactly_the_reference_drops(jax_cpu8, routing):
    model = build("subgroup_capacity", MESH, BATCH, SEQ, capacity_factor=1.0)
    route_like(model, routing)
    x, cot = routed_inputs(routing)
    y, stats, _, _ = loss_and_grads(model, x, cot)
    keep = reference_keep(host_weights(model), x, model.spec, 4)
    ry, rstats = reference_moe(host_weights(model), x, model.spec, keep)
    assert rstats["dropped_tokens"] > 0
    assert float(stats["dropped_tokens"]) == rstats["dropped_tokens"]
    assert_close(y, ry, what=f"capacity {routing}")


@pytest.mark.parametrize("bad", [np.nan, np.inf])
@pytest.mark.parametrize("strategy", ["dense", "megablox", "subgroup_capacity"])
def test_a_nonfinite_token_is_counted_and_poisons_only_itself(jax_cpu8, strategy, bad):
    """Documented behaviour: the block does not raise (it cannot, under jit); a token with
    a non-finite input gets a non-finite output, every other token is unaffected, and
    stats["nonfinite_tokens"] counts it (the load-balance loss then becomes NaN)."""
    model = build(strategy, MESH, BATCH, SEQ)
    x, cot = inputs(BATCH, SEQ)
    x = x.at[1, 5, 3].set(bad)
    y, stats, _, _ = loss_and_grads(model, x, jnp.zeros_like(cot))
    assert float(stats["nonfinite_tokens"]) == 1
    y = np.asarray(y)
    assert not np.isfinite(y[1, 5]).all()
    others = np.ones((BATCH, SEQ), bool)
    others[1, 5] = False
    assert np.isfinite(y[others]).all()
    ry, _ = reference_moe(host_weights(model), x, model.spec)
    assert_close(y[others], np.asarray(ry)[others], what="finite tokens")
