"""A plain MoE on unsharded arrays, written for clarity rather than speed: routing one
token at a time in numpy, a Python loop over experts. Every strategy is tested against
it, forward and gradients.

The top-k choice is discrete, so it is made first, on concrete arrays
(`reference_choices`); the differentiable part (`reference_moe`) then weights the
chosen experts with the router's scores, so gradients flow as in the block.

Legend: B batch, S sequence, T tokens, K top-k, M embedding, E experts.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from layers.ffn import ExpertWeights, dense_ffn
from layers.spec import MoESpec


def _scores(logits_E: np.ndarray, score_func: str) -> np.ndarray:
    if score_func == "sigmoid":
        return 1.0 / (1.0 + np.exp(-logits_E))
    e = np.exp(logits_E - logits_E.max())
    return e / e.sum()


def reference_choices(w: ExpertWeights, x_BSM, spec: MoESpec) -> np.ndarray:
    """ids_TK: each token's experts, chosen one token at a time: the k best of score +
    bias, within the topk_routing_group groups whose two best experts sum highest. In
    float32 like the block, so scores that underflow to the same value tie the same way
    (the lower expert id first)."""
    f32 = np.float32
    x_TM = np.asarray(x_BSM, f32).reshape(-1, x_BSM.shape[-1])
    gate = np.asarray(w.gate_ME, f32)
    bias = np.zeros(spec.num_experts, f32) if w.bias_E is None else np.asarray(w.bias_E, f32)
    ids = np.zeros((x_TM.shape[0], spec.top_k), np.int32)
    with np.errstate(invalid="ignore", over="ignore"):  # a non-finite token routes anyhow
        for t, x_M in enumerate(x_TM):
            ids[t] = _choose(x_M @ gate, bias, spec)
    return ids


def _choose(logits_E: np.ndarray, bias_E: np.ndarray, spec: MoESpec) -> np.ndarray:
    """One token's k experts (see reference_choices)."""
    select = _scores(logits_E, spec.score_func) + bias_E
    if spec.n_routing_groups > 0:
        per_group = spec.num_experts // spec.n_routing_groups
        groups = select.reshape(spec.n_routing_groups, per_group)
        group_score = np.sort(groups, axis=1)[:, ::-1][:, :2].sum(axis=1)
        keep = np.argsort(-group_score, kind="stable")[: spec.topk_routing_group]
        allowed = np.zeros(spec.num_experts, bool)
        for g in keep:
            allowed[g * per_group : (g + 1) * per_group] = True
        select = np.where(allowed, select, -np.inf)
    return np.argsort(-select, kind="stable")[: spec.top_k]


def reference_route(w: ExpertWeights, x_BSM, spec: MoESpec, ids_TK=None):
    """(weights_TK, ids_TK, probs_TE): the chosen experts' scores (renormalised when
    norm_topk_prob, times routed_scaling_factor); probs sum to 1 per token."""
    if ids_TK is None:
        ids_TK = reference_choices(w, x_BSM, spec)
    x_TM = x_BSM.reshape(-1, x_BSM.shape[-1]).astype(jnp.float32)
    logits_TE = x_TM @ w.gate_ME.astype(jnp.float32)
    if spec.score_func == "sigmoid":
        scores_TE = jax.nn.sigmoid(logits_TE)
        probs_TE = scores_TE / scores_TE.sum(-1, keepdims=True)
    else:
        scores_TE = probs_TE = jax.nn.softmax(logits_TE, axis=-1)
    weights_TK = jnp.take_along_axis(scores_TE, jnp.asarray(ids_TK), axis=-1)
    if spec.norm_topk_prob:
        weights_TK = weights_TK / (weights_TK.sum(-1, keepdims=True) + 1e-20)
    return weights_TK * spec.routed_scaling_factor, jnp.asarray(ids_TK), probs_TE


def reference_capacity(sub: int, spec: MoESpec) -> int:
    """Per-subgroup capacity, each formula written out again here."""
    if spec.capacity_rounding == "maxtext":  # MaxText 0.2.5, generate_masks_subgroup
        return int(
            max(
                math.ceil(sub * spec.top_k / spec.num_experts) * spec.capacity_factor,
                spec.capacity_factor,
            )
        )
    return max(1, math.ceil(sub * spec.top_k / spec.num_experts * spec.capacity_factor))


def reference_keep(w: ExpertWeights, x_BSM, spec: MoESpec, cp: int, ids_TK=None) -> np.ndarray:
    """keep_TK: which assignments survive per-subgroup capacity (all, when dropless).

    Each sequence is cut into cp contiguous subgroups; inside one, assignments queue per
    expert in token order then choice rank, and those past the capacity are dropped.
    """
    batch, seq, _ = x_BSM.shape
    if ids_TK is None:
        ids_TK = reference_choices(w, x_BSM, spec)
    ids = np.asarray(ids_TK).reshape(batch, seq, spec.top_k)
    keep = np.ones_like(ids, dtype=bool)
    if spec.capacity_factor <= 0:
        return keep.reshape(-1, spec.top_k)
    sub = seq // cp
    cap = reference_capacity(sub, spec)
    for b in range(batch):
        for g in range(cp):
            used = np.zeros(spec.num_experts, dtype=int)
            for s in range(g * sub, (g + 1) * sub):
                for r in range(spec.top_k):
                    e = ids[b, s, r]
                    keep[b, s, r] = used[e] < cap
                    used[e] += 1
    return keep.reshape(-1, spec.top_k)


def reference_moe(w: ExpertWeights, x_BSM, spec: MoESpec, keep_TK=None, ids_TK=None):
    """(y_BSM, stats) of a plain top-k MoE plus its shared experts; `keep_TK` from
    `reference_keep`, `ids_TK` from `reference_choices` (computed when omitted, which
    needs concrete weights)."""
    batch, seq, emb = x_BSM.shape
    x_TM = x_BSM.reshape(-1, emb)
    weights_TK, ids_TK, probs_TE = reference_route(w, x_BSM, spec, ids_TK)
    keep_TK = np.ones(ids_TK.shape, bool) if keep_TK is None else keep_TK
    y_TM = jnp.zeros_like(x_TM)
    for e in range(spec.num_experts):
        gate_T = jnp.sum(jnp.where((ids_TK == e) & keep_TK, weights_TK, 0.0), axis=-1)
        y_TM = y_TM + gate_T[:, None] * dense_ffn(x_TM, w.wi_0_EMH[e], w.wi_1_EMH[e], w.wo_EHM[e])
    if w.shared_wi_0_MS is not None:
        shared = dense_ffn(x_TM, w.shared_wi_0_MS, w.shared_wi_1_MS, w.shared_wo_SM)
        if w.shared_gate_M1 is not None:
            shared = shared * jax.nn.sigmoid(x_TM @ w.shared_gate_M1)
        y_TM = y_TM + shared
    tokens = x_TM.shape[0]
    counts_E = jnp.stack([jnp.sum(ids_TK == e) for e in range(spec.num_experts)]).astype(
        jnp.float32
    )
    f_E = counts_E / (tokens * spec.top_k)
    stats = {
        "load_balance_loss": spec.num_experts * jnp.sum(f_E * probs_TE.mean(0)),
        "dropped_tokens": float(np.sum(~keep_TK)),
        "dropped_fraction": float(np.sum(~keep_TK)) / (tokens * spec.top_k),
        "tokens_per_expert": counts_E,
    }
    return y_TM.reshape(batch, seq, emb), stats
