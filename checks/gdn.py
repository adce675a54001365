"""Qwen3-Next's linear attention (Gated DeltaNet) for the decoder's whole-step compile.

The gated delta rule keeps one (Dk x Dv) state a value head and, token by token, decays
it by exp(g), replaces what it stored under the key k with the value v at the rate beta,
and reads it with the query q:

    S <- exp(g_t) S;  S <- S + beta_t k_t (v_t - k_t^T S);  o_t = q_t^T S

`chunked` computes it the way MaxText 0.2.5 (`jax_chunk_gated_delta_rule`, read in its
models/qwen3.py) and the reference kernels of the model do, a chunk of C tokens at a
time (one difference: here every operand is float32, where MaxText casts the queries,
keys, values, beta and the scan's u and w to the compute dtype): inside a chunk the
delta rule's triangular system is solved once (the WY form: u and w), then a scan over
the chunks carries the state. `recurrent` is the token-by-token rule, the reference the
tests hold `chunked` to.

Context parallelism splits the sequence; the state runs from one shard to the next. The
state after a shard is affine in the state before it, S_out = A S_in + B (A: Dk x Dk,
B: Dk x Dv a head), so each device computes its shard's (A, B) from a zero state, the
devices all-gather them (a few MiB), each composes those of the shards before it into
its incoming state, and runs its chunks again from that state. The causal convolution
takes its first kernel-1 inputs from the previous shard (`causal_conv`).

Legend: B batch, S a device's tokens, N chunks, C chunk, H value heads, K key dim (Dk),
V value dim (Dv).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

CHUNK = 64  # MaxText 0.2.5's base.yml gdn_chunk_size


def l2norm(x, eps: float = 1e-6):
    x32 = x.astype(jnp.float32)
    return x32 * jax.lax.rsqrt(jnp.sum(x32 * x32, axis=-1, keepdims=True) + eps)


def _prepare(q, k, v, g, beta):
    """Queries and keys l2-normalised (queries scaled by 1/sqrt(K)), all float32."""
    scale = q.shape[-1] ** -0.5
    f32 = jnp.float32
    return l2norm(q) * scale, l2norm(k), v.astype(f32), g.astype(f32), beta.astype(f32)


def recurrent(q_BSHK, k_BSHK, v_BSHV, g_BSH, beta_BSH, state_BHKV=None):
    """The delta rule token by token: (outputs float32 [B, S, H, V], final state)."""
    q, k, v, g, beta = _prepare(q_BSHK, k_BSHK, v_BSHV, g_BSH, beta_BSH)
    b, _, h, dk = q.shape
    if state_BHKV is None:
        state_BHKV = jnp.zeros((b, h, dk, v.shape[-1]), jnp.float32)

    def step(s, xs):
        q_t, k_t, v_t, g_t, beta_t = xs
        s = s * jnp.exp(g_t)[..., None, None]
        stored = jnp.einsum("bhkv,bhk->bhv", s, k_t)
        s = s + jnp.einsum("bhk,bhv->bhkv", k_t, (v_t - stored) * beta_t[..., None])
        return s, jnp.einsum("bhkv,bhk->bhv", s, q_t)

    xs = tuple(jnp.swapaxes(a, 0, 1) for a in (q, k, v, g, beta))
    state, out = jax.lax.scan(step, state_BHKV, xs)
    return jnp.swapaxes(out, 0, 1), state


def _chunks(x, chunk):
    """[B, S, H, ...] -> [N, B, H, C, ...]: the chunks leading, for the scan."""
    b, s, h = x.shape[:3]
    x = x.reshape(b, s // chunk, chunk, h, *x.shape[3:])
    return jnp.moveaxis(jnp.swapaxes(x, 2, 3), 1, 0)


def _wy(q, k, v, g, beta, chunk):
    """Each chunk's inputs to the scan: q, k, the cumulative log decay, and the WY
    form's u = T (beta v) and w = T (beta k exp(gcum)), T = (I + L)^-1 with L the
    strictly lower (beta k k^T) decay-weighted within the chunk."""
    q, k, v, g, beta = (_chunks(a, chunk) for a in (q, k, v, g, beta))
    gcum = jnp.cumsum(g, axis=-1)  # [N, B, H, C]
    diff = gcum[..., :, None] - gcum[..., None, :]
    strict = jnp.tril(jnp.ones((chunk, chunk), bool), -1)
    decay = jnp.exp(jnp.where(jnp.broadcast_to(strict, diff.shape), diff, -jnp.inf))
    k_beta = k * beta[..., None]
    lower = jnp.einsum("nbhck,nbhdk->nbhcd", k_beta, k) * decay
    eye = jnp.eye(chunk, dtype=jnp.float32)
    eye = jnp.broadcast_to(eye, lower.shape)
    t = jax.scipy.linalg.solve_triangular(eye + lower, eye, lower=True)
    u = jnp.einsum("nbhcd,nbhdv->nbhcv", t, v * beta[..., None])
    w = jnp.einsum("nbhcd,nbhdk->nbhck", t, k_beta * jnp.exp(gcum)[..., None])
    return q, k, u, w, gcum


def _decayed_keys(k, gcum):
    """(the chunk's total log decay, each key decayed to the chunk's end)."""
    last = gcum[..., -1]
    return last, k * jnp.exp(last[..., None] - gcum)[..., None]


def _carry(s, k, u, w, gcum):
    """The state after a chunk, and the chunk's new values v_new = u - w S."""
    v_new = u - jnp.einsum("bhck,bhkv->bhcv", w, s)
    last, k_dec = _decayed_keys(k, gcum)
    s = s * jnp.exp(last)[..., None, None] + jnp.einsum("bhck,bhcv->bhkv", k_dec, v_new)
    return s, v_new


def chunked(q_BSHK, k_BSHK, v_BSHV, g_BSH, beta_BSH, state_BHKV=None, chunk: int = CHUNK):
    """The delta rule a chunk at a time: (outputs float32 [B, S, H, V], final state)."""
    q, k, v, g, beta = _prepare(q_BSHK, k_BSHK, v_BSHV, g_BSH, beta_BSH)
    b, s, h, dk = q.shape
    if s % chunk:
        raise ValueError(f"gdn chunk {chunk} does not divide a device's {s} tokens")
    if state_BHKV is None:
        state_BHKV = jnp.zeros((b, h, dk, v.shape[-1]), jnp.float32)
    causal = jnp.tril(jnp.ones((chunk, chunk), bool))

    def body(state, xs):
        q_i, k_i, u_i, w_i, g_i = xs
        diff = g_i[..., :, None] - g_i[..., None, :]
        mask = jnp.broadcast_to(causal, diff.shape)
        scores = jnp.einsum("bhck,bhdk->bhcd", q_i, k_i) * jnp.exp(jnp.where(mask, diff, -jnp.inf))
        past = jnp.einsum("bhck,bhkv->bhcv", q_i * jnp.exp(g_i)[..., None], state)
        state, v_new = _carry(state, k_i, u_i, w_i, g_i)
        return state, past + jnp.einsum("bhcd,bhdv->bhcv", scores, v_new)

    state, out = jax.lax.scan(body, state_BHKV, _wy(q, k, v, g, beta, chunk))
    out = jnp.moveaxis(out, 0, 1)  # [B, N, H, C, V]
    return jnp.swapaxes(out, 2, 3).reshape(b, s, h, -1), state


def transition(q_BSHK, k_BSHK, v_BSHV, g_BSH, beta_BSH, chunk: int = CHUNK):
    """The shard's affine map of the state, S_out = A S_in + B: (A [B, H, K, K],
    B [B, H, K, V]), composed over its chunks from a zero state."""
    q, k, v, g, beta = _prepare(q_BSHK, k_BSHK, v_BSHV, g_BSH, beta_BSH)
    b, _, h, dk = q.shape
    eye = jnp.broadcast_to(jnp.eye(dk, dtype=jnp.float32), (b, h, dk, dk))

    def body(carry, xs):
        a, s = carry
        _, k_i, u_i, w_i, g_i = xs
        # S' = exp(g_last) S + k_dec^T (u - w S): its linear part on S, and its
        # constant part (the state carried from zero).
        last, k_dec = _decayed_keys(k_i, g_i)
        step = jnp.exp(last)[..., None, None] * eye - jnp.einsum("bhck,bhcj->bhkj", k_dec, w_i)
        s, _ = _carry(s, k_i, u_i, w_i, g_i)
        return (jnp.einsum("bhkj,bhjl->bhkl", step, a), s), None

    zero = jnp.zeros((b, h, dk, v.shape[-1]), jnp.float32)
    (a, s), _ = jax.lax.scan(body, (eye, zero), _wy(q, k, v, g, beta, chunk))
    return a, s


def sharded(q, k, v, g, beta, axes: tuple[str, ...], chunk: int = CHUNK):
    """`chunked` on a device's sequence shard inside shard_map over the sequence `axes`
    (in sequence order): the incoming state composed from the earlier shards' maps."""
    if not axes:
        return chunked(q, k, v, g, beta, chunk=chunk)[0]
    a, b = transition(q, k, v, g, beta, chunk)
    a_all = jax.lax.all_gather(a, axes)  # [cp, B, H, K, K]
    b_all = jax.lax.all_gather(b, axes)
    states = [jnp.zeros_like(b)]
    for shard in range(a_all.shape[0] - 1):
        states.append(jnp.einsum("bhkj,bhjv->bhkv", a_all[shard], states[-1]) + b_all[shard])
    incoming = jnp.stack(states)[jax.lax.axis_index(axes)]
    return chunked(q, k, v, g, beta, incoming, chunk)[0]


def causal_conv(x_BSC, w_KC, axes: tuple[str, ...]):
    """Depthwise causal convolution over the sequence (kernel K a channel), its first
    K-1 inputs the previous shard's last tokens (zeros before the first)."""
    width = w_KC.shape[0] - 1
    if axes:
        shards = jax.lax.psum(1, axes)
        halo = jax.lax.ppermute(x_BSC[:, -width:], axes, [(i, i + 1) for i in range(shards - 1)])
    else:
        halo = jnp.zeros_like(x_BSC[:, :width])
    padded = jnp.concatenate([halo, x_BSC], axis=1)
    s = x_BSC.shape[1]
    return sum(padded[:, j : j + s] * w_KC[j][None, None] for j in range(width + 1))
