"""Megablox dispatch: each device routes, sorts, runs the grouped matmul on and unsorts
only its local tokens (inside shard_map over the whole mesh), so the flatten of
(batch, sequence) happens per shard and never gathers the sequence.

Legend: B batch, S sequence, T local tokens, K top-k, R = T*K routed rows,
M embedding, H hidden, E experts.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .expert_parallel import exchange_swiglu
from .ffn import ExpertWeights, swiglu
from .grouped_matmul import gmm, gmm_multi
from .router import GLOBAL_PREFIX, partial_stats, route
from .spec import MoESpec
from .vma import varying_like


def local_forward(x_BSM, w: ExpertWeights, spec: MoESpec):
    batch, seq, emb = x_BSM.shape
    x_TM = x_BSM.reshape(batch * seq, emb)
    with jax.named_scope("route"):
        weights_TK, ids_TK, probs_TE = route(x_TM, w, spec)
    with jax.named_scope("permute"):
        ids_R = ids_TK.reshape(-1)
        order_R = jnp.argsort(ids_R, stable=True)
        token_R = order_R // spec.top_k  # the token of each sorted row
        group_sizes_E = jnp.zeros((spec.num_experts,), jnp.int32).at[ids_R].add(1)
        dt = spec.compute_dtype
        x_TM = x_TM.astype(dt)
    with jax.named_scope("expert_compute"):
        experts = (w.wi_0_EMH.astype(dt), w.wi_1_EMH.astype(dt), w.wo_EHM.astype(dt))
        # The routing weight scales each row's activation before `wo` (the same
        # product), so the combine is a plain sum and its backward keeps no (rows x emb)
        # copy of the expert outputs: the weight's gradient reads the (rows x hidden)
        # activation the grouped matmul keeps anyway.
        weights_R = jnp.take(weights_TK.reshape(-1), order_R).astype(dt)
        if spec.exchange is not None:
            # Rows travel to their experts' owners and back, packed round by round
            # straight from the tokens and added straight back into them.
            ex = spec.exchange
            sorted_ids_R = jnp.take(ids_R, order_R)
            buffer = ex.buffer_rows(ids_R.shape[0])
            y_TM, rounds = exchange_swiglu(
                x_TM, token_R, sorted_ids_R, group_sizes_E, experts, weights_R, ex, buffer
            )
        else:
            kernel = dict(
                backend=spec.gmm_backend, platform=spec.platform, row_tile=spec.gmm_row_tile
            )
            # The tokens marked varying over the weights' axes before they are taken:
            # the input gradient's sum over the axes that split the hidden dim (tensor)
            # is then made once over the T tokens, not over the T x k rows.
            x_RM = jnp.take(varying_like(x_TM, *experts), token_R, axis=0)
            gate_RH, up_RH = gmm_multi(x_RM, experts[:2], group_sizes_E, **kernel)
            act_RH = swiglu(gate_RH, up_RH) * weights_R[:, None]
            y_RM = gmm(act_RH, experts[2], group_sizes_E, **kernel)
            with jax.named_scope("unpermute_combine"):
                # The rows are already weighted: each token sums its k rows, added
                # straight from sorted order (its backward reads the token's gradient
                # for each row), so no (tokens, k, emb) copy of the rows is made.
                y_TM = jnp.zeros((batch * seq, emb), dt).at[token_R].add(y_RM)
    sums = partial_stats(probs_TE, ids_TK, 0)
    if spec.exchange is not None:
        sums[GLOBAL_PREFIX + "exchange_rounds"] = rounds.astype(jnp.float32)
    return y_TM.reshape(batch, seq, emb).astype(x_BSM.dtype), sums
