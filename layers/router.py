"""Router: float32 gate logits, softmax over experts, top-k, and the load statistics.

Legend: T tokens, M embedding, E experts, K experts per token.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def route(x_TM, gate_ME, top_k: int, norm_topk_prob: bool):
    """(weights_TK float32, ids_TK int32, probs_TE float32) for local tokens."""
    logits_TE = jnp.einsum("tm,me->te", x_TM.astype(jnp.float32), gate_ME.astype(jnp.float32))
    probs_TE = jax.nn.softmax(logits_TE, axis=-1)
    weights_TK, ids_TK = jax.lax.top_k(probs_TE, top_k)
    if norm_topk_prob:
        weights_TK = weights_TK / jnp.sum(weights_TK, axis=-1, keepdims=True)
    return weights_TK, ids_TK.astype(jnp.int32), probs_TE


# Keys of partial stats that are already global (agreed over the token axes) and must
# not be summed again: they pass through to the statistics without the prefix.
GLOBAL_PREFIX = "global:"


def split_global(sums: dict) -> tuple[dict, dict]:
    """(sums to add over the token axes, statistics that are already global)."""
    done = {k[len(GLOBAL_PREFIX) :]: v for k, v in sums.items() if k.startswith(GLOBAL_PREFIX)}
    return {k: v for k, v in sums.items() if not k.startswith(GLOBAL_PREFIX)}, done


def partial_stats(probs_TE, ids_TK, dropped) -> dict:
    """Local sums that `finish_stats` turns into global statistics after a psum."""
    num_experts = probs_TE.shape[-1]
    counts_E = jnp.zeros((num_experts,), jnp.float32).at[ids_TK.reshape(-1)].add(1.0)
    nonfinite_T = ~jnp.all(jnp.isfinite(probs_TE), axis=-1)
    return {
        "assignments_E": counts_E,
        "prob_sum_E": jnp.sum(probs_TE, axis=0),
        "tokens": jnp.asarray(probs_TE.shape[0], jnp.float32),
        "dropped": jnp.asarray(dropped, jnp.float32),
        "nonfinite": jnp.sum(nonfinite_T).astype(jnp.float32),
    }


def finish_stats(sums: dict, top_k: int) -> dict:
    """Switch-style load-balance loss, dropped fraction, tokens per expert and the count
    of tokens whose router probabilities are not finite (NaN or inf inputs).

    From sums over every token of the global batch:
    loss = E * sum_e f_e * P_e, f_e the fraction of assignments to expert e and P_e the
    mean router probability of e (1.0 for perfectly uniform routing).
    """
    num_experts = sums["assignments_E"].shape[0]
    assignments = sums["tokens"] * top_k
    f_E = sums["assignments_E"] / assignments
    p_E = sums["prob_sum_E"] / sums["tokens"]
    return {
        "load_balance_loss": num_experts * jnp.sum(f_E * p_E),
        "dropped_fraction": sums["dropped"] / assignments,
        "dropped_tokens": sums["dropped"],
        "tokens_per_expert": sums["assignments_E"],
        "nonfinite_tokens": sums["nonfinite"],
    }
