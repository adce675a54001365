"""Expert parallelism: routed rows travel to the device that owns their expert and back.

The expert dim of the weights rests split over the expert group (G devices, E_l = E / G
experts each; expert e lives on group member e // E_l). Inside the block's shard_map a
device has routed its own tokens and listed their rows sorted by expert (a row is a
token index, not a copy of the token), so the rows for each owner are one contiguous
run of that list. The exchange is dropless with static, bounded buffers:

- each round, a device packs at most B rows for every owner straight from its tokens
  into a (G, B, M) buffer, sends slot g to member g (one all-to-all over the group),
  the owner runs its experts on what it received one slot (one sender's B rows) at a
  time, writing each slot's result over its rows, and the results come back by a
  second all-to-all and are added straight into the tokens. A slot arrives sorted by
  local expert with its empty rows last, so the grouped matmul reads it in place (no
  sort copy). No (rows x emb) array is ever held: only the round buffers, and the
  hidden-sized buffers hold B rows, not G x B;
- the number of rounds is ceil(max rows any device sends any owner / B), agreed by
  one `pmax` (counted once a step: the backward reuses the forward's count).
  Round buffers are what the exchange holds, so B is a fraction of the even share
  (`expert_buffer_factor`, default 0.5625: two rounds under balanced routing), and
  skewed routing (every token to one expert) takes more rounds instead of dropping rows
  or sizing buffers for the worst case (G x the local rows, which would give back
  everything cp saved).

The rounds are a while loop, which reverse-mode autodiff cannot cross, so the exchange
has a custom VJP: the backward pass runs the same rounds, packing each row's input and
output cotangent from the tokens and their cotangents, sending them to the owner, which
recomputes its part of the forward, returns the input cotangent (added into the
tokens' cotangent) and accumulates its weight gradient locally, slot by slot. Expert
weights and their gradients never leave their owner.

Backends: `all_to_all` (runs everywhere, XLA:CPU included) sends each (B, X) slot
whole; `ragged_all_to_all` (GPU/TPU; XLA:CPU cannot run it) sends only each slot's real
rows into the same slot layout at the other end, skipping the padding bytes.

Legend: R routed rows on this device, G group size, B rows per owner per round,
E global experts, L local experts (E / G), M embedding, H hidden (per hidden shard).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax import lax

from selector.plan_sizes import exchange_buffer_rows

from .ffn import swiglu
from .grouped_matmul import (
    gmm,
    gmm_multi,
    tiled_forward,
    tiled_input_grad,
    tiled_weight_grad,
)
from .pallas_gmm import ROW_TILE as PALLAS_ROW_TILE
from .pallas_gmm import pallas_gmm, pallas_input_grad, pallas_weight_grad_into
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
    row_tile: int | None = None  # the grouped matmul's rows a tile (the plan's GmmTiling.tm)

    def buffer_rows(self, rows: int) -> int:
        """B: rows each device may send each owner per round (the selector's formula,
        which prices these buffers)."""
        return exchange_buffer_rows(rows, self.group_size, self.buffer_factor)


def _slot_group_sizes(ids_B, local_experts: int):
    """Rows of each local expert in a slot (empty rows, id == local_experts, not counted)."""
    return jnp.zeros((local_experts + 1,), jnp.int32).at[ids_B].add(1)[:local_experts]


def _slot_swiglu(
    x_BM, ids_B, w, scale_B, local_experts: int, gmm_backend: str, platform: str, row_tile=None
):
    """One slot's rows through their experts' SwiGLU, each row's activation scaled by
    its routing weight `scale_B` before `wo`. A slot arrives sorted by local expert with
    its empty rows (id == local_experts) last, so the grouped matmul reads it in place:
    no sort, no unsort, and the empty rows come out 0."""
    wi_0, wi_1, wo = w
    sizes_L = _slot_group_sizes(ids_B, local_experts)
    kernel = dict(platform=platform, row_tile=row_tile)
    gate, up = gmm_multi(x_BM, (wi_0, wi_1), sizes_L, gmm_backend, **kernel)
    act = swiglu(gate, up) * scale_B[:, None].astype(gate.dtype)
    return gmm(act, wo, sizes_L, gmm_backend, **kernel)


def _slot_kernels(gmm_backend: str, platform: str, row_tile):
    """(forward, input_grad, weight_grad_into) of a backend whose pieces are public, for
    a pullback written out; None for the others (ragged_dot goes through jax.vjp).

    forward(x, ws, sizes) -> (x @ w[e] for w in ws); input_grad(dys, ws, sizes) ->
    sum_i dy_i @ w_i[e]^T; weight_grad_into(x, dy, sizes, acc) -> acc + x^T dy per
    expert, added by the kernel into the float32 accumulator in place."""
    if gmm_backend == "tiled_gmm":
        return (
            tiled_forward,
            tiled_input_grad,
            lambda x, dy, sizes, acc: tiled_weight_grad(x, dy, sizes, existing_out=acc),
        )
    if gmm_backend != "pallas_megablox":
        return None
    kernel = dict(interpret=platform != "tpu", row_tile=row_tile or PALLAS_ROW_TILE)

    def forward(x, ws, sizes):
        return tuple(pallas_gmm(x, w, sizes, **kernel) for w in ws)

    def input_grad(dys, ws, sizes):
        total = pallas_input_grad(dys[0], ws[0], sizes, **kernel)
        for dy, w in zip(dys[1:], ws[1:], strict=True):
            total = total + pallas_input_grad(dy, w, sizes, **kernel)
        return total

    def weight_grad_into(x, dy, sizes, acc):
        return pallas_weight_grad_into(x, dy, sizes, acc, **kernel)

    return forward, input_grad, weight_grad_into


def _slot_swiglu_pullback(
    x_BM,
    ids_B,
    scale_B,
    dy_BM,
    w,
    dw,
    local_experts: int,
    gmm_backend: str,
    platform: str,
    row_tile=None,
):
    """(dx_BM, dscale_B, dw + this slot's weight gradient): the pullback of
    `_slot_swiglu`, with the weight gradient added to the float32 accumulators `dw`. For
    `tiled_gmm` and `pallas_megablox` it is written out so the weight-gradient kernel
    adds into `dw` in place: no per-slot (L, K, N) gradient buffer, no float32 add that
    reads and writes every local expert's accumulator again, and no forward `wo` product
    (only its input is needed). tiled_gmm visits only the experts with rows in the slot;
    JAX's tgmm visits every expert once. Other backends go through jax.vjp."""
    kernels = _slot_kernels(gmm_backend, platform, row_tile)
    if kernels is None:

        def local(x, w_, s):
            return _slot_swiglu(x, ids_B, w_, s, local_experts, gmm_backend, platform, row_tile)

        _, pullback = jax.vjp(local, x_BM, w, scale_B)
        dx_BM, dw_slot, dscale_B = pullback(dy_BM)
        dw = tuple(a + b.astype(jnp.float32) for a, b in zip(dw, dw_slot, strict=True))
        return dx_BM, dscale_B, dw
    forward, input_grad, weight_grad_into = kernels
    wi_0, wi_1, wo = w
    sizes_L = _slot_group_sizes(ids_B, local_experts)
    gate, up = forward(x_BM, (wi_0, wi_1), sizes_L)
    unscaled, act_pullback = jax.vjp(swiglu, gate, up)
    scale = scale_B[:, None].astype(unscaled.dtype)
    dwo = weight_grad_into(unscaled * scale, dy_BM, sizes_L, dw[2])
    d_act = input_grad((dy_BM,), (wo,), sizes_L)
    dscale_B = jnp.sum(d_act.astype(jnp.float32) * unscaled, axis=1).astype(scale_B.dtype)
    d_gate, d_up = act_pullback(d_act * scale)
    dx_BM = input_grad((d_gate, d_up), (wi_0, wi_1), sizes_L)
    dwi_0 = weight_grad_into(x_BM, d_gate, sizes_L, dw[0])
    dwi_1 = weight_grad_into(x_BM, d_up, sizes_L, dw[1])
    return dx_BM, dscale_B, (dwi_0, dwi_1, dwo)


def _routing(group_sizes_E, ex: ExchangeGroup, local_experts: int):
    """Per owner: the first sorted row for it and how many rows go to it (int32, (G,))."""
    per_owner = group_sizes_E.reshape(ex.group_size, local_experts).sum(axis=1)
    starts = jnp.cumsum(per_owner) - per_owner
    return starts.astype(jnp.int32), per_owner.astype(jnp.int32)


# The round count is agreed as a pmax over this many copies of it, not over a scalar:
# XLA:GPU in jax 0.12.0.1 aborts compiling a pmax of up to 128 int32 over two mesh axes
# of 64 GPUs (an LLVM fatal error in its Triton all-reduce kernel) and compiles 256
# (`python -m bench.gpu_small_allreduce`). 1 KiB where 4 bytes would do, once a step.
ROUND_COUNT_LANES = 256


def rounds_needed(counts_G, buffer_rows: int, ex: ExchangeGroup):
    """The global number of exchange rounds: the largest send of any device, in
    buffers of B (every device agrees through one pmax, ROUND_COUNT_LANES wide)."""
    lanes = jnp.full((ROUND_COUNT_LANES,), jnp.max(counts_G))
    most = lax.pmax(lanes, ex.count_axes)[0]
    return (most + buffer_rows - 1) // buffer_rows


def _slot_sizes(counts_G, r, buffer_rows: int):
    """Rows of round r in each owner's slot: the count left, at most B."""
    return jnp.clip(counts_G - r * buffer_rows, 0, buffer_rows).astype(jnp.int32)


@dataclass(frozen=True)
class _Round:
    """Which rows travel in round r: for each (owner g, slot row j), the sorted row
    `row_GB`, its token `token_GB`, and whether it is real (`valid_GB`)."""

    row_GB: jax.Array
    token_GB: jax.Array
    valid_GB: jax.Array

    @classmethod
    def of(cls, r, starts_G, counts_G, token_R, buffer_rows: int):
        offset_GB = r * buffer_rows + jnp.arange(buffer_rows)[None, :]
        valid_GB = offset_GB < counts_G[:, None]
        row_GB = jnp.where(valid_GB, starts_G[:, None] + offset_GB, 0)
        return cls(row_GB, jnp.take(token_R, row_GB), valid_GB)

    def pack_tokens(self, source_TX):
        """(G, B, X): each slot row's token's row of `source_TX` (zero on empty rows)."""
        packed = jnp.take(source_TX, self.token_GB, axis=0)
        return jnp.where(self.valid_GB[..., None], packed, jnp.zeros((), source_TX.dtype))

    def pack_rows(self, per_row_R, fill):
        """(G, B): a per-row value of each slot row (`fill` on empty rows)."""
        return jnp.where(self.valid_GB, jnp.take(per_row_R, self.row_GB), fill)

    def add_to_tokens(self, out_TX, back_GBX):
        """Each real slot row's result added to its token's row of `out_TX`."""
        tokens = out_TX.shape[0]
        where = jnp.where(self.valid_GB, self.token_GB, tokens).reshape(-1)  # out of bounds
        values = back_GBX.reshape(-1, back_GBX.shape[-1]).astype(out_TX.dtype)
        return out_TX.at[where].add(values, mode="drop")

    def set_rows(self, out_R, back_GB):
        """Each real slot row's value written to its sorted row of `out_R`."""
        where = jnp.where(self.valid_GB, self.row_GB, out_R.shape[0]).reshape(-1)
        return out_R.at[where].set(back_GB.reshape(-1).astype(out_R.dtype), mode="drop")


class _Packed:
    """all_to_all transport: slot g of the (G, B, X) buffer goes to member g whole."""

    def __init__(self, counts_G, ex: ExchangeGroup, buffer_rows: int):
        self.ex = ex

    def to_owners(self, packed_GBX, r, fill):
        """Slot g of `packed_GBX` to member g; returns member g's slot for us in slot g."""
        return lax.all_to_all(packed_GBX, self.ex.group_axes, 0, 0, tiled=True)

    def back(self, results_GBX, r):
        return lax.all_to_all(results_GBX, self.ex.group_axes, 0, 0, tiled=True)


class _Ragged:
    """ragged_all_to_all transport (GPU/TPU): only the real rows of each slot cross the
    link, into the same slot layout at the other end (the rest is `fill`). Needs what
    each source sends this device, exchanged once."""

    def __init__(self, counts_G, ex: ExchangeGroup, buffer_rows: int):
        self.counts, self.ex, self.b = counts_G, ex, buffer_rows
        self.recv_counts = lax.all_to_all(counts_G, ex.group_axes, 0, 0, tiled=True)
        me = lax.axis_index(ex.group_axes)
        self.my_slot = jnp.full((ex.group_size,), me * buffer_rows, jnp.int32)
        self.slots = jnp.arange(ex.group_size, dtype=jnp.int32) * buffer_rows

    def _send(self, operand_GBX, sent_G, received_G, fill):
        shape = operand_GBX.shape
        operand = operand_GBX.reshape(-1, *shape[2:])
        output = varying_like(jnp.full(operand.shape, fill, operand.dtype), operand)
        got = lax.ragged_all_to_all(
            operand,
            output,
            self.slots,  # slot g of this device's buffer goes to member g
            sent_G,
            self.my_slot,  # and lands in this device's slot of member g's buffer
            received_G,
            axis_name=self.ex.group_axes,
        )
        return got.reshape(shape)

    def to_owners(self, packed_GBX, r, fill):
        sent = _slot_sizes(self.counts, r, self.b)
        return self._send(packed_GBX, sent, _slot_sizes(self.recv_counts, r, self.b), fill)

    def back(self, results_GBX, r):
        sent = _slot_sizes(self.recv_counts, r, self.b)
        return self._send(results_GBX, sent, _slot_sizes(self.counts, r, self.b), 0)


TRANSPORTS = {"all_to_all": _Packed, "ragged_all_to_all": _Ragged}


@dataclass(frozen=True)
class _Plan:
    """This step's exchange: who sends what where, and how many rounds it takes."""

    starts_G: jax.Array
    counts_G: jax.Array
    rounds: jax.Array
    move: object  # a transport

    @classmethod
    def of(
        cls, group_sizes_E, ex: ExchangeGroup, local_experts: int, buffer_rows: int, rounds=None
    ):
        """`rounds`: the forward's count, passed to the backward (counted once a step)."""
        starts_G, counts_G = _routing(group_sizes_E, ex, local_experts)
        if rounds is None:
            rounds = rounds_needed(counts_G, buffer_rows, ex)
        move = TRANSPORTS[ex.backend](counts_G, ex, buffer_rows)
        return cls(starts_G, counts_G, rounds, move)

    def round(self, r, token_R, buffer_rows: int) -> _Round:
        return _Round.of(r, self.starts_G, self.counts_G, token_R, buffer_rows)


def _receive_round(plan: _Plan, rnd: _Round, r, x_TM, ids_R, scale_R, local_experts):
    """At the owners: round r's rows (G, B, M), their local expert ids (G, B; empty rows
    local_experts, so a slot reads sorted with its empty rows last) and routing weights."""
    x_GBM = plan.move.to_owners(rnd.pack_tokens(x_TM), r, 0)
    ids_GB = rnd.pack_rows(ids_R % local_experts, local_experts)
    # Per-row values travel as (G, B), not (G, B, 1): TPU tiles pad a minor dim of 1
    # to 128 lanes.
    ids_GB = plan.move.to_owners(ids_GB, r, local_experts)
    scale_GB = plan.move.to_owners(rnd.pack_rows(scale_R, 0), r, 0)
    return x_GBM, ids_GB, scale_GB


def _forward_rounds(x_TM, token_R, ids_R, group_sizes_E, w, scale_R, ex, buffer_rows):
    local_experts = w[0].shape[0]
    plan = _Plan.of(group_sizes_E, ex, local_experts, buffer_rows)
    y0 = varying_like(jnp.zeros((x_TM.shape[0], w[2].shape[2]), ex.dtype), x_TM, *w)

    def one_round(r, y_TM):
        rnd = plan.round(r, token_R, buffer_rows)
        x_GBM, ids_GB, scale_GB = _receive_round(plan, rnd, r, x_TM, ids_R, scale_R, local_experts)
        x_GBM = varying_like(x_GBM, *w)

        def one_slot(g, buffer_GBM):
            # One slot at a time, so the hidden-sized buffers are B rows, not G x B; each
            # slot's result replaces its rows (read by this slot only), so no second
            # receive-sized buffer is held.
            y_BM = _slot_swiglu(
                buffer_GBM[g],
                ids_GB[g],
                w,
                scale_GB[g],
                local_experts,
                ex.gmm_backend,
                ex.platform,
                ex.row_tile,
            )
            return lax.dynamic_update_index_in_dim(buffer_GBM, y_BM.astype(buffer_GBM.dtype), g, 0)

        y_GBM = lax.fori_loop(0, ex.group_size, one_slot, x_GBM)
        return rnd.add_to_tokens(y_TM, plan.move.back(y_GBM, r))

    return lax.fori_loop(0, plan.rounds, one_round, y0), plan.rounds


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7))
def exchange_swiglu(
    x_TM, token_R, ids_R, group_sizes_E, w, scale_R, ex: ExchangeGroup, buffer_rows: int
):
    """The routed rows' SwiGLU, each row on the device that owns its expert, summed back
    into the tokens: (y_TM, rounds).

    x_TM: this device's tokens in the compute dtype; rows are listed sorted by global
    expert id: token_R each row's token, ids_R its expert, group_sizes_E the rows per
    expert, scale_R its routing weight (applied to the activation before `wo`). w =
    (wi_0, wi_1, wo) of this device's L experts. Rows are packed for each round straight
    from the tokens and their results added straight back, so no (rows x emb) array is
    ever held, forward or backward: only the round buffers of G x B rows. `rounds` is
    the round count (int32), for the statistics.
    """
    return _forward_rounds(x_TM, token_R, ids_R, group_sizes_E, w, scale_R, ex, buffer_rows)


def _fwd(x_TM, token_R, ids_R, group_sizes_E, w, scale_R, ex, buffer_rows):
    y, rounds = _forward_rounds(x_TM, token_R, ids_R, group_sizes_E, w, scale_R, ex, buffer_rows)
    return (y, rounds), (x_TM, token_R, ids_R, group_sizes_E, w, scale_R, rounds)


def _bwd(ex: ExchangeGroup, buffer_rows: int, res, cotangents):
    x_TM, token_R, ids_R, group_sizes_E, w, scale_R, rounds = res
    dy_TM, _ = cotangents
    local_experts = w[0].shape[0]
    plan = _Plan.of(group_sizes_E, ex, local_experts, buffer_rows, rounds)
    # Rows and weights are made to vary over each other's mesh axes before the slots'
    # pullbacks, so no slot sums anything over the mesh: dx (summed over the axes only
    # the weights split, tensor) and dw (summed over the axes only the rows split) are
    # summed once, at the end, instead of once per slot.
    w_v = tuple(varying_like(a, x_TM) for a in w)
    dx0 = varying_like(jnp.zeros_like(x_TM), *w)
    dscale0 = varying_like(jnp.zeros(scale_R.shape, scale_R.dtype), *w, x_TM)
    dw0 = tuple(varying_like(jnp.zeros(a.shape, jnp.float32), a) for a in w_v)
    dy_TM = varying_like(dy_TM.astype(x_TM.dtype), *w)

    def one_round(r, carry):
        dx_TM, dscale_R, dw = carry
        rnd = plan.round(r, token_R, buffer_rows)
        # Rows and their cotangents travel as two exchanges of the same slots (a
        # concatenation would hold another copy of both).
        x_GBM, ids_GB, scale_GB = _receive_round(plan, rnd, r, x_TM, ids_R, scale_R, local_experts)
        dy_GBM = plan.move.to_owners(rnd.pack_tokens(dy_TM), r, 0)
        x_GBM, scale_GB = varying_like(x_GBM, *w), varying_like(scale_GB, *w)

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
                ex.row_tile,
            )
            dx_GBM = lax.dynamic_update_index_in_dim(dx_GBM, dx_BM.astype(dx_GBM.dtype), g, 0)
            dscale_GB = lax.dynamic_update_index_in_dim(dscale_GB, dscale_B, g, 0)
            return dx_GBM, dscale_GB, dw

        dx_GBM, dscale_GB, dw = lax.fori_loop(
            0, ex.group_size, one_slot, (x_GBM, jnp.zeros_like(scale_GB), dw)
        )
        dx_TM = rnd.add_to_tokens(dx_TM, plan.move.back(dx_GBM, r))
        dscale_R = rnd.set_rows(dscale_R, plan.move.back(dscale_GB, r))
        return dx_TM, dscale_R, dw

    dx_TM, dscale_R, dw = lax.fori_loop(0, plan.rounds, one_round, (dx0, dscale0, dw0))
    dw = tuple(reduce_like(g.astype(a.dtype), a) for g, a in zip(dw, w, strict=True))
    dscale_R = reduce_like(dscale_R, scale_R)
    return reduce_like(dx_TM, x_TM), None, None, None, dw, dscale_R


exchange_swiglu.defvjp(_fwd, _bwd)
