"""MoEBlock end to end from the selector's config, and the plain blocks."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import layers
import selector

REPORTED_TINY = [
    "model=tiny",
    "mesh=cpu_8",
    "ici_context_parallelism=4",
    "per_device_batch_size=0.25",
    "max_target_length=8192",
]


def block_on(cfg, mesh_sizes: dict[str, int]):
    """The block the selector plans for `cfg` on a live mesh of `mesh_sizes`."""
    mesh = layers.make_mesh(mesh_sizes)
    return layers.MoEBlock(selector.resolve(cfg, mesh), mesh=mesh, rngs=nnx.Rngs(0))


def test_reported_case_builds_and_runs_forward_and_backward(jax_cpu8):
    cfg = selector.compose(REPORTED_TINY)
    plan = selector.resolve(cfg)
    assert plan.cp == 4 and plan.per_device.tokens_per_device == 2048
    mesh = layers.mesh_for_plan(plan)
    model = layers.MoEBlock(selector.resolve(cfg, mesh), mesh=mesh, rngs=nnx.Rngs(0))
    assert model.plan.mesh.source == "live mesh" and model.plan.strategy is plan.strategy
    x = jax.random.normal(jax.random.key(0), (round(plan.per_device.global_batch), 8192, 64))
    x = jax.device_put(x, model.layout.named(model.layout.x_BSM))

    @nnx.jit
    def step(model, x):
        def loss(model):
            y, stats = model(x)
            return jnp.mean(y**2) + 0.01 * stats["load_balance_loss"], stats

        (value, stats), grads = nnx.value_and_grad(loss, has_aux=True)(model)
        return value, stats, grads

    value, stats, grads = step(model, x)
    assert np.isfinite(float(value))
    assert float(jnp.sum(stats["tokens_per_expert"])) == 2 * 8192 * 2
    assert all(np.all(np.isfinite(g)) for g in jax.tree.leaves(grads))
    assert float(jnp.abs(grads["wi_0"][...]).sum()) > 0


def test_an_eager_call_is_compiled_once_and_matches_the_traced_block(jax_cpu8):
    """Called on concrete arrays (evaluation outside jit) the block compiles its program
    once per shape instead of running the shard_map body op by op, and gives what the
    same block gives inside the caller's jit, statistics included."""
    from layers import moe

    cfg = selector.compose([*REPORTED_TINY[:4], "max_target_length=64", "dtype=float32"])
    plan = selector.resolve(cfg)
    model = layers.MoEBlock(
        cfg, mesh=layers.mesh_for_plan(plan, jax.devices()[:8]), plan=plan, rngs=nnx.Rngs(0)
    )
    x = jax.random.normal(jax.random.key(1), (2, 64, 64))
    moe._compiled_forward.clear_cache()  # another test may have compiled this shape
    y_eager, stats_eager = model(x)
    model(x)
    assert moe._compiled_forward._cache_size() == 1
    y_jit, stats_jit = nnx.jit(lambda m, x: m(x))(model, x)
    np.testing.assert_allclose(np.asarray(y_eager), np.asarray(y_jit), rtol=1e-6, atol=1e-6)
    for name, value in stats_jit.items():
        np.testing.assert_allclose(np.asarray(stats_eager[name]), np.asarray(value), rtol=1e-6)


def test_block_rejects_bad_settings_with_config_error(jax_cpu8):
    cfg = selector.compose(
        [
            "model=tiny",
            "mesh=cpu_8",
            "ici_context_parallelism=4",
            "per_device_batch_size=1",
            "max_target_length=8192",
        ]
    )
    with pytest.raises(selector.ConfigError, match="LOCAL_BATCH_INFLATION"):
        block_on(cfg, {"fsdp": 2, "context": 4})


def test_block_refuses_inputs_no_plan_can_serve(jax_cpu8):
    """Any (batch, sequence) the mesh divides is served (tests/layers/test_layers_any_shape.py);
    a sequence the mesh does not divide, or another embedding width, is refused with the
    selector's finding and its fix."""
    cfg = selector.compose(
        ["model=tiny", "mesh=cpu_8", "per_device_batch_size=0.25", "ici_context_parallelism=4"]
    )
    model = block_on(cfg, {"fsdp": 2, "context": 4})
    with pytest.raises(selector.ConfigError, match=r"SEQUENCE_NOT_DIVISIBLE.*max_target_length=32"):
        model(jnp.zeros((2, 30, 64)))
    with pytest.raises(selector.ConfigError, match=r"INPUT_EMB_MISMATCH.*base_emb_dim=48"):
        model(jnp.zeros((4, 2048, 48)))


def test_parameter_names_and_shapes_follow_maxtext(jax_cpu8):
    cfg = selector.compose(["model=tiny", "mesh=cpu_8"])
    model = block_on(cfg, {"fsdp": 8})
    flat = nnx.to_flat_state(nnx.state(model, nnx.Param))
    shapes = {"/".join(map(str, k)): v.shape for k, v in flat}
    assert shapes == {
        "gate/kernel": (64, 8),
        "wi_0": (8, 64, 128),
        "wi_1": (8, 64, 128),
        "wo": (8, 128, 64),
    }


def test_one_expert_is_a_plain_mlp(jax_cpu8):
    cfg = selector.compose(
        [
            "model=tiny",
            "mesh=cpu_8",
            "num_experts=1",
            "num_experts_per_tok=1",
            "max_target_length=16",
        ]
    )
    model = block_on(cfg, {"fsdp": 8})
    assert model.plan.strategy is selector.Dispatch.mlp
    mlp = layers.MlpBlock(64, 128, rngs=nnx.Rngs(1))
    mlp.wi_0[...], mlp.wi_1[...], mlp.wo[...] = model.wi_0[0], model.wi_1[0], model.wo[0]
    x = jax.random.normal(jax.random.key(3), (8, 16, 64))
    y, stats = model(x)
    np.testing.assert_allclose(y, mlp(x), rtol=1e-5, atol=1e-6)
    assert float(stats["load_balance_loss"]) == pytest.approx(1.0)


def test_one_expert_applies_the_routing_scale(jax_cpu8):
    """One expert still carries MaxText's routed_scaling_factor: the MLP's output times
    the router's weight for it (1 after softmax, times the scale)."""
    overrides = ["model=tiny", "mesh=cpu_8", "num_experts=1", "num_experts_per_tok=1"]
    overrides += ["max_target_length=16"]
    plain = block_on(selector.compose(overrides), {"fsdp": 8})
    scaled = block_on(selector.compose([*overrides, "routed_scaling_factor=2.5"]), {"fsdp": 8})
    x = jax.random.normal(jax.random.key(3), (8, 16, 64))
    np.testing.assert_allclose(scaled(x)[0], 2.5 * plain(x)[0], rtol=1e-5, atol=1e-6)


def test_every_weight_is_described_once():
    """layers.weights is the one table of the block's weights: one entry per
    ExpertWeights field, in field order, each a role for every dim."""
    from layers.ffn import WEIGHT_FIELDS
    from layers.weights import WEIGHTS

    assert [w.field for w in WEIGHTS] == WEIGHT_FIELDS
    assert all(len(w.letters) == len(w.at_rest) for w in WEIGHTS)
