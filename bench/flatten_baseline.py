"""The block the public bug report describes (../shared/context: RoutedMoE "flattens
(batch, sequence) into a single token axis before the grouped matmul"), kept only as a
baseline for tests and benchmarks: flatten (batch, sequence) into one token axis and
sort the tokens globally under plain jit. It is our megablox computation run on the
global arrays instead of per device, so the contrast with `megablox` is the sharding
alone: XLA must gather the whole sequence onto every device, and context parallelism
saves little in this block. Do not use it in a model.

It stands for the report, not for MaxText as measured: on MaxText 0.2.5 (CPU, 8
simulated devices) the ragged path keeps the sequence sharded, and only the Pallas path,
in interpret mode, showed a curve like this one (README, first section).
"""

from __future__ import annotations

import jax

from layers import megablox
from layers.ffn import ExpertWeights
from layers.router import finish_stats
from layers.sharding import Layout
from layers.spec import MoESpec


def flatten_forward(layout: Layout, spec: MoESpec, x_BSM, w: ExpertWeights):
    x_BSM = jax.lax.with_sharding_constraint(x_BSM, layout.named(layout.x_BSM))
    y_BSM, sums = megablox.local_forward(x_BSM, w, spec)
    y_BSM = jax.lax.with_sharding_constraint(y_BSM, layout.named(layout.x_BSM))
    return y_BSM, finish_stats(sums, spec.top_k)


def flatten_block_forward(model):
    """forward(weights, x_BSM) -> (y_BSM, stats) of the baseline, on `model`'s layout
    and spec (for `layers.programs.compile_fwd_bwd(..., forward=...)`)."""
    return lambda w, x: flatten_forward(model.layout, model.spec, x, w)
