"""Subgroup capacity dispatch: each device's tokens are its own subgroups.

The input arrives sharded (batch axes, sequence axes), so a device holds B_local
sequences of sub_seq = S / cp tokens, and each of those is one subgroup: the
(batch, cp, sub_seq) layout MaxText's code reshapes into for inference, here split by
every sequence axis and in training too (MaxText 0.2.5 splits only in inference, only by
context_autoregressive; in training its capacity covers the whole sequence). Routing,
capacity positions and drops are computed inside each subgroup, with the capacity of
`capacity_rounding` (ours: ceil(sub_seq k / E x cf); maxtext: MaxText's formula), so the
drops equal MaxText's at cp = 1 with capacity_rounding=maxtext. Dispatch and combine are
one-hot einsums. Priority within a subgroup follows token order, then choice rank
(MaxText 0.2.5's order, measured on CPU against its RoutedMoE).

Legend: B batch, S sub-sequence, K top-k, E experts, C capacity, M embedding, H hidden.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .ffn import ExpertWeights, einsum, expert_swiglu
from .router import partial_stats, route
from .spec import MoESpec


def capacity_masks(ids_BSK, weights_BSK, num_experts: int, cap: int):
    """(dispatch_BSEC, combine_BSEC, dropped assignments) for one device's subgroups."""
    batch, seq, top_k = ids_BSK.shape
    onehot_BRE = jax.nn.one_hot(ids_BSK.reshape(batch, seq * top_k), num_experts, dtype=jnp.int32)
    # Position of each assignment in its expert's queue: token-major, then rank.
    position_BR = jnp.sum((jnp.cumsum(onehot_BRE, axis=1) - 1) * onehot_BRE, axis=-1)
    keep_BR = position_BR < cap
    slot_BR = jnp.where(keep_BR, ids_BSK.reshape(batch, -1) * cap + position_BR, -1)
    slot_BSK = slot_BR.reshape(batch, seq, top_k)
    dispatch = jnp.zeros((batch, seq, num_experts * cap), jnp.float32)
    combine = jnp.zeros((batch, seq, num_experts * cap), jnp.float32)
    for rank in range(top_k):  # k one-hots of (B, S, E*C), never a (B, S, K, E, C) buffer
        hot = jax.nn.one_hot(slot_BSK[..., rank], num_experts * cap, dtype=jnp.float32)
        dispatch = dispatch + hot
        combine = combine + hot * weights_BSK[..., rank, None]
    shape = (batch, seq, num_experts, cap)
    dropped = jnp.sum(~keep_BR)
    return dispatch.reshape(shape), combine.reshape(shape), dropped


def local_forward(x_BSM, w: ExpertWeights, spec: MoESpec):
    batch, seq, emb = x_BSM.shape
    cap = spec.capacity(seq)
    with jax.named_scope("route"):
        weights_TK, ids_TK, probs_TE = route(x_BSM.reshape(-1, emb), w, spec)
        dispatch_BSEC, combine_BSEC, dropped = capacity_masks(
            ids_TK.reshape(batch, seq, -1),
            weights_TK.reshape(batch, seq, -1),
            spec.num_experts,
            cap,
        )
    dt = spec.compute_dtype
    with jax.named_scope("dispatch"):
        # The one-hot einsum multiplies every token by 0 or 1, and 0 * NaN is NaN: zero
        # non-finite tokens here so they cannot poison their subgroup, and give them a
        # NaN output below (the same per-token behaviour as the other strategies).
        bad_BS1 = ~jnp.all(jnp.isfinite(x_BSM), axis=-1, keepdims=True)
        x_clean = jnp.where(bad_BS1, 0, x_BSM).astype(dt)
        x_BECM = einsum("bsm,bsec->becm", x_clean, dispatch_BSEC.astype(dt), platform=spec.platform)
    with jax.named_scope("expert_compute"):
        y_BECM = expert_swiglu(x_BECM, w, dt, x_dims="bec", h_dims="bec", platform=spec.platform)
    with jax.named_scope("combine"):
        y_BSM = einsum("becm,bsec->bsm", y_BECM, combine_BSEC.astype(dt), platform=spec.platform)
        y_BSM = jnp.where(bad_BS1, jnp.nan, y_BSM)
    return y_BSM.astype(x_BSM.dtype), partial_stats(probs_TE, ids_TK, dropped)
