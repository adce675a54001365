"""What today's frameworks do, kept only as a baseline for tests and benchmarks:
flatten (batch, sequence) into one token axis and sort the tokens globally under plain
jit. XLA must gather the whole sequence onto every device to do that, so context
parallelism saves nothing in this block. Do not use it in a model.

Legend: B batch, S sequence, T global tokens, K top-k, R = T*K rows, M embedding.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .ffn import ExpertWeights, swiglu
from .grouped_matmul import gmm
from .router import finish_stats, partial_stats, route
from .sharding import Layout
from .spec import MoESpec


def flatten_forward(layout: Layout, spec: MoESpec, x_BSM, w: ExpertWeights):
    x_BSM = jax.lax.with_sharding_constraint(x_BSM, layout.named(layout.x_BSM))
    batch, seq, emb = x_BSM.shape
    x_TM = x_BSM.reshape(batch * seq, emb)
    weights_TK, ids_TK, probs_TE = route(x_TM, w.gate_ME, spec.top_k, spec.norm_topk_prob)
    ids_R = ids_TK.reshape(-1)
    order_R = jnp.argsort(ids_R, stable=True)
    group_sizes_E = jnp.zeros((spec.num_experts,), jnp.int32).at[ids_R].add(1)
    x_RM = jnp.take(x_TM, order_R // spec.top_k, axis=0)
    h_RH = swiglu(
        gmm(x_RM, w.wi_0_EMH, group_sizes_E, "ragged_dot"),
        gmm(x_RM, w.wi_1_EMH, group_sizes_E, "ragged_dot"),
    )
    y_RM = gmm(h_RH, w.wo_EHM, group_sizes_E, "ragged_dot")
    y_TKM = jnp.take(y_RM, jnp.argsort(order_R), axis=0).reshape(batch * seq, spec.top_k, emb)
    y_TM = jnp.einsum("tkm,tk->tm", y_TKM, weights_TK)
    y_BSM = jax.lax.with_sharding_constraint(
        y_TM.reshape(batch, seq, emb), layout.named(layout.x_BSM)
    )
    return y_BSM, finish_stats(partial_stats(probs_TE, ids_TK, 0), spec.top_k)
