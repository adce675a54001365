"""Expert parallelism: routed rows travel to the device that owns their expert and back.

The expert dim of the weights rests split over the expert group (G devices, E_l = E / G
experts each; expert e lives on group member e // E_l). Inside the block's shard_map a
device has routed its own tokens and sorted their rows by expert, so the rows for each
owner are one contiguous run. The exchange is dropless with static, bounded buffers:

- each round, a device sends at most B rows to every owner (one `all_to_all` of a
  (G, B, M) buffer over the group), the owner runs its experts on what it received
  one slot (one sender's B rows) at a time, and the results come back by a second
  `all_to_all`. A slot arrives sorted by local expert with its empty rows last, so the
  grouped matmul reads it in place (no sort copy), and the hidden-sized buffers hold B
  rows, not G x B;
- the number of rounds is ceil(max rows any device sends any owner / B), agreed by
  one scalar `pmax`; under balanced routing B (buffer_factor x the even share, rounded
  to 8 rows) holds everything in one round, and skewed routing (every token to one
  expert) takes more rounds instead of dropping rows or sizing buffers for the worst
  case (G x the local rows, which would give back everything cp saved).

The rounds are a while loop, which reverse-mode autodiff cannot cross, so the exchange
has a custom VJP: the backward pass runs the same rounds, sending each row's input and
output cotangent to its owner, which recomputes its part of the forward, returns the
input cotangent and accumulates its weight gradient locally, slot by slot. Expert
weights and their gradients never leave their owner.

Backends: `all_to_all` (runs everywhere, XLA:CPU included) packs each owner's rows
into its slot of the (G, B, M) buffer; `ragged_all_to_all` (GPU/TPU; XLA:CPU cannot run
it) sends each owner exactly its rows straight from the sorted array into the same slot
layout, skipping the padding bytes.

Legend: R routed rows on this device, G group size, B rows per owner per round,
E global experts, L local experts (E / G), M embedding, H hidden (per hidden shard).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax import lax

from selector.problem import exchange_buffer_rows

from .ffn import swiglu
from .grouped_matmul import (
    _gmm_tiled,
    _gmm_tiled_transposed_sum,
    _tgmm_tiled,
    gmm,
    gmm_multi,
)
from .vma import reduce_like, varying_like


@dataclass(frozen=True)
class ExchangeGroup:
    """The static description of one expert-parallel exchange."""

    group_axes: tuple[str, ...]  # mesh axes of the expert group (major first)
    group_size: int
    count_axes: tuple[str, ...]  # token axes: every device agrees on the round count
    buffer_factor: float  # B = buffer_factor x even share of rows per owner
    backend: str  # "all_to_all" or "ragged_all_to_all"
    gmm_backend: str
    dtype: object  # compute dtype
    platform: str = "cpu"  # of the mesh's devices: where the grouped matmul will run

    def buffer_rows(self, rows: int) -> int:
        """B: rows each device may send each owner per round (the selector's formula,
        which prices these buffers)."""
        return exchange_buffer_rows(rows, self.group_size, self.buffer_factor)


def _slot_group_sizes(ids_B, local_experts: int):
    """Rows of each local expert in a slot (empty rows, id == local_experts, not counted)."""
    return jnp.zeros((local_experts + 1,), jnp.int32).at[ids_B].add(1)[:local_experts]


def _slot_swiglu(x_BM, ids_B, w, scale_B, local_experts: int, gmm_backend: str, platform: str):
    """One slot's rows through their experts' SwiGLU, each row's activation scaled by
    its routing weight `scale_B` before `wo`. A slot arrives sorted by local expert with
    its empty rows (id == local_experts) last, so the grouped matmul reads it in place:
    no sort, no unsort, and the empty rows come out 0."""
    wi_0, wi_1, wo = w
    sizes_L = _slot_group_sizes(ids_B, local_experts)
    gate, up = gmm_multi(x_BM, (wi_0, wi_1), sizes_L, gmm_backend, platform=platform)
    act = swiglu(gate, up) * scale_B[:, None].astype(gate.dtype)
    return gmm(act, wo, sizes_L, gmm_backend, platform=platform)


def _slot_swiglu_pullback(
    x_BM, ids_B, scale_B, dy_BM, w, dw, local_experts: int, gmm_backend: str, platform: str
):
    """(dx_BM, dscale_B, dw + this slot's weight gradient): the pullback of
    `_slot_swiglu`, with the weight gradient added to the float32 accumulators `dw`. For
    `tiled_gmm` it is written out so the weight-gradient kernel adds into `dw` in place
    (no per-slot gradient buffer and no float32 copy of it); other backends go through
    jax.vjp."""
    if gmm_backend != "tiled_gmm":

        def local(x, w_, s):
            return _slot_swiglu(x, ids_B, w_, s, local_experts, gmm_backend, platform)

        _, pullback = jax.vjp(local, x_BM, w, scale_B)
        dx_BM, dw_slot, dscale_B = pullback(dy_BM)
        dw = tuple(a + b.astype(jnp.float32) for a, b in zip(dw, dw_slot, strict=True))
        return dx_BM, dscale_B, dw
    wi_0, wi_1, wo = w
    sizes_L = _slot_group_sizes(ids_B, local_experts)
    gate, up = _gmm_tiled(x_BM, (wi_0, wi_1), sizes_L)
    unscaled, act_pullback = jax.vjp(swiglu, gate, up)
    scale = scale_B[:, None].astype(unscaled.dtype)
    dwo = _tgmm_tiled(unscaled * scale, dy_BM, sizes_L, into_EKN=dw[2])
    d_act = _gmm_tiled_transposed_sum((dy_BM,), (wo,), sizes_L)
    dscale_B = jnp.sum(d_act.astype(jnp.float32) * unscaled, axis=1).astype(scale_B.dtype)
    d_gate, d_up = act_pullback(d_act * scale)
    dx_BM = _gmm_tiled_transposed_sum((d_gate, d_up), (wi_0, wi_1), sizes_L)
    dwi_0 = _tgmm_tiled(x_BM, d_gate, sizes_L, into_EKN=dw[0])
    dwi_1 = _tgmm_tiled(x_BM, d_up, sizes_L, into_EKN=dw[1])
    return dx_BM, dscale_B, (dwi_0, dwi_1, dwo)


def _routing(group_sizes_E, ex: ExchangeGroup, local_experts: int):
    """Per owner: the first sorted row for it and how many rows go to it (int32, (G,))."""
    per_owner = group_sizes_E.reshape(ex.group_size, local_experts).sum(axis=1)
    starts = jnp.cumsum(per_owner) - per_owner
    return starts.astype(jnp.int32), per_owner.astype(jnp.int32)


def _rounds(counts_G, buffer_rows: int, ex: ExchangeGroup):
    """Rounds every device runs: the largest send of any device, in buffers of B."""
    most = lax.pmax(jnp.max(counts_G), ex.count_axes)
    return (most + buffer_rows - 1) // buffer_rows


def rounds_needed(group_sizes_E, ex: ExchangeGroup, local_experts: int, buffer_rows: int):
    """The global number of exchange rounds for this step's routing (int32 scalar)."""
    _, counts_G = _routing(group_sizes_E, ex, local_experts)
    return _rounds(counts_G, buffer_rows, ex)


def _send(rows_RX, starts_G, counts_G, r, buffer_rows: int):
    """(G, B, X): round r's rows for each owner, zero past the owner's count, and the
    (G, B) mask of real rows."""
    j = jnp.arange(buffer_rows)
    offset_GB = r * buffer_rows + j[None, :]
    valid_GB = offset_GB < counts_G[:, None]
    index_GB = jnp.where(valid_GB, starts_G[:, None] + offset_GB, 0)
    packed = jnp.take(rows_RX, index_GB.reshape(-1), axis=0).reshape(*index_GB.shape, -1)
    return jnp.where(valid_GB[..., None], packed, 0), valid_GB, index_GB


def _receive_back(out_RX, back_GBX, valid_GB, index_GB):
    """Write round results (G, B, X) back to their rows of the sorted array."""
    rows = out_RX.shape[0]
    where = jnp.where(valid_GB, index_GB, rows).reshape(-1)  # `rows` is out of bounds: dropped
    return out_RX.at[where].set(back_GBX.reshape(-1, back_GBX.shape[-1]), mode="drop")


def _exchange(x_GBX, ex: ExchangeGroup):
    """Send slot g of the buffer to group member g; receive member g's slot for us."""
    return lax.all_to_all(x_GBX, ex.group_axes, 0, 0, tiled=True)


def _slot_sizes(counts_G, r, buffer_rows: int):
    """Rows of round r in each owner's slot: the count left, at most B."""
    return jnp.clip(counts_G - r * buffer_rows, 0, buffer_rows).astype(jnp.int32)


class _Packed:
    """all_to_all transport: each owner's rows are packed into its (B, X) slot."""

    def __init__(self, starts_G, counts_G, ex: ExchangeGroup, buffer_rows: int):
        self.starts, self.counts, self.ex, self.b = starts_G, counts_G, ex, buffer_rows

    def to_owners(self, rows_RX, ids_R, r, local_experts):
        """(rows received (G, B, X): slot g from member g, sorted by local expert; their
        local expert ids (G, B), local_experts on empty rows; state for the trip back)."""
        packed, valid, index = _send(rows_RX, self.starts, self.counts, r, self.b)
        ids, _, _ = _send(ids_R[:, None], self.starts, self.counts, r, self.b)
        ids = jnp.where(valid, ids[..., 0] % local_experts, local_experts)
        got, got_ids = _exchange(packed, self.ex), _exchange(ids, self.ex)
        return got, got_ids, (valid, index)

    def rows(self, rows_RX, r):
        """(G, B, X): round r's rows of another per-row array, where to_owners puts x."""
        packed, _, _ = _send(rows_RX, self.starts, self.counts, r, self.b)
        return _exchange(packed, self.ex)

    def back(self, out_RX, results_GBX, r, state):
        valid, index = state
        return _receive_back(out_RX, _exchange(results_GBX, self.ex), valid, index)


class _Ragged:
    """ragged_all_to_all transport (GPU/TPU): each owner gets exactly its rows, written
    into this device's slot of its (G*B, X) buffer; results return straight into the
    sorted array. Needs the sources' counts and starts, exchanged once. Slot g of the
    receive buffer holds member g's rows first, sorted by local expert, then zeros."""

    def __init__(self, starts_G, counts_G, ex: ExchangeGroup, buffer_rows: int):
        self.starts, self.counts, self.ex, self.b = starts_G, counts_G, ex, buffer_rows
        # What each source sends this device, and where its rows start over there.
        self.recv_counts = _exchange(counts_G, ex)
        self.recv_starts = _exchange(starts_G, ex)
        me = lax.axis_index(ex.group_axes)
        self.my_slot = jnp.full((ex.group_size,), me * buffer_rows, jnp.int32)
        self.slots = jnp.arange(ex.group_size, dtype=jnp.int32) * buffer_rows

    def _send(self, operand, output, r, to_owners: bool):
        if to_owners:
            offsets, sizes = self.starts + r * self.b, _slot_sizes(self.counts, r, self.b)
            where, recv = self.my_slot, _slot_sizes(self.recv_counts, r, self.b)
        else:
            offsets, sizes = self.slots, _slot_sizes(self.recv_counts, r, self.b)
            where, recv = self.recv_starts + r * self.b, _slot_sizes(self.counts, r, self.b)
        return lax.ragged_all_to_all(
            operand, output, offsets, sizes, where, recv, axis_name=self.ex.group_axes
        )

    def to_owners(self, rows_RX, ids_R, r, local_experts):
        n = self.ex.group_size * self.b
        empty = varying_like(jnp.full((n, 1), -1, jnp.int32), ids_R)
        got_ids = self._send(ids_R[:, None].astype(jnp.int32), empty, r, to_owners=True)[:, 0]
        got_ids = jnp.where(got_ids < 0, local_experts, got_ids % local_experts)
        slots = (self.ex.group_size, self.b)
        return self.rows(rows_RX, r), got_ids.reshape(slots), None

    def rows(self, rows_RX, r):
        """(G, B, X): round r's rows of a per-row array, slot g from member g."""
        n = self.ex.group_size * self.b
        out = varying_like(jnp.zeros((n, rows_RX.shape[1]), rows_RX.dtype), rows_RX)
        got = self._send(rows_RX, out, r, to_owners=True)
        return got.reshape(self.ex.group_size, self.b, -1)

    def back(self, out_RX, results_GBX, r, state):
        results_NX = results_GBX.reshape(-1, results_GBX.shape[-1]).astype(out_RX.dtype)
        return self._send(results_NX, out_RX, r, to_owners=False)


TRANSPORTS = {"all_to_all": _Packed, "ragged_all_to_all": _Ragged}


def _transport(group_sizes_E, ex: ExchangeGroup, local_experts: int, buffer_rows: int):
    starts_G, counts_G = _routing(group_sizes_E, ex, local_experts)
    rounds = _rounds(counts_G, buffer_rows, ex)
    return TRANSPORTS[ex.backend](starts_G, counts_G, ex, buffer_rows), rounds


def _forward_rounds(x_RM, ids_R, group_sizes_E, w, scale_R, ex: ExchangeGroup, buffer_rows: int):
    local_experts = w[0].shape[0]
    move, rounds = _transport(group_sizes_E, ex, local_experts, buffer_rows)
    emb = w[2].shape[2]
    y0 = varying_like(jnp.zeros((x_RM.shape[0], emb), ex.dtype), x_RM, *w)

    def slot(x_ids_scale):
        x_BM, ids_B, scale_B = x_ids_scale
        return _slot_swiglu(x_BM, ids_B, w, scale_B, local_experts, ex.gmm_backend, ex.platform)

    def one_round(r, y_RM):
        x_GBM, ids_GB, state = move.to_owners(x_RM, ids_R, r, local_experts)
        scale_GB = move.rows(scale_R[:, None], r)[..., 0]
        # One slot at a time, so the hidden-sized buffers are B rows, not G x B.
        return move.back(y_RM, lax.map(slot, (x_GBM, ids_GB, scale_GB)), r, state)

    return lax.fori_loop(0, rounds, one_round, y0)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def exchange_swiglu(x_RM, ids_R, group_sizes_E, w, scale_R, ex: ExchangeGroup, buffer_rows: int):
    """SwiGLU of each routed row with its expert, on the device that owns the expert,
    the activation scaled by the row's routing weight before `wo`.

    x_RM: this device's routed rows sorted by global expert id (ids_R, group_sizes_E the
    rows per global expert); w = (wi_0, wi_1, wo) of this device's L experts; scale_R
    each row's routing weight. Returns y_RM (already weighted) in the same row order.
    """
    return _forward_rounds(x_RM, ids_R, group_sizes_E, w, scale_R, ex, buffer_rows)


def _fwd(x_RM, ids_R, group_sizes_E, w, scale_R, ex, buffer_rows):
    y = _forward_rounds(x_RM, ids_R, group_sizes_E, w, scale_R, ex, buffer_rows)
    return y, (x_RM, ids_R, group_sizes_E, w, scale_R)


def _bwd(ex: ExchangeGroup, buffer_rows: int, res, dy_RM):
    x_RM, ids_R, group_sizes_E, w, scale_R = res
    local_experts = w[0].shape[0]
    move, rounds = _transport(group_sizes_E, ex, local_experts, buffer_rows)
    # Rows and weights are made to vary over each other's mesh axes before the slots'
    # pullbacks, so no slot sums anything over the mesh: dx (summed over the axes only
    # the weights split, tensor) and dw (summed over the axes only the rows split) are
    # summed once, at the end, instead of once per slot.
    w_v = tuple(varying_like(a, x_RM) for a in w)
    dx0 = varying_like(jnp.zeros_like(x_RM), *w)
    dscale0 = varying_like(jnp.zeros((x_RM.shape[0], 1), scale_R.dtype), *w, x_RM)
    dw0 = tuple(varying_like(jnp.zeros(a.shape, jnp.float32), a) for a in w_v)
    dy_RM = varying_like(dy_RM.astype(x_RM.dtype), *w)

    def one_round(r, carry):
        dx_RM, dscale_R1, dw = carry
        # Rows and their cotangents travel as two exchanges of the same slots (a
        # concatenation would hold another copy of both).
        x_GBM, ids_GB, state = move.to_owners(x_RM, ids_R, r, local_experts)
        dy_GBM, _, _ = move.to_owners(dy_RM, ids_R, r, local_experts)
        scale_GB = varying_like(move.rows(scale_R[:, None], r)[..., 0], *w)
        x_GBM = varying_like(x_GBM, *w)

        def one_slot(g, slot_carry):
            # Each slot's input gradient replaces its rows in x_GBM (they are read only
            # by this slot), so no third receive-sized buffer is held.
            dx_GBM, dscale_GB, dw = slot_carry
            dx_BM, dscale_B, dw = _slot_swiglu_pullback(
                dx_GBM[g],
                ids_GB[g],
                scale_GB[g],
                dy_GBM[g],
                w_v,
                dw,
                local_experts,
                ex.gmm_backend,
                ex.platform,
            )
            dx_GBM = lax.dynamic_update_index_in_dim(dx_GBM, dx_BM.astype(dx_GBM.dtype), g, 0)
            dscale_GB = lax.dynamic_update_index_in_dim(dscale_GB, dscale_B, g, 0)
            return dx_GBM, dscale_GB, dw

        dx_GBM, dscale_GB, dw = lax.fori_loop(
            0, ex.group_size, one_slot, (x_GBM, jnp.zeros_like(scale_GB), dw)
        )
        dx_RM = move.back(dx_RM, dx_GBM, r, state)
        return dx_RM, move.back(dscale_R1, dscale_GB[..., None], r, state), dw

    dx_RM, dscale_R1, dw = lax.fori_loop(0, rounds, one_round, (dx0, dscale0, dw0))
    dw = tuple(reduce_like(g.astype(a.dtype), a) for g, a in zip(dw, w, strict=True))
    dscale_R = reduce_like(dscale_R1[:, 0], scale_R)
    return reduce_like(dx_RM, x_RM), None, None, dw, dscale_R


exchange_swiglu.defvjp(_fwd, _bwd)
