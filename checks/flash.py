"""Causal attention computed block by block, as a flash kernel computes it, in plain jax.

The whole-step compile (`checks.step`) has to hold what a production attention kernel
holds: queries, keys, values, the output and the per-row log-sum-exp, never a sequence x
sequence score matrix. The forward walks key blocks with an online softmax for each
query block; the backward (a custom VJP) recomputes each block's probabilities from the
saved log-sum-exp, so what the backward keeps is the same handful of token-sized arrays.
It is meant to be compiled, not to be fast: fully masked blocks are computed, not
skipped.

Runs on one device's shard (inside a shard_map). Legend: B batch, S queries, K keys, G
key-value heads, R query heads per key-value head, D query/key head dim, E value head
dim, Q a query block, C a key block, N the number of blocks.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

NEG = -1e30  # a masked score: finite, so a fully masked block adds exactly nothing
BLOCK = 512  # query and key block (Pallas' TPU flash kernel's default tiles)


def block_size(n: int) -> int:
    """The block along a dim of `n`: BLOCK where it divides, else their gcd."""
    return math.gcd(n, BLOCK)


def _scores(q_BQGRD, k_BCGD, q_pos_Q, k_pos_C, scale: float):
    """Scaled float32 scores (B, G, R, Q, C) and the causal mask (Q, C)."""
    s = jnp.einsum("bqgrd,bcgd->bgrqc", q_BQGRD, k_BCGD, preferred_element_type=jnp.float32)
    mask_QC = k_pos_C[None, :] <= q_pos_Q[:, None]
    return s * scale, mask_QC


def _blocks(x, n: int, dim: int = 1):
    """Split `dim` into n blocks and move the block index to the front."""
    shape = x.shape[:dim] + (n, x.shape[dim] // n) + x.shape[dim + 1 :]
    return jnp.moveaxis(x.reshape(shape), dim, 0)


def _unblocks(x, dim: int = 1):
    x = jnp.moveaxis(x, 0, dim)
    return x.reshape(x.shape[:dim] + (x.shape[dim] * x.shape[dim + 1],) + x.shape[dim + 2 :])


def _forward(q, k, v, q_pos, k_pos):
    batch, seq, groups, rep, dim = q.shape
    keys, vdim = k.shape[1], v.shape[-1]
    bq, bk = block_size(seq), block_size(keys)
    scale = dim**-0.5
    k_blocks = (_blocks(k, keys // bk), _blocks(v, keys // bk), k_pos.reshape(-1, bk))

    def one_query_block(args):
        q_BQGRD, q_pos_Q = args

        def step(carry, kv):
            o, m, sums = carry
            k_BCGD, v_BCGE, k_pos_C = kv
            s, mask = _scores(q_BQGRD, k_BCGD, q_pos_Q, k_pos_C, scale)
            s = jnp.where(mask[None, None, None], s, NEG)
            m_new = jnp.maximum(m, s.max(-1))
            p = jnp.where(mask[None, None, None], jnp.exp(s - m_new[..., None]), 0.0)
            corr = jnp.exp(m - m_new)
            pv = jnp.einsum(
                "bgrqc,bcge->bgrqe",
                p.astype(v_BCGE.dtype),
                v_BCGE,
                preferred_element_type=jnp.float32,
            )
            return (o * corr[..., None] + pv, m_new, sums * corr + p.sum(-1)), None

        rows = (batch, groups, rep, bq)
        init = (jnp.zeros((*rows, vdim), jnp.float32), jnp.full(rows, NEG), jnp.zeros(rows))
        (o, m, sums), _ = jax.lax.scan(step, init, k_blocks)
        o_BQGRE = jnp.einsum("bgrqe->bqgre", o / sums[..., None]).astype(q.dtype)
        return o_BQGRE, m + jnp.log(sums)

    o, lse = jax.lax.map(one_query_block, (_blocks(q, seq // bq), q_pos.reshape(-1, bq)))
    return _unblocks(o), lse  # lse stays blocked: (N, B, G, R, Q)


@jax.custom_vjp
def flash_attention(q_BSGRD, k_BKGD, v_BKGE, q_pos_S, k_pos_K):
    """Causal attention of queries at global positions q_pos_S against keys at k_pos_K:
    (B, S, G, R, D), (B, K, G, D), (B, K, G, E) -> (B, S, G, R, E)."""
    return _forward(q_BSGRD, k_BKGD, v_BKGE, q_pos_S, k_pos_K)[0]


def _fwd(q, k, v, q_pos, k_pos):
    o, lse = _forward(q, k, v, q_pos, k_pos)
    return o, (q, k, v, o, lse, q_pos, k_pos)


def _bwd(res, do_BSGRE):
    q, k, v, o, lse, q_pos, k_pos = res
    seq, keys, dim = q.shape[1], k.shape[1], q.shape[-1]
    bq, bk = block_size(seq), block_size(keys)
    nq = seq // bq
    scale = dim**-0.5
    delta = jnp.einsum("bsgre,bsgre->bgrs", do_BSGRE.astype(jnp.float32), o.astype(jnp.float32))
    q_side = (
        _blocks(q, nq),
        _blocks(do_BSGRE, nq),
        lse,
        _blocks(delta, nq, dim=3),
        q_pos.reshape(-1, bq),
    )

    def key_block(dq, kv):
        k_BCGD, v_BCGE, k_pos_C = kv

        def query_block(acc, qs):
            dk, dv = acc
            q_BQGRD, do_BQGRE, lse_BGRQ, delta_BGRQ, q_pos_Q = qs
            s, mask = _scores(q_BQGRD, k_BCGD, q_pos_Q, k_pos_C, scale)
            p = jnp.where(mask[None, None, None], jnp.exp(s - lse_BGRQ[..., None]), 0.0)
            dv = dv + jnp.einsum("bgrqc,bqgre->bcge", p, do_BQGRE.astype(jnp.float32))
            dp = jnp.einsum(
                "bqgre,bcge->bgrqc", do_BQGRE, v_BCGE, preferred_element_type=jnp.float32
            )
            ds = p * (dp - delta_BGRQ[..., None]) * scale
            dq_BQGRD = jnp.einsum("bgrqc,bcgd->bqgrd", ds, k_BCGD.astype(jnp.float32))
            dk = dk + jnp.einsum("bgrqc,bqgrd->bcgd", ds, q_BQGRD.astype(jnp.float32))
            return (dk, dv), dq_BQGRD

        init = (jnp.zeros(k_BCGD.shape, jnp.float32), jnp.zeros(v_BCGE.shape, jnp.float32))
        (dk, dv), dq_blocks = jax.lax.scan(query_block, init, q_side)
        return dq + dq_blocks, (dk, dv)

    dq0 = jnp.zeros((nq, *q.shape[:1], bq, *q.shape[2:]), jnp.float32)
    k_side = (_blocks(k, keys // bk), _blocks(v, keys // bk), k_pos.reshape(-1, bk))
    dq, (dk, dv) = jax.lax.scan(key_block, dq0, k_side)
    return (
        _unblocks(dq).astype(q.dtype),
        _unblocks(dk).astype(k.dtype),
        _unblocks(dv).astype(v.dtype),
        None,
        None,
    )


flash_attention.defvjp(_fwd, _bwd)


def reference_attention(q_BSGRD, k_BKGD, v_BKGE, q_pos_S, k_pos_K):
    """The same attention with the whole score matrix (for tests)."""
    s = jnp.einsum("bsgrd,bkgd->bgrsk", q_BSGRD, k_BKGD, preferred_element_type=jnp.float32)
    s = s * q_BSGRD.shape[-1] ** -0.5
    mask = (k_pos_K[None, :] <= q_pos_S[:, None])[None, None, None]
    p = jax.nn.softmax(jnp.where(mask, s, NEG), axis=-1)
    return jnp.einsum("bgrsk,bkge->bsgre", p.astype(v_BKGE.dtype), v_BKGE).astype(q_BSGRD.dtype)
