"""Compile a block's forward+backward program, for tests and benchmarks that read the
compiled HLO and XLA's memory analysis instead of trusting the Python."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding

from .flatten_baseline import flatten_forward
from .moe import MoEBlock, sharded_forward


def block_forward(model: MoEBlock, *, flatten_baseline: bool = False):
    """forward(weights, x_BSM) -> (y_BSM, stats) for the block's plan (or the baseline)."""
    layout, spec, strategy = model.layout, model.spec, model.plan.strategy
    if flatten_baseline:
        return lambda w, x: flatten_forward(layout, spec, x, w)
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
    flatten_baseline: bool = False,
    compiler_options: dict | None = None,
):
    """The compiled program of d(loss)/d(weights, x) for a (batch, seq, emb) input, for
    the devices of the block's mesh (abstract TPU or GPU devices included: pass the
    target's `compile_options()`)."""
    loss = fwd_bwd_loss(block_forward(model, flatten_baseline=flatten_baseline))
    w, x = abstract_inputs(model, batch, seq)
    return jax.jit(jax.grad(loss, argnums=(0, 1))).lower(w, x).compile(compiler_options)


def compile_forward(model: MoEBlock, batch: int, seq: int, *, compiler_options=None):
    """The compiled forward program (prefill and decode): (y, stats) from (weights, x)."""
    w, x = abstract_inputs(model, batch, seq)
    return jax.jit(block_forward(model)).lower(w, x).compile(compiler_options)
