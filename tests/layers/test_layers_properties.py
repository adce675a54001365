"""Property: every configuration the selector passes without an error builds and runs
in the layers (tiny sizes, meshes of up to 8 simulated devices), and the plan's
per-device numbers are the block's real ones."""

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import layers
import selector
from selector import Config, ConfigError, Dispatch, Exchange, Mode
from selector.config import MESH_AXES


def factorisations(n: int, axes: int) -> list[tuple[int, ...]]:
    if axes == 1:
        return [(n,)]
    return [
        (d, *rest) for d in (1, 2, 4, 8) if n % d == 0 for rest in factorisations(n // d, axes - 1)
    ]


MESHES = [f for n in (2, 4, 8) for f in factorisations(n, len(MESH_AXES))]


@st.composite
def runnable_configs(draw) -> Config:
    sizes = dict(zip(MESH_AXES, draw(st.sampled_from(MESHES)), strict=True))
    n = math.prod(sizes.values())
    cp = sizes["context"] * sizes["context_usp_ulysses"] * sizes["context_autoregressive"]
    shards = sizes["data"] * sizes["fsdp"] * sizes["expert"]
    experts = sizes["expert"] * draw(st.sampled_from([2, 4]))
    dtype = draw(st.sampled_from(["float32", "bfloat16", "float16"]))
    # Mostly configurations the selector accepts (the point is to run them), with
    # every dispatch, exchange, mode and dtype represented.
    dispatch = draw(
        st.sampled_from(
            [Dispatch.auto, Dispatch.megablox, Dispatch.dense, Dispatch.subgroup_capacity]
        )
    )
    exchange = (
        Exchange.gather
        if dispatch in (Dispatch.dense, Dispatch.subgroup_capacity)
        else (draw(st.sampled_from(list(Exchange))))
    )
    capacity_factor = (
        draw(st.sampled_from([1.0, 2.0]))
        if dispatch is Dispatch.subgroup_capacity
        else draw(st.sampled_from([-1.0, -1.0, 1.5]))
    )
    # Decode takes cp only on the decode axis (the others are an error there).
    modes = [Mode.train, Mode.prefill] + (
        [Mode.decode] if cp == sizes["context_autoregressive"] else []
    )
    return Config(
        **{f"ici_{a}_parallelism": s for a, s in sizes.items()},
        dcn_data_parallelism=1,
        num_devices=n,
        per_device_batch_size=draw(st.sampled_from([1, 2])) * shards / n,
        max_target_length=2 * cp * draw(st.sampled_from([4, 8])),
        base_emb_dim=16 * sizes["fsdp"] * cp,
        base_moe_mlp_dim=16 * sizes["tensor"],
        # Whole heads on each tensor shard (a rule of the decoder's attention).
        base_num_query_heads=8,
        base_num_kv_heads=8,
        num_experts=experts,
        num_experts_per_tok=draw(st.integers(1, min(2, experts))),
        capacity_factor=capacity_factor,
        mode=draw(st.sampled_from(modes)),
        dispatch=dispatch,
        expert_exchange=exchange,
        dtype=dtype,
        param_dtype=draw(st.sampled_from(["float32", dtype, "float8_e4m3fn"])),
        allow_local_batch_inflation=True,
    )


@settings(max_examples=11, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(runnable_configs())
def test_every_passing_config_builds_and_runs(jax_cpu8, cfg):
    try:
        plan = selector.resolve(cfg)
    except ConfigError:
        return
    mesh = layers.mesh_for_plan(plan)
    model = layers.MoEBlock(cfg, mesh=mesh, plan=plan, rngs=nnx.Rngs(0))
    dev = plan.per_device
    shape = (round(dev.global_batch), dev.seq_len, cfg.base_emb_dim)
    x = jax.random.normal(jax.random.key(1), shape, jnp.float32).astype(cfg.dtype)
    x = jax.device_put(x, model.layout.named(model.layout.x_BSM))
    local = model.layout.named(model.layout.x_BSM).shard_shape(shape)
    assert local[0] * local[1] == dev.tokens_per_device
    assert local[0] * local[1] * cfg.num_experts_per_tok == dev.gmm_rows

    @nnx.jit
    def step(model, x):
        def loss(model):
            y, stats = model(x)
            return jnp.mean(y.astype(jnp.float32) ** 2), stats

        return nnx.value_and_grad(loss, has_aux=True)(model)

    (value, stats), grads = step(model, x)
    assert np.isfinite(float(value))
    assert float(stats["tokens_per_expert"].sum()) == math.prod(shape[:2]) * cfg.num_experts_per_tok
    assert all(np.isfinite(np.asarray(g, np.float32)).all() for g in jax.tree.leaves(grads))
