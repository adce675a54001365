"""The MoE block's programs for compiling and timing: its forward, a training-like
fwd+bwd loss, abstract inputs at their shardings, and each compiled for the block's
mesh (real devices or a compile target's abstract ones). They read only the block and
its plan; the checks (`checks.compiled`, `checks.measured`), the benchmarks and the
tests build on them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding

from .moe import MoEBlock, sharded_forward


def block_forward(model: MoEBlock):
    """forward(weights, x_BSM) -> (y_BSM, stats) for the block's plan."""
    layout, spec, strategy = model.layout, model.spec, model.plan.strategy
    return lambda w, x: sharded_forward(strategy, layout, spec, x, w)


def fwd_bwd_loss(forward):
    """A scalar training-like loss: sum of squares of the output plus the balance loss."""

    def loss(w, x):
        y, stats = forward(w, x)
        return jnp.sum(y * y) + stats["load_balance_loss"]

    return loss


def abstract_inputs(model: MoEBlock, batch: int, seq: int):
    """(weights, x) as ShapeDtypeStructs with their shardings on the block's mesh:
    parameters at their at-rest sharding, x in the compute dtype, sharded (batch axes,
    sequence axes). Works on an abstract block from nnx.eval_shape too."""
    layout = model.layout

    def at_rest(a):
        sharding = (
            a.sharding if isinstance(a.sharding, NamedSharding) else layout.named(layout.replicated)
        )
        return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding)

    w = jax.tree.map(at_rest, model.weights())
    x = jax.ShapeDtypeStruct(
        (batch, seq, model.spec.emb), model.spec.compute_dtype, sharding=layout.named(layout.x_BSM)
    )
    return w, x


def compile_fwd_bwd(
    model: MoEBlock,
    batch: int,
    seq: int,
    *,
    forward=None,
    compiler_options: dict | None = None,
):
    """The compiled program of d(loss)/d(weights, x) for a (batch, seq, emb) input, for
    the devices of the block's mesh (abstract TPU or GPU devices included: pass the
    target's `compile_options()`). `forward` (weights, x) -> (y, stats) defaults to the
    block's own (`block_forward`)."""
    loss = fwd_bwd_loss(forward or block_forward(model))
    w, x = abstract_inputs(model, batch, seq)
    return jax.jit(jax.grad(loss, argnums=(0, 1))).lower(w, x).compile(compiler_options)


def compile_forward(model: MoEBlock, batch: int, seq: int, *, compiler_options=None):
    """The compiled forward program (prefill and decode): (y, stats) from (weights, x)."""
    w, x = abstract_inputs(model, batch, seq)
    return jax.jit(block_forward(model)).lower(w, x).compile(compiler_options)
