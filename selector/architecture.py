"""The whole decoder a config describes, counted parameter by parameter.

A pre-launch verdict has to speak for the model a user launches, not one MoE block: the
attention, the dense feed-forward layers, the embeddings and the output head hold
weights, gradients and optimizer state too. This module names every parameter tensor
of one decoder in MaxText's keys (the same keys its model files set) and counts them.
It knows three attention kinds:

- grouped-query attention (MaxText's default `attention_type: global`), optionally with
  per-head query/key norms (`use_qk_norm`, Qwen3);
- multi-head latent attention (`attention_type: mla`, DeepSeek-V3): low-rank query and
  key/value projections with their norms;
- Qwen3-Next's mix (`decoder_block: qwen3_next`): every
  `inhomogeneous_layer_cycle_interval`-th layer full attention whose query projection
  also yields an output gate, the others Gated DeltaNet linear attention.

Shapes follow the models' published configs (Hugging Face `config.json`) and MaxText
0.2.5's model files, read, not run. `params_active` counts what one token's forward
reads: every non-expert parameter (embedding and head included, as the published
"activated" figures of Mixtral, DeepSeek-V3 and Qwen3-30B-A3B do), and of each MoE layer
the router, the shared experts and `num_experts_per_tok` routed experts.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from .config import Config
from .problem import shared_width


@dataclass(frozen=True)
class LayerParams:
    """Parameter counts of one decoder layer, by part."""

    attention: int
    norms: int
    dense_ffn: int  # a dense SwiGLU (0 in an MoE layer)
    routed_experts: int  # every routed expert (0 in a dense layer)
    routed_active: int  # the experts one token goes through
    moe_other: int  # router, routed bias, shared experts and their gate
    full_attention: bool = True  # attends over the whole sequence (else Gated DeltaNet)
    moe: bool = False  # routes to experts

    @property
    def total(self) -> int:
        return self.attention + self.norms + self.dense_ffn + self.routed_experts + self.moe_other

    @property
    def active(self) -> int:
        return self.attention + self.norms + self.dense_ffn + self.routed_active + self.moe_other


def gqa_params(cfg: Config, *, gated: bool) -> int:
    """Grouped-query attention: query, key, value and output projections (the query
    twice as wide when it also yields a sigmoid output gate, Qwen3-Next), plus per-head
    query and key norms where the model has them."""
    emb, hd = cfg.base_emb_dim, cfg.head_dim
    q = emb * cfg.base_num_query_heads * hd * (2 if gated else 1)
    kv = 2 * emb * cfg.base_num_kv_heads * hd
    out = cfg.base_num_query_heads * hd * emb
    norms = 2 * hd if (cfg.use_qk_norm or gated) else 0
    return q + kv + out + norms


def mla_params(cfg: Config) -> int:
    """Multi-head latent attention (DeepSeek-V2/V3): the query through a low-rank
    bottleneck with a norm (or one projection when q_lora_rank is 0), keys and values
    from one shared latent of kv_lora_rank plus a decoupled rotary key, and the output
    projection from the value heads."""
    emb, heads = cfg.base_emb_dim, cfg.base_num_query_heads
    qk_head = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    if cfg.q_lora_rank > 0:
        q = emb * cfg.q_lora_rank + cfg.q_lora_rank + cfg.q_lora_rank * heads * qk_head
    else:
        q = emb * heads * qk_head
    kv_a = emb * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) + cfg.kv_lora_rank
    kv_b = cfg.kv_lora_rank * heads * (cfg.qk_nope_head_dim + cfg.v_head_dim)
    out = heads * cfg.v_head_dim * emb
    return q + kv_a + kv_b + out


def gated_delta_net_params(cfg: Config) -> int:
    """Qwen3-Next's linear attention (Gated DeltaNet): one input projection to queries,
    keys, values and the output gate, one to the per-head beta and decay, a depthwise
    causal convolution over queries, keys and values, per-head decay and step biases, a
    norm over the value head, and the output projection."""
    emb = cfg.base_emb_dim
    keys = cfg.gdn_num_key_heads * cfg.gdn_key_head_dim
    values = cfg.gdn_num_value_heads * cfg.gdn_value_head_dim
    qkvz = emb * (2 * keys + 2 * values)
    beta_decay = emb * 2 * cfg.gdn_num_value_heads
    conv = (2 * keys + values) * cfg.gdn_conv_kernel_dim
    per_head = 2 * cfg.gdn_num_value_heads  # A_log and dt_bias
    return qkvz + beta_decay + conv + per_head + cfg.gdn_value_head_dim + values * emb


def is_qwen3_next(cfg: Config) -> bool:
    return cfg.decoder_block == "qwen3_next"


def is_full_attention(cfg: Config, layer: int) -> bool:
    """Whether decoder layer `layer` (0-based) attends over the whole sequence: every
    layer, except in Qwen3-Next, where the last of each cycle of
    inhomogeneous_layer_cycle_interval layers does and the others are linear."""
    if not is_qwen3_next(cfg):
        return True
    return (layer + 1) % max(cfg.inhomogeneous_layer_cycle_interval, 1) == 0


def attention_params(cfg: Config, layer: int) -> int:
    """The attention of decoder layer `layer` (0-based)."""
    if cfg.attention_type == "mla":
        return mla_params(cfg)
    if not is_full_attention(cfg, layer):
        return gated_delta_net_params(cfg)
    return gqa_params(cfg, gated=is_qwen3_next(cfg))


def is_moe_layer(cfg: Config, layer: int) -> bool:
    """Whether decoder layer `layer` routes to experts (MaxText: the first
    first_num_dense_layers are dense; after them every interleave_moe_layer_step-th)."""
    if cfg.num_experts <= 1 or layer < cfg.first_num_dense_layers:
        return False
    step = max(cfg.interleave_moe_layer_step, 1)
    return (layer - cfg.first_num_dense_layers + 1) % step == 0


def moe_parts(cfg: Config) -> tuple[int, int, int]:
    """(every routed expert, the routed experts one token uses, the rest of the block:
    router kernel, routed bias, shared experts and their gate)."""
    emb, hidden = cfg.base_emb_dim, cfg.base_moe_mlp_dim
    expert = 3 * emb * hidden
    shared = 3 * emb * int(shared_width(cfg.shared_experts, hidden, cfg.shared_expert_gate))
    other = emb * cfg.num_experts + shared
    other += cfg.num_experts if cfg.routed_bias else 0
    other += emb if (cfg.shared_expert_gate and cfg.shared_experts > 0) else 0
    return cfg.num_experts * expert, cfg.num_experts_per_tok * expert, other


def layer_params(cfg: Config, layer: int) -> LayerParams:
    attention = attention_params(cfg, layer)
    norms = 2 * cfg.base_emb_dim  # before the attention and before the feed-forward
    full = is_full_attention(cfg, layer)
    if is_moe_layer(cfg, layer):
        routed, active, other = moe_parts(cfg)
        return LayerParams(attention, norms, 0, routed, active, other, full, moe=True)
    dense = 3 * cfg.base_emb_dim * cfg.base_mlp_dim
    return LayerParams(attention, norms, dense, 0, 0, 0, full, moe=False)


@dataclass(frozen=True)
class ModelParams:
    """Parameter counts of the whole decoder."""

    embedding: int
    head: int  # 0 when the logits reuse the embedding (logits_via_embedding)
    final_norm: int
    attention: int
    norms: int
    dense_ffn: int
    routed_experts: int
    moe_other: int
    active_routed: int
    moe_layers: int
    dense_layers: int
    # Each decoder layer in order: what the step's memory and time count per layer read
    # here, so the config is walked once.
    layers: tuple[LayerParams, ...] = field(default=(), repr=False)

    @property
    def full_attention_layers(self) -> tuple[LayerParams, ...]:
        return tuple(layer for layer in self.layers if layer.full_attention)

    @property
    def total(self) -> int:
        return (
            self.embedding
            + self.head
            + self.final_norm
            + self.attention
            + self.norms
            + self.dense_ffn
            + self.routed_experts
            + self.moe_other
        )

    @property
    def active(self) -> int:
        return self.total - self.routed_experts + self.active_routed

    @property
    def non_expert(self) -> int:
        """Everything but the routed experts and the MoE blocks' own small parts (the
        parameters whose placement is not the experts')."""
        return self.total - self.routed_experts - self.moe_other

    def as_dict(self) -> dict:
        d = asdict(self)
        del d["layers"]
        d["params_total"] = self.total
        d["params_active"] = self.active
        return d


def model_params(cfg: Config) -> ModelParams:
    """Count every parameter of the decoder `cfg` describes."""
    layers = [layer_params(cfg, i) for i in range(cfg.base_num_decoder_layers)]
    embedding = cfg.vocab_size * cfg.base_emb_dim
    moe = sum(1 for p in layers if p.moe)
    return ModelParams(
        embedding=embedding,
        head=0 if cfg.logits_via_embedding else embedding,
        final_norm=cfg.base_emb_dim,
        attention=sum(p.attention for p in layers),
        norms=sum(p.norms for p in layers),
        dense_ffn=sum(p.dense_ffn for p in layers),
        routed_experts=sum(p.routed_experts for p in layers),
        moe_other=sum(p.moe_other for p in layers),
        active_routed=sum(p.routed_active for p in layers),
        moe_layers=moe,
        dense_layers=cfg.base_num_decoder_layers - moe,
        layers=tuple(layers),
    )
