"""The decoder a config describes, for compiling its whole training step (`checks.step`).

embedding -> first_num_dense_layers x [RMSNorm -> attention -> residual -> RMSNorm ->
dense SwiGLU -> residual] -> the MoE layers, the same with the plan's MoE block ->
RMSNorm -> head -> float32 logits and cross-entropy, num_vocab_tiling tiles of a
device's tokens at a time. Each kind of layer is one stack of parameters (a leading
layer dim) run by `jax.lax.scan`, every layer under `jax.checkpoint` with the config's
remat policy (MaxText 0.2.5's checkpoint names, `selector.step_memory.REMAT_SAVES`).

Attention is grouped-query (MaxText's `global`, with per-head query/key norms when
use_qk_norm) or multi-head latent (`mla`): each device projects its own tokens,
all-gathers keys and values over the sequence axes and runs a flash-style blockwise
kernel (`checks.flash`). Rotary embeddings are left out (elementwise; they hold no
memory beyond the projections). Qwen3-Next (`decoder_block: qwen3_next`) scans cycles
of inhomogeneous_layer_cycle_interval layers: Gated DeltaNet layers (`checks.gdn`, its
sequence kept sharded) and then one gated full-attention layer, each with the MoE block,
as MaxText 0.2.5 scans its blocks of four.

Weights rest as MaxText's rules put them and as `selector.step_memory` counts them: the
embedding dim of every non-expert weight over the plan's embed and expert axes, heads,
dense hidden and vocab over the tensor axes; the MoE layers' weights in the plan's
placement (`layers.MoEBlock.param_layout`), its forward `layers.moe.sharded_forward`.

Legend: B batch, S sequence (a device's shard inside shard_map), K keys (the whole
sequence), M embedding, H heads, G key-value heads, R query heads a key-value head, D
head dim, F dense hidden, V vocab, T tokens, L layers.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import selector
from layers import MoEBlock
from layers.ffn import ExpertWeights
from layers.moe import sharded_forward
from layers.params import create_sharded, param
from layers.sharding import Layout, gather, spec_entry
from selector.architecture import is_moe_layer
from selector.step_memory import REMAT_SAVES

from . import gdn
from .flash import flash_attention

LOAD_BALANCE_WEIGHT = 0.01


@dataclass(frozen=True)
class DecoderLayout:
    """Mesh axes per role of the non-expert weights and the tokens; the MoE block's own
    `Layout` for its layers."""

    mesh: Mesh
    embed: tuple[str, ...]
    hidden: tuple[str, ...]
    moe: Layout

    @classmethod
    def from_plan(cls, plan, mesh: Mesh) -> DecoderLayout:
        view = plan.mesh
        keep = tuple(dict.fromkeys(a for a in (*view.embed_axes, *view.expert_axes)))
        embed = tuple(a for a in keep if mesh.shape.get(a, 1) > 1)
        hidden = tuple(a for a in view.hidden_axes if mesh.shape.get(a, 1) > 1)
        return cls(mesh, embed, hidden, Layout.from_plan(plan, mesh))

    @property
    def hidden_embed(self) -> tuple[str, ...]:
        """A dim split over the tensor axes and, within a tensor shard, the embed axes
        (gathered over the latter for compute)."""
        return self.hidden + self.embed

    @property
    def tokens(self) -> P:
        return P(spec_entry(self.moe.batch), spec_entry(self.moe.sequence))

    def spec(self, roles: tuple[str | None, ...], stacked: bool = False) -> P:
        entries = tuple(None if r is None else spec_entry(getattr(self, r)) for r in roles)
        return P(*((None,) if stacked else ()), *entries)

    def named(self, spec: P) -> NamedSharding:
        return NamedSharding(self.mesh, spec)


def attention_table(cfg: selector.Config) -> dict[str, tuple[tuple[int, ...], tuple]]:
    """name -> (shape, role a dim) of one layer's attention weights (selector.architecture
    counts the same tensors). Small norm scales rest split like the embedding dim, and so
    do MLA's low-rank dims (MaxText 0.2.5's base.yml shards `q_lora` and `kv_lora` over
    fsdp, the context axes and expert, as it shards `embed`): an up-projection held
    whole would be DeepSeek-V3's 1.6 GiB a device at 8 layers."""
    emb, heads = cfg.base_emb_dim, cfg.base_num_query_heads
    if cfg.attention_type == "mla":
        qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
        t = {}
        if cfg.q_lora_rank > 0:
            t["wq_a"] = ((emb, cfg.q_lora_rank), ("embed", None))
            t["q_norm"] = ((cfg.q_lora_rank,), ("embed",))
            t["wq_b"] = ((cfg.q_lora_rank, heads * qk), ("embed", "hidden"))
        else:
            t["wq"] = ((emb, heads * qk), ("embed", "hidden"))
        t["wkv_a"] = ((emb, cfg.kv_lora_rank + cfg.qk_rope_head_dim), ("embed", None))
        t["kv_norm"] = ((cfg.kv_lora_rank,), ("embed",))
        width = heads * (cfg.qk_nope_head_dim + cfg.v_head_dim)
        t["wkv_b"] = ((cfg.kv_lora_rank, width), ("embed", "hidden"))
        t["wo"] = ((heads * cfg.v_head_dim, emb), ("hidden", "embed"))
        return t
    hd, kv = cfg.head_dim, cfg.base_num_kv_heads
    t = {
        "wq": ((emb, heads * hd), ("embed", "hidden")),
        "wk": ((emb, kv * hd), ("embed", "hidden")),
        "wv": ((emb, kv * hd), ("embed", "hidden")),
        "wo": ((heads * hd, emb), ("hidden", "embed")),
    }
    gated = cfg.decoder_block == "qwen3_next"
    if gated:  # Qwen3-Next's full attention: a sigmoid gate on each head's output
        t["wg"] = ((emb, heads * hd), ("embed", "hidden"))
    if cfg.use_qk_norm or gated:
        t["q_norm"] = ((hd,), ("embed",))
        t["k_norm"] = ((hd,), ("embed",))
    return t


def gdn_table(cfg: selector.Config) -> dict[str, tuple[tuple[int, ...], tuple]]:
    """One Gated DeltaNet layer's weights (the tensors `gated_delta_net_params` counts;
    the fused projections and the convolution kept one per input, so that a split of
    the heads over the tensor axes splits each alike)."""
    emb, hv = cfg.base_emb_dim, cfg.gdn_num_value_heads
    keys = cfg.gdn_num_key_heads * cfg.gdn_key_head_dim
    values = hv * cfg.gdn_value_head_dim
    conv = cfg.gdn_conv_kernel_dim
    return {
        "wq": ((emb, keys), ("embed", "hidden")),
        "wk": ((emb, keys), ("embed", "hidden")),
        "wv": ((emb, values), ("embed", "hidden")),
        "wz": ((emb, values), ("embed", "hidden")),  # the output gate
        "wb": ((emb, hv), ("embed", "hidden")),  # beta, a value head
        "wa": ((emb, hv), ("embed", "hidden")),  # the decay's input, a value head
        "conv_q": ((conv, keys), (None, "hidden_embed")),
        "conv_k": ((conv, keys), (None, "hidden_embed")),
        "conv_v": ((conv, values), (None, "hidden_embed")),
        # A value head's two scalars (32 in Qwen3-Next: fewer than the devices that
        # split the others) rest whole beside the tensor split.
        "a_log": ((hv,), ("hidden",)),
        "dt_bias": ((hv,), ("hidden",)),
        "norm": ((cfg.gdn_value_head_dim,), ("embed",)),
        "wo": ((values, emb), ("hidden", "embed")),
    }


def layer_table(
    cfg: selector.Config, moe: bool, mixer: str = "attention"
) -> dict[str, tuple[tuple[int, ...], tuple]]:
    """One layer's weights outside the MoE block; `mixer` attention or linear (GDN)."""
    emb = cfg.base_emb_dim
    if mixer == "linear":
        t = {f"lin/{n}": v for n, v in gdn_table(cfg).items()}
    else:
        t = {f"attn/{n}": v for n, v in attention_table(cfg).items()}
    t["attn_norm"] = ((emb,), ("embed",))
    t["ffn_norm"] = ((emb,), ("embed",))
    if not moe:
        t["wi_0"] = ((emb, cfg.base_mlp_dim), ("embed", "hidden"))
        t["wi_1"] = ((emb, cfg.base_mlp_dim), ("embed", "hidden"))
        t["wo"] = ((cfg.base_mlp_dim, emb), ("hidden", "embed"))
    return t


def _rms(x, scale):
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + 1e-6)
    scale = scale.astype(jnp.float32).reshape((1,) * (x.ndim - 1) + scale.shape)
    return (normed * scale).astype(x.dtype)


def _dot(x, w, name: str | None = None):
    y = jnp.einsum("...m,mf->...f", x, w)
    return y if name is None else checkpoint_name(y, name)


class Decoder(nnx.Module):
    """The decoder's parameters at rest (stacked per kind of layer) and its loss.

    `loss(weights, tokens_BS, targets_BS)` is a pure function of `weights()` (abstract
    ShapeDtypeStructs under nnx.eval_shape), as the train step differentiates it."""

    def __init__(self, cfg, *, mesh: Mesh, plan: selector.DispatchPlan, rngs: nnx.Rngs):
        config = selector.to_config(cfg)
        num_layers = config.base_num_decoder_layers
        moe_layers = [i for i in range(num_layers) if is_moe_layer(config, i)]
        dense = num_layers - len(moe_layers)
        # (kind, leading dims of its stacked weights, mixer); a Qwen3-Next cycle scans
        # its linear layers' stack [cycles, interval - 1] and its full layers' [cycles].
        self.cycle = 0
        if config.decoder_block == "qwen3_next":
            interval = config.inhomogeneous_layer_cycle_interval
            if interval < 2 or num_layers % interval or dense:
                raise ValueError(
                    "Qwen3-Next's decoder is scanned in cycles of "
                    "inhomogeneous_layer_cycle_interval >= 2 MoE layers; "
                    f"base_num_decoder_layers={num_layers} with interval {interval} "
                    f"and {dense} dense layers is not"
                )
            self.cycle, cycles = interval, num_layers // interval
            kinds = (("linear", (cycles, interval - 1), "linear"), ("full", (cycles,), "attention"))
        else:
            if moe_layers and moe_layers != list(range(dense, num_layers)):
                raise ValueError("only dense layers first, then MoE layers, are scanned here")
            kinds = (("dense", (dense,), "attention"), ("moe", (len(moe_layers),), "attention"))
        if config.context_parallel_strategy.value != "all_gather":
            raise ValueError(
                f"context_parallel_strategy={config.context_parallel_strategy.value}: the "
                "compiled step (checks.step) all-gathers keys and values over the sequence "
                "shards; compile it with context_parallel_strategy=all_gather."
            )
        self.config, self.plan = config, plan
        self.layout = lay = DecoderLayout.from_plan(plan, mesh)
        self.dtype = jnp.dtype(config.dtype)
        block = nnx.eval_shape(lambda: MoEBlock(config, mesh=mesh, plan=plan, rngs=nnx.Rngs(0)))
        self.moe_layout, self.moe_spec = block.layout, block.spec
        emb, vocab = config.base_emb_dim, config.vocab_size
        table: dict[str, tuple[tuple[int, ...], P]] = {
            "embedding": ((vocab, emb), lay.spec(("hidden", "embed"))),
            "final_norm": ((emb,), lay.spec(("embed",))),
        }
        if not config.logits_via_embedding:
            table["head"] = ((emb, vocab), lay.spec(("embed", "hidden")))
        self.roles: dict[str, tuple] = {}  # a layer's weight -> the role of each dim
        for kind, lead, mixer in kinds:
            if not lead[-1]:
                continue
            stacked = (None,) * len(lead)
            moe = kind != "dense"
            for name, (shape, roles) in layer_table(config, moe, mixer).items():
                table[f"{kind}/{name}"] = ((*lead, *shape), P(*stacked, *lay.spec(roles)))
                self.roles[name] = roles
            if not moe:
                continue
            names, shapes, shardings = block.param_layout()
            for n, shape, s in zip(names, shapes, shardings, strict=True):
                table[f"{kind}/block/{n}"] = ((*lead, *shape), P(*stacked, *s.spec))
            if block.spec.routed_bias:
                table[f"{kind}/block/bias_E"] = ((*lead, block.spec.num_experts), P())
        self.specs = {n: spec for n, (_, spec) in table.items()}
        pdt = jnp.dtype(config.param_dtype)
        ones = [n for n in table if n.endswith("norm")]
        zeros = [n for n in table if n.endswith("bias_E")]
        drawn = [n for n in table if n not in ones and n not in zeros]
        shardings = [lay.named(self.specs[n]) for n in drawn]
        keys = [rngs.params() for _ in drawn]
        values = dict(
            zip(
                drawn,
                create_sharded(keys, [table[n][0] for n in drawn], pdt, shardings),
                strict=True,
            )
        )
        for n in ones + zeros:
            fill = jnp.ones if n in ones else jnp.zeros
            dt = pdt if n in ones else jnp.float32
            s = lay.named(self.specs[n])
            values[n] = jax.jit(lambda f=fill, t=table[n][0], d=dt: f(t, d), out_shardings=s)()
        self.params = nnx.Dict({n: param(values[n], lay.named(self.specs[n])) for n in table})

    def weights(self) -> dict[str, jax.Array]:
        return {n: v.get_value() for n, v in self.params.items()}

    def shardings(self) -> dict[str, NamedSharding]:
        return {n: self.layout.named(s) for n, s in self.specs.items()}

    # The phases, each a shard_map over the mesh with its specs from the layout.
    def _map(self, body, in_specs, out_specs):
        return jax.shard_map(
            body, mesh=self.layout.mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False
        )

    def _embed(self, w, tokens_BS):
        lay, hidden = self.layout, self.layout.hidden

        def lookup(tokens, table_VM):
            table = gather(table_VM.astype(self.dtype), lay.embed, 1)
            if not hidden:
                return jnp.take(table, tokens, axis=0)
            local = tokens - jax.lax.axis_index(hidden) * table.shape[0]
            found = (local >= 0) & (local < table.shape[0])
            x = jnp.take(table, jnp.clip(local, 0, table.shape[0] - 1), axis=0)
            return jax.lax.psum(jnp.where(found[..., None], x, 0), hidden)

        spec = self.specs["embedding"]
        return self._map(lookup, (lay.tokens, spec), self.moe_layout.x_BSM)(tokens_BS, w)

    def _layer_map(self, body, w: dict, x_BSM):
        """shard_map `body(x, weights gathered over the embed axes in the compute
        dtype)` over one layer's weights `w` (those `body` reads) and x."""
        lay, roles = self.layout, self.roles
        names = sorted(w)

        def inner(x, *values):
            g = {}
            for n, v in zip(names, values, strict=True):
                v = v.astype(self.dtype)
                split = [i for i, r in enumerate(roles[n]) if r in ("embed", "hidden_embed")]
                g[n] = gather(v, lay.embed, split[0]) if split else v
            return body(x, g)

        x_spec = self.moe_layout.x_BSM
        specs = tuple(lay.spec(roles[n]) for n in names)
        return self._map(inner, (x_spec, *specs), x_spec)(x_BSM, *(w[n] for n in names))

    def _attention(self, x, g):
        """One device: RMSNorm, then its queries against the whole sequence's keys."""
        seq_axes = self.moe_layout.sequence
        h = _rms(x, g["attn_norm"])
        q, k, v = (self._mla if self.config.attention_type == "mla" else self._gqa)(h, g)
        k_all, v_all = gather(k, seq_axes, 1), gather(v, seq_axes, 1)
        seq = x.shape[1]
        shard = jax.lax.axis_index(seq_axes) if seq_axes else 0
        q_pos = shard * seq + jnp.arange(seq)
        out = flash_attention(q, k_all, v_all, q_pos, jnp.arange(k_all.shape[1]))
        context = out.reshape(*out.shape[:2], -1)
        if "attn/wg" in g:
            context = context * jax.nn.sigmoid(_dot(h, g["attn/wg"]))
        context = checkpoint_name(context, "context")
        y = jnp.einsum("bsf,fm->bsm", context, g["attn/wo"])
        return checkpoint_name(self._sum_hidden(y), "out_proj")

    def _gdn(self, x, g):
        """One device: RMSNorm, then Qwen3-Next's Gated DeltaNet over its tokens (the
        convolution's halo and the state from the earlier sequence shards)."""
        cfg, seq_axes = self.config, self.moe_layout.sequence
        f32 = jnp.float32
        h = _rms(x, g["attn_norm"])
        b, s = h.shape[:2]
        dk, dv = cfg.gdn_key_head_dim, cfg.gdn_value_head_dim

        def conv(name, width):
            y = gdn.causal_conv(_dot(h, g[f"lin/w{name}"]), g[f"lin/conv_{name}"], seq_axes)
            return jax.nn.silu(y).reshape(b, s, -1, width)

        q, k, v = conv("q", dk), conv("k", dk), conv("v", dv)
        repeat = v.shape[2] // q.shape[2]  # key heads shared by value heads
        q, k = jnp.repeat(q, repeat, axis=2), jnp.repeat(k, repeat, axis=2)
        beta = jax.nn.sigmoid(_dot(h, g["lin/wb"]).astype(f32))
        bias = g["lin/dt_bias"].astype(f32)[None, None]
        rate = jax.nn.softplus(_dot(h, g["lin/wa"]).astype(f32) + bias)
        decay = -jnp.exp(g["lin/a_log"].astype(f32))[None, None] * rate
        out = gdn.sharded(q, k, v, decay, beta, seq_axes)  # float32 [B, S, H, V]
        z = _dot(h, g["lin/wz"]).reshape(b, s, -1, dv).astype(f32)
        out = (_rms(out, g["lin/norm"]) * jax.nn.silu(z)).astype(self.dtype)
        y = jnp.einsum("bsf,fm->bsm", out.reshape(b, s, -1), g["lin/wo"])
        return checkpoint_name(self._sum_hidden(y), "out_proj")

    def _sum_hidden(self, y):
        return jax.lax.psum(y, self.layout.hidden) if self.layout.hidden else y

    def _dense_ffn(self, x, g):
        """One device: RMSNorm, then a SwiGLU over its tokens."""
        h = _rms(x, g["ffn_norm"])
        a = jax.nn.silu(_dot(h, g["wi_0"], "mlpwi_0")) * _dot(h, g["wi_1"], "mlpwi_1")
        return checkpoint_name(self._sum_hidden(_dot(a, g["wo"])), "mlpwo")

    def _layer(self, moe: bool, mixer: str = "attention"):
        """(x_BSM, one layer's weights) -> (x_BSM, load-balance loss), rematerialised
        in the backward as the remat policy says; `mixer` attention or linear (GDN)."""
        prefix, mix = ("lin/", self._gdn) if mixer == "linear" else ("attn/", self._attention)

        def layer(x, w):
            mixing = {n: v for n, v in w.items() if n.startswith(prefix) or n == "attn_norm"}
            x = x + self._layer_map(mix, mixing, x)
            if not moe:
                ffn = {n: w[n] for n in ("ffn_norm", "wi_0", "wi_1", "wo")}
                return x + self._layer_map(self._dense_ffn, ffn, x), jnp.zeros((), jnp.float32)
            h = _rms(x, w["ffn_norm"])
            fields = {n.removeprefix("block/"): v for n, v in w.items() if n.startswith("block/")}
            y, stats = sharded_forward(
                self.plan.strategy, self.moe_layout, self.moe_spec, h, ExpertWeights(**fields)
            )
            return x + y.astype(x.dtype), stats["load_balance_loss"]

        saves = REMAT_SAVES[self.config.remat_policy]
        policy = jax.checkpoint_policies.save_only_these_names(*saves)
        return jax.checkpoint(layer, policy=policy, prevent_cse=False)

    def _loss(self, w, x_BSM, targets_BS):
        """Summed over the device's tokens: the final norm, the head and the float32
        cross-entropy, num_vocab_tiling tiles of tokens at a time (each rematerialised),
        the vocab split over the tensor axes."""
        lay, hidden = self.layout, self.layout.hidden
        tiles = max(self.config.num_vocab_tiling, 1)
        tied = self.config.logits_via_embedding
        head_name = "embedding" if tied else "head"
        logit_dtype = jnp.float32 if self.config.logits_dot_in_fp32 else self.dtype

        def body(x, targets, norm, head):
            norm = gather(norm.astype(self.dtype), lay.embed, 0)
            head = gather(head.astype(self.dtype), lay.embed, 1 if tied else 0)
            head_MV = head.T if tied else head
            h = _rms(x, norm).reshape(-1, x.shape[-1])
            if h.shape[0] % tiles:
                raise ValueError(f"num_vocab_tiling={tiles} does not divide a device's tokens")
            offset = jax.lax.axis_index(hidden) * head_MV.shape[1] if hidden else 0

            @jax.checkpoint
            def tile(total, xs):
                h_TM, t_T = xs
                # The head's matmul in the compute dtype unless logits_dot_in_fp32 (as
                # MaxText); the loss in float32 either way (its cast_logits_to_fp32).
                # XLA:TPU may fuse that cast into the dot (seen at tiny sizes: a float32
                # logits output either way), so false is counted, not compiled, here.
                logits = jnp.einsum(
                    "tm,mv->tv", h_TM, head_MV, preferred_element_type=logit_dtype
                ).astype(jnp.float32)
                top = jax.lax.stop_gradient(logits.max(-1))
                top = jax.lax.pmax(top, hidden) if hidden else top
                sums = jnp.exp(logits - top[:, None]).sum(-1)
                lse = jnp.log(self._sum_hidden(sums)) + top
                local = t_T - offset
                picked = jnp.take_along_axis(
                    logits, jnp.clip(local, 0, logits.shape[1] - 1)[:, None], axis=1
                )[:, 0]
                picked = self._sum_hidden(
                    jnp.where((local >= 0) & (local < logits.shape[1]), picked, 0.0)
                )
                return total + jnp.sum(lse - picked), None

            xs = (h.reshape(tiles, -1, h.shape[-1]), targets.reshape(tiles, -1))
            total, _ = jax.lax.scan(tile, jnp.zeros((), jnp.float32), xs)
            axes = self.moe_layout.token_axes
            return jax.lax.psum(total, axes) if axes else total

        in_specs = (
            self.moe_layout.x_BSM,
            lay.tokens,
            self.specs["final_norm"],
            self.specs[head_name],
        )
        fn = self._map(body, in_specs, P())
        return fn(x_BSM, targets_BS, w["final_norm"], w[head_name])

    def loss(self, w: dict, tokens_BS, targets_BS):
        """Mean cross-entropy over every token plus the MoE layers' load-balance loss."""
        x = self._embed(w["embedding"], tokens_BS)
        balance = jnp.zeros((), jnp.float32)
        if self.cycle:
            x, lb = jax.lax.scan(
                self._cycle(), x, (self._stack(w, "linear"), self._stack(w, "full"))
            )
            balance = balance + lb.sum()
        for kind in ("dense", "moe"):
            stack = self._stack(w, kind)
            if stack:
                x, lb = jax.lax.scan(self._layer(kind == "moe"), x, stack)
                balance = balance + lb.sum()
        total = self._loss(w, x, targets_BS)
        return total / tokens_BS.size + LOAD_BALANCE_WEIGHT * balance

    @staticmethod
    def _stack(w: dict, kind: str) -> dict:
        return {n.removeprefix(f"{kind}/"): v for n, v in w.items() if n.startswith(f"{kind}/")}

    def _cycle(self):
        """A Qwen3-Next cycle, scanned: its linear layers, then its full-attention one."""
        linear, full = self._layer(True, "linear"), self._layer(True)

        def cycle(x, stacks):
            # The linear layers scanned too, not unrolled: unrolled in the cycle's
            # body, XLA:GPU gathered the expert weights of all four layers at once (33
            # GiB of 1 GiB gathered matrices and their copies live at the peak of
            # Qwen3-Next's step on H200, where one layer's are counted).
            linear_w, full_w = stacks
            x, balance = jax.lax.scan(linear, x, linear_w)
            x, lb = full(x, full_w)
            return x, balance.sum() + lb

        return cycle

    def _gqa(self, h, g):
        cfg = self.config
        hd = cfg.head_dim
        q = _dot(h, g["attn/wq"], "query_proj")
        k = _dot(h, g["attn/wk"], "key_proj")
        v = _dot(h, g["attn/wv"], "value_proj")
        b, s = h.shape[:2]
        groups = k.shape[-1] // hd
        q = q.reshape(b, s, groups, q.shape[-1] // hd // groups, hd)
        k, v = k.reshape(b, s, groups, hd), v.reshape(b, s, groups, hd)
        if "attn/q_norm" in g:
            q, k = _rms(q, g["attn/q_norm"]), _rms(k, g["attn/k_norm"])
        return q, k, v

    def _mla(self, h, g):
        cfg = self.config
        nope, rope = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim
        if "attn/wq_a" in g:
            q = _dot(_rms(_dot(h, g["attn/wq_a"]), g["attn/q_norm"]), g["attn/wq_b"])
        else:
            q = _dot(h, g["attn/wq"])
        b, s = h.shape[:2]
        heads = q.shape[-1] // (nope + rope)
        q = checkpoint_name(q, "query_proj").reshape(b, s, heads, 1, nope + rope)
        kv_a = _dot(h, g["attn/wkv_a"])
        latent, k_rope = kv_a[..., : cfg.kv_lora_rank], kv_a[..., cfg.kv_lora_rank :]
        kv = _dot(_rms(latent, g["attn/kv_norm"]), g["attn/wkv_b"])
        kv = kv.reshape(b, s, heads, nope + cfg.v_head_dim)
        k_rope = jnp.broadcast_to(k_rope[:, :, None, :], (b, s, heads, rope))
        k = checkpoint_name(jnp.concatenate([kv[..., :nope], k_rope], axis=-1), "key_proj")
        v = checkpoint_name(kv[..., nope:], "value_proj")
        return q, k, v
