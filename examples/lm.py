"""A small decoder-only MoE language model whose sequence stays sharded end to end.

embedding -> n x [RMSNorm -> causal attention -> residual -> RMSNorm -> MoEBlock ->
residual] -> RMSNorm -> head. Every parameter is created in its at-rest sharding (the
embedding dim over the plan's embed axes, as the MoE block's weights rest).

The attention is plain, not a production kernel: inside one shard_map each device
projects its own tokens, all-gathers K and V over the sequence axes (so its queries see
the whole causal prefix), masks by *global* positions and projects back; the sequence
stays sharded before and after. It is O(S^2) in memory for the gathered scores and
does no ring or load-balanced reordering (context_parallel_load_balance only checks
divisibility here).

Legend: B batch, S sequence, M embedding, H heads, D head dim, V vocab.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

import layers
from layers.params import create_sharded, param
from layers.sharding import gather, spec_entry


def causal_attention(x_BSM, wq, wk, wv, wo, *, layout, heads: int, dtype):
    """One device's attention over its queries, against every key of the sequence."""
    embed = layout.embed
    wq, wk, wv = (gather(w, embed, 0).astype(dtype) for w in (wq, wk, wv))
    wo = gather(wo, embed, 1).astype(dtype)
    batch, seq, emb = x_BSM.shape
    dim = wq.shape[1] // heads
    x = x_BSM.astype(dtype)
    q_BSHD, k_BSHD, v_BSHD = (
        jnp.einsum("bsm,mf->bsf", x, w).reshape(batch, seq, heads, dim) for w in (wq, wk, wv)
    )
    k_all = gather(k_BSHD, layout.sequence, 1)  # the whole sequence's keys and values
    v_all = gather(v_BSHD, layout.sequence, 1)
    shard = jax.lax.axis_index(layout.sequence) if layout.sequence else 0
    q_pos = shard * seq + jnp.arange(seq)  # global positions of this device's queries
    k_pos = jnp.arange(k_all.shape[1])
    scores = jnp.einsum("bqhd,bkhd->bhqk", q_BSHD, k_all).astype(jnp.float32) / math.sqrt(dim)
    scores = jnp.where((k_pos[None, :] <= q_pos[:, None])[None, None], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1).astype(dtype)
    out = jnp.einsum("bhqk,bkhd->bqhd", probs, v_all).reshape(batch, seq, heads * dim)
    return jnp.einsum("bsf,fm->bsm", out, wo).astype(x_BSM.dtype)


class Attention(nnx.Module):
    def __init__(self, emb: int, heads: int, layout, dtype, param_dtype, rngs: nnx.Rngs):
        spec_in, spec_out = P(spec_entry(layout.embed), None), P(None, spec_entry(layout.embed))
        shardings = [layout.named(s) for s in (spec_in, spec_in, spec_in, spec_out)]
        shapes = [(emb, emb)] * 4
        values = create_sharded([rngs.params() for _ in shapes], shapes, param_dtype, shardings)
        self.wq, self.wk, self.wv, self.wo = (
            param(v, s) for v, s in zip(values, shardings, strict=True)
        )
        self.layout, self.heads, self.dtype = layout, heads, dtype
        self.specs = (spec_in, spec_in, spec_in, spec_out)

    def __call__(self, x_BSM):
        lay, specs = self.layout, self.specs
        w = [v.get_value() for v in (self.wq, self.wk, self.wv, self.wo)]

        def body(x, *weights):
            return causal_attention(x, *weights, layout=lay, heads=self.heads, dtype=self.dtype)

        fn = jax.shard_map(
            body,
            mesh=lay.mesh,
            in_specs=(lay.x_BSM, *specs),
            out_specs=lay.x_BSM,
            check_vma=True,
        )
        return fn(x_BSM, *w)


class RMSNorm(nnx.Module):
    def __init__(self, emb: int, layout, param_dtype):
        ones = jax.device_put(jnp.ones((emb,), param_dtype), layout.named(P()))
        self.scale = param(ones, layout.named(P()))

    def __call__(self, x):
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + 1e-6)
        return (normed * self.scale[...].astype(jnp.float32)[None, None, :]).astype(x.dtype)


class DecoderLayer(nnx.Module):
    def __init__(self, cfg, plan, mesh, heads: int, rngs: nnx.Rngs):
        self.moe = layers.MoEBlock(cfg, mesh=mesh, plan=plan, rngs=rngs)
        lay = self.moe.layout
        dtype, pdt = self.moe.spec.compute_dtype, self.moe.param_dtype
        self.attn_norm = RMSNorm(cfg.base_emb_dim, lay, pdt)
        self.attn = Attention(cfg.base_emb_dim, heads, lay, dtype, pdt, rngs)
        self.moe_norm = RMSNorm(cfg.base_emb_dim, lay, pdt)

    def __call__(self, x_BSM):
        x_BSM = x_BSM + self.attn(self.attn_norm(x_BSM))
        y_BSM, stats = self.moe(self.moe_norm(x_BSM))
        return x_BSM + y_BSM, stats


class MoELanguageModel(nnx.Module):
    """tokens (B, S) -> (logits (B, S, V) float32, per-layer MoE statistics)."""

    def __init__(self, cfg, plan, mesh, *, vocab: int, layers_: int, heads: int, rngs):
        self.blocks = nnx.List([DecoderLayer(cfg, plan, mesh, heads, rngs) for _ in range(layers_)])
        lay = self.blocks[0].moe.layout
        pdt = self.blocks[0].moe.param_dtype
        emb = cfg.base_emb_dim
        shardings = [
            lay.named(P(None, spec_entry(lay.embed))),
            lay.named(P(spec_entry(lay.embed), None)),
        ]
        embed, head = create_sharded(
            [rngs.params(), rngs.params()], [(vocab, emb), (emb, vocab)], pdt, shardings
        )
        self.embed, self.head = param(embed, shardings[0]), param(head, shardings[1])
        self.norm = RMSNorm(emb, lay, pdt)
        self.layout, self.dtype = lay, self.blocks[0].moe.spec.compute_dtype

    def _embed(self, tokens_BS):
        """tokens (B, S) -> (B, S, M), born in the tokens' sharding.

        A `take` under plain jit comes out split like the table (embed dim over the embed
        axes), and XLA can only move that to (batch, sequence) by replicating the whole
        activation first ("Involuntary full rematerialization"). Inside a shard_map each
        device gathers the table's embed dim (its transpose reduce-scatters the gradient
        back to the table's at-rest split) and looks up only its own tokens."""
        lay = self.layout
        tokens_spec = P(*lay.x_BSM[:2])

        def lookup(tokens, table_VM):
            table = gather(table_VM, lay.embed, 1, lay.repeated_axes)
            return jnp.take(table, tokens, axis=0).astype(self.dtype)

        fn = jax.shard_map(
            lookup,
            mesh=lay.mesh,
            in_specs=(tokens_spec, P(None, spec_entry(lay.embed))),
            out_specs=lay.x_BSM,
            check_vma=True,
        )
        return fn(tokens_BS, self.embed[...])

    def __call__(self, tokens_BS):
        lay = self.layout
        x = self._embed(tokens_BS)
        stats = []
        for block in self.blocks:
            x, s = block(x)
            stats.append(s)
        logits = jnp.einsum("bsm,mv->bsv", self.norm(x), self.head[...].astype(self.dtype))
        logits = jax.lax.with_sharding_constraint(logits.astype(jnp.float32), lay.named(lay.x_BSM))
        return logits, stats
