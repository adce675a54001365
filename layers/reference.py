"""A plain MoE on unsharded arrays, written for clarity rather than speed: a Python loop
over experts. Every strategy is tested against it, forward and gradients.

Legend: B batch, S sequence, T tokens, K top-k, M embedding, E experts.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from .ffn import ExpertWeights, dense_ffn
from .spec import MoESpec


def reference_route(w: ExpertWeights, x_BSM, spec: MoESpec):
    x_TM = x_BSM.reshape(-1, x_BSM.shape[-1]).astype(jnp.float32)
    probs_TE = jax.nn.softmax(x_TM @ w.gate_ME.astype(jnp.float32), axis=-1)
    weights_TK, ids_TK = jax.lax.top_k(probs_TE, spec.top_k)
    if spec.norm_topk_prob:
        weights_TK = weights_TK / weights_TK.sum(-1, keepdims=True)
    return weights_TK, ids_TK, probs_TE


def reference_keep(w: ExpertWeights, x_BSM, spec: MoESpec, cp: int) -> np.ndarray:
    """keep_TK: which assignments survive per-subgroup capacity (all, when dropless).

    Each sequence is cut into cp contiguous subgroups; inside one, assignments queue per
    expert in token order then choice rank, and those past the capacity are dropped.
    """
    batch, seq, _ = x_BSM.shape
    _, ids_TK, _ = reference_route(w, x_BSM, spec)
    ids = np.asarray(ids_TK).reshape(batch, seq, spec.top_k)
    keep = np.ones_like(ids, dtype=bool)
    if spec.capacity_factor <= 0:
        return keep.reshape(-1, spec.top_k)
    sub = seq // cp
    cap = math.ceil(sub * spec.top_k / spec.num_experts * spec.capacity_factor)
    for b in range(batch):
        for g in range(cp):
            used = np.zeros(spec.num_experts, dtype=int)
            for s in range(g * sub, (g + 1) * sub):
                for r in range(spec.top_k):
                    e = ids[b, s, r]
                    keep[b, s, r] = used[e] < cap
                    used[e] += 1
    return keep.reshape(-1, spec.top_k)


def reference_moe(w: ExpertWeights, x_BSM, spec: MoESpec, keep_TK=None):
    """(y_BSM, stats) of a plain top-k MoE; `keep_TK` from `reference_keep`."""
    batch, seq, emb = x_BSM.shape
    x_TM = x_BSM.reshape(-1, emb)
    weights_TK, ids_TK, probs_TE = reference_route(w, x_BSM, spec)
    keep_TK = np.ones(ids_TK.shape, bool) if keep_TK is None else keep_TK
    y_TM = jnp.zeros_like(x_TM)
    for e in range(spec.num_experts):
        gate_T = jnp.sum(jnp.where((ids_TK == e) & keep_TK, weights_TK, 0.0), axis=-1)
        y_TM = y_TM + gate_T[:, None] * dense_ffn(x_TM, w.wi_0_EMH[e], w.wi_1_EMH[e], w.wo_EHM[e])
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
