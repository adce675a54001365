"""No token lost silently: dropless paths route all tokens x k assignments, the capacity
path counts its drops, and non-finite inputs have one documented behaviour."""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
from layer_helpers import assert_close, build, host_weights, inputs, loss_and_grads
from reference import reference_keep, reference_moe

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
    y, stats, gw, gx = loss_and_grads(model, x, cot)
    assert float(stats["nonfinite_tokens"]) == 1
    y = np.asarray(y)
    assert not np.isfinite(y[1, 5]).all()
    others = np.ones((BATCH, SEQ), bool)
    others[1, 5] = False
    assert np.isfinite(y[others]).all()
    ry, _ = reference_moe(host_weights(model), x, model.spec)
    assert_close(y[others], np.asarray(ry)[others], what="finite tokens")
    # Backward: the poisoned token's gradient is not finite, and it reaches the weight
    # gradients it was routed through (the step is to be skipped: nonfinite_tokens
    # says so). Every other token's input gradient stays finite, except on the capacity
    # path, whose dispatch and combine einsums multiply the poisoned slot by the zeros
    # of every token of its subgroup (sequence shard): those 16 tokens, no others.
    gx = np.asarray(gx)
    assert not np.isfinite(gx[1, 5]).all()
    clean = others.copy()
    if strategy == "subgroup_capacity":
        shard = SEQ // MESH["context"]
        assert not np.isfinite(gx[1, :shard]).all(axis=-1).any()
        clean[1, :shard] = False
    assert np.isfinite(gx[clean]).all()
    assert not np.isfinite(np.asarray(gw.gate_ME)).all()


def test_a_plan_for_another_mesh_is_refused(jax_cpu8):
    """A plan resolved for (fsdp=2, context=4) with its exchange over context, given to
    a block on (data=8): a ValueError naming both meshes, not a block without
    sequence axes whose plan still describes the exchange."""
    from flax import nnx

    import layers
    import selector

    model = build("megablox", {"fsdp": 2, "context": 4}, 2, 64, "expert_exchange=all_to_all")
    assert model.plan.placement.group_axes  # the exchange the plan describes
    other = layers.make_mesh({"data": 8})
    cfg = selector.compose(["model=tiny", "mesh=cpu_8", "hardware=cpu"])
    with pytest.raises(ValueError, match=r"resolved for a mesh of \{'fsdp': 2, 'context': 4\}"):
        layers.MoEBlock(cfg, mesh=other, plan=model.plan, rngs=nnx.Rngs(0))


def test_a_mesh_with_explicit_axes_is_refused(jax_cpu8):
    import jax
    from flax import nnx

    import layers
    import selector

    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))
    cfg = selector.compose(["model=tiny", "mesh=cpu_8", "hardware=cpu"])
    with pytest.raises(ValueError, match="not of auto type"):
        layers.MoEBlock(selector.resolve(cfg, mesh), mesh=mesh, rngs=nnx.Rngs(0))


@pytest.mark.parametrize("size", [0, -2])
def test_a_live_mesh_axis_without_devices_is_a_finding(size):
    import selector

    cfg = selector.compose(["model=tiny", "mesh=cpu_8", "hardware=cpu"])
    findings = selector.validate(cfg, {"data": size, "context": 8})
    assert [f.code for f in findings] == ["MESH_AXIS_INVALID"]
    with pytest.raises(selector.ConfigError, match="MESH_AXIS_INVALID"):
        selector.resolve(cfg, {"data": size, "context": 8})


def test_the_block_takes_its_config_from_the_plan(jax_cpu8):
    """The block builds from the config its plan was resolved from: the plan alone
    works; a config without a plan, or one that disagrees with its plan, is refused."""
    from flax import nnx

    import layers
    import selector

    mesh = layers.make_mesh({"fsdp": 8})
    cfg = selector.compose(["model=tiny", "mesh=cpu_8", "hardware=cpu"])
    plan = selector.resolve(cfg, mesh)
    block = layers.MoEBlock(plan, mesh=mesh, rngs=nnx.Rngs(0))
    assert block.spec.emb == plan.config.base_emb_dim == 64
    with pytest.raises(TypeError, match=r"MoEBlock\(selector\.resolve\(cfg, mesh\)"):
        layers.MoEBlock(cfg, mesh=mesh, rngs=nnx.Rngs(0))
    wider = selector.compose(["model=tiny", "mesh=cpu_8", "hardware=cpu", "base_emb_dim=128"])
    with pytest.raises(
        ValueError, match=r"base_emb_dim=128 but its plan was resolved for base_emb_dim=64"
    ):
        layers.MoEBlock(wider, mesh=mesh, plan=plan, rngs=nnx.Rngs(0))
    bare = dataclasses.replace(plan, config=None)
    with pytest.raises(ValueError, match="carries no config"):
        bare.at_shape(8, 32)
