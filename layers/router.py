"""Router: float32 gate logits, softmax over experts, top-k, and the load statistics.

Legend: T tokens, M embedding, E experts, K experts per token.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def group_mask(select_TE, groups: int, topk_groups: int):
    """1.0 for the experts of each token's best `topk_groups` groups, a group scoring
    the sum of its two best experts (DeepSeek-V3's group-limited routing)."""
    tokens, experts = select_TE.shape
    grouped_TGX = select_TE.reshape(tokens, groups, experts // groups)
    best = jax.lax.top_k(grouped_TGX, min(2, experts // groups))[0]
    _, top_groups_TK = jax.lax.top_k(jnp.sum(best, axis=-1), topk_groups)
    chosen_TG = jnp.sum(jax.nn.one_hot(top_groups_TK, groups, dtype=jnp.float32), axis=-2)
    return jnp.repeat(chosen_TG, experts // groups, axis=-1)


def route(x_TM, w, spec):
    """(weights_TK float32, ids_TK int32, probs_TE float32) for local tokens.

    Scores are the softmax of the router logits (or their sigmoid: DeepSeek-V3). The
    top-k is chosen on the scores plus the routed bias (which steers selection only and
    takes no gradient), within the best groups when routing is group-limited; the
    combine weights are the chosen scores, renormalised when norm_topk_prob, times
    routed_scaling_factor. probs_TE (scores normalised to sum to 1) feed the balance loss.
    """
    logits_TE = jnp.einsum("tm,me->te", x_TM.astype(jnp.float32), w.gate_ME.astype(jnp.float32))
    if spec.score_func == "sigmoid":
        scores_TE = jax.nn.sigmoid(logits_TE)
        probs_TE = scores_TE / jnp.sum(scores_TE, axis=-1, keepdims=True)
    else:
        scores_TE = probs_TE = jax.nn.softmax(logits_TE, axis=-1)
    select_TE = scores_TE
    if w.bias_E is not None:
        select_TE = select_TE + jax.lax.stop_gradient(w.bias_E.astype(jnp.float32))[None, :]
    if spec.n_routing_groups > 0:
        keep_TE = group_mask(select_TE, spec.n_routing_groups, spec.topk_routing_group)
        select_TE = jnp.where(keep_TE > 0, select_TE, -jnp.inf)
    _, ids_TK = jax.lax.top_k(select_TE, spec.top_k)
    weights_TK = jnp.take_along_axis(scores_TE, ids_TK, axis=-1)
    if spec.norm_topk_prob:
        weights_TK = weights_TK / (jnp.sum(weights_TK, axis=-1, keepdims=True) + 1e-20)
    if spec.routed_scaling_factor != 1.0:
        weights_TK = weights_TK * spec.routed_scaling_factor
    return weights_TK, ids_TK.astype(jnp.int32), probs_TE


def update_routed_bias(bias_E, tokens_per_expert_E, rate: float):
    """Aux-loss-free balancing (DeepSeek-V3, MaxText's routed_bias_update_rate): after a
    step, raise the bias of under-loaded experts and lower it for over-loaded ones by
    `rate`, from the step's global `stats["tokens_per_expert"]`."""
    load = tokens_per_expert_E.astype(jnp.float32)
    return bias_E + rate * jnp.sign(jnp.mean(load) - load).astype(bias_E.dtype)


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
