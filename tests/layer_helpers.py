"""Helpers for the layer tests: build a block on a mesh, and fwd+bwd functions."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from reference import reference_choices, reference_keep, reference_moe

import layers
import selector
from layers.programs import block_forward, compile_fwd_bwd


def build(
    strategy: str,
    mesh_sizes: dict,
    batch: int,
    seq: int,
    *extra: str,
    capacity_factor: float | None = None,
    seed: int = 0,
):
    """A tiny MoEBlock on `mesh_sizes` for a global (batch, seq) input."""
    mesh = layers.make_mesh(mesh_sizes)
    n = int(np.prod(list(mesh_sizes.values())))
    if capacity_factor is None:
        capacity_factor = 4.0 if strategy == "subgroup_capacity" else -1.0  # 4 = E/k: no drops
    cfg = selector.compose(
        [
            "model=tiny",
            "mesh=cpu_8",
            "hardware=cpu",
            f"dispatch={strategy}",
            f"capacity_factor={capacity_factor}",
            f"per_device_batch_size={batch / n}",
            f"max_target_length={seq}",
            "allow_local_batch_inflation=true",
            "context_parallel_load_balance=false",
            # The gathered path unless a test asks for the exchange (auto would pick it
            # on some meshes; test_expert_parallel covers it, test_selector_* the choice).
            *(
                ()
                if any(e.startswith("expert_exchange=") for e in extra)
                else ("expert_exchange=gather",)
            ),
            *extra,
        ]
    )
    return layers.MoEBlock(selector.resolve(cfg, mesh), mesh=mesh, rngs=nnx.Rngs(seed))


def inputs(batch: int, seq: int, emb: int = 64, seed: int = 1):
    x = jax.random.normal(jax.random.key(seed), (batch, seq, emb), jnp.float32)
    cot = jax.random.normal(jax.random.key(seed + 1), (batch, seq, emb), jnp.float32)
    return x, cot


def loss_and_grads(model: layers.MoEBlock, x, cot):
    """jit-compiled (y, stats, d loss / d weights, d loss / d x) for loss = <y, cot>."""
    x = jax.device_put(x, model.layout.named(model.layout.x_BSM))
    forward = block_forward(model)

    def loss(w, x):
        y, stats = forward(w, x)
        return jnp.sum(y * cot), (y, stats)

    fn = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))
    (_, (y, stats)), (gw, gx) = fn(model.weights(), x)
    return y, stats, gw, gx


def compiled_fwd_bwd(model: layers.MoEBlock, batch: int, seq: int, emb: int = 64):
    """The compiled fwd+bwd program for a (batch, seq, emb) input on the model's mesh."""
    assert emb == model.spec.emb
    return compile_fwd_bwd(model, batch, seq)


def assert_close(actual, expected, rel=1e-5, what=""):
    """|actual - expected| <= rel * max|expected|, elementwise (scale-relative)."""
    a, e = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    scale = max(np.max(np.abs(e)), 1e-30)
    err = np.max(np.abs(a - e)) / scale
    assert err <= rel, f"{what}: max error {err:.3g} of scale {scale:.3g} > {rel}"


def weight_shapes(model: layers.MoEBlock) -> set[tuple[int, ...]]:
    """Every shape a weight (or its gradient) takes between rest and compute."""
    from hlo import weight_stage_shapes

    lay = model.layout
    e, m, h = model.spec.num_experts, model.spec.emb, model.spec.hidden
    ex, em, hi = lay.size(lay.experts), lay.size(lay.embed), lay.size(lay.hidden)
    ex_compute = lay.size(lay.group)  # the group keeps its experts split; 1 when gathered
    shapes = weight_stage_shapes((m, e), [(em, 1), (1, 1)])
    shapes |= {s[::-1] for s in shapes}  # XLA:GPU gathers the router kernel transposed
    shapes |= weight_stage_shapes((e, m, h), [(ex, em, hi), (ex, 1, hi), (ex_compute, 1, hi)])
    shapes |= weight_stage_shapes((e, h, m), [(ex, hi, em), (ex, hi, 1), (ex_compute, hi, 1)])
    return shapes


def host_weights(model: layers.MoEBlock):
    """The block's weights as plain single-device arrays, for the reference MoE (which
    is about the math, not the sharding)."""
    return jax.tree.map(lambda a: jnp.asarray(np.asarray(a)), model.weights())


def reference_grads_and_keep(model, x, cot, cp):
    """(y, d/dweights, d/dx, keep) of the plain MoE at this input: capacity counted per
    subgroup of the input's own sequence (the reference's formula, not the plan's)."""
    spec, w = model.spec, host_weights(model)
    ids = reference_choices(w, x, spec)
    keep = reference_keep(w, x, spec, cp, ids)

    def loss(w, x):
        y, _ = reference_moe(w, x, spec, keep, ids)
        return jnp.sum(y * cot), y

    (_, y), (gw, gx) = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(w, x)
    return y, gw, gx, keep


def reference_grads(model, x, cot, cp):
    return reference_grads_and_keep(model, x, cot, cp)[:3]


# MaxText's routing variants as selector overrides (shared by the routing and port tests).
ROUTINGS = {
    "deepseek_v3": (
        "num_experts=16",
        "num_experts_per_tok=4",
        "routed_score_func=sigmoid",
        "routed_bias=true",
        "routed_scaling_factor=2.5",
        "n_routing_groups=4",
        "topk_routing_group=2",
        "norm_topk_prob=true",
        "shared_experts=1",
    ),
    "deepseek_v2": (
        "num_experts=16",
        "num_experts_per_tok=3",
        "norm_topk_prob=false",
        "routed_scaling_factor=16",
        "shared_experts=2",
    ),
    "qwen3_next": (
        "num_experts=16",
        "num_experts_per_tok=4",
        "norm_topk_prob=true",
        "shared_experts=1",
        "shared_expert_gate=true",
    ),
}
