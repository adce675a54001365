"""What a device holds for the whole step, counted from the tensors the step keeps.

The MoE block's own program is estimated in `cost`; this module adds everything else a
training (or serving) step of the whole decoder holds, from shapes and dtypes alone:

- at rest: every parameter in param_dtype (MaxText's weight_dtype), a copy of the layers'
  weights in the compute dtype when that differs (XLA converts the scanned weights once,
  outside the layer loop), its gradient in param_dtype and the optimizer's moments
  (optimizer_bytes_per_param), split the way the
  weights rest: the experts by their placement (`cost.state_bytes`), every other weight
  over all mesh axes but the data axes (MaxText's rules shard `embed` over fsdp, the
  context axes and expert, and heads, mlp and vocab over tensor); the KV cache when
  serving;
- saved across layers for the backward: the layer inputs the scan carries (always kept:
  MaxText's `decoder_layer_input`) and the named projections the remat policy saves
  (MaxText 0.2.5's `get_remat_policy`, read in layers/nnx_decoders.py);
- the largest transient: the loss's float32 logits and their gradient over the vocabulary,
  num_vocab_tiling chunks of the tokens at a time; or one layer's backward, which
  rematerialises the layer: its attention (the weights gathered in the compute dtype and
  their float32 gradient before the reduce-scatter, queries, keys and values gathered
  over the sequence shards, the output and the cotangents of each) plus its feed-forward
  (the MoE block's program from `cost`, or a dense SwiGLU's).

Attention is counted as a flash kernel computes it (no sequence x sequence scores), as
MaxText runs it on TPU and GPU. Nothing here is fitted: no coefficient is read.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from .architecture import (
    attention_params,
    is_full_attention,
    is_moe_layer,
    is_qwen3_next,
    model_params,
)
from .config import DTYPE_BYTES, Config, Mode
from .mesh import MeshView
from .per_device import PerDevice

# MaxText 0.2.5's remat policies (layers/nnx_decoders.py, get_remat_policy): the
# checkpoint names each saves on the device. Offloading policies keep nothing there.
_PROJECTIONS = ("query_proj", "key_proj", "value_proj")
_MLP = ("mlpwi_0", "mlpwi_1", "mlpwo")
REMAT_SAVES: dict[str, tuple[str, ...]] = {
    "full": (),
    "minimal": (*_PROJECTIONS, "out_proj", *_MLP),
    "minimal_with_context": (*_PROJECTIONS, "out_proj", *_MLP, "context"),
    "minimal_flash": (*_PROJECTIONS, "out_proj", *_MLP, "context"),
    "save_dot_with_context_except_mlp": (*_PROJECTIONS, "context", "out_proj"),
    "save_dot_except_mlpwi": (*_PROJECTIONS, "out_proj", "mlpwo"),
    "save_dot_except_mlp": (*_PROJECTIONS, "out_proj"),
    "save_qkv_proj": _PROJECTIONS,
    "save_out_proj": ("out_proj",),
    "qkv_proj_offloaded": (),  # offloaded to the host: nothing stays on the device
    "minimal_offloaded": (),
}
# From least saved (most recompute) to most: the order a fix walks to save memory.
REMAT_BY_MEMORY = (
    "full",
    "save_out_proj",
    "save_qkv_proj",
    "save_dot_except_mlp",
    "save_dot_with_context_except_mlp",
    "save_dot_except_mlpwi",
    "minimal",
    "minimal_with_context",
)
LOGIT_BYTES = 4  # MaxText computes the logits and the loss in float32
# The parts of `StepMemory.breakdown`, in the order reports show them.
STEP_PARTS = (
    "weights",
    "weights_cast",
    "gradients",
    "optimizer",
    "kv_cache",
    "saved_activations",
    "logits",
    "attention_peak",
    "moe_block",
    "dense_ffn_peak",
)


@dataclass(frozen=True)
class StepMemory:
    """Bytes one device holds for the step, apart from the MoE block's own program."""

    weights: float  # every parameter at rest (the MoE layers' by their placement)
    # The layers' weights in the compute dtype, when stored in another: XLA converts the
    # scanned layers' stacked weights once, outside the layer loop, and holds the copy
    # through the step (read in MaxText 0.2.5's compiled step: 6.96 GiB of bf16 copies of
    # the float32 layer weights for Qwen3-30B-A3B on 8 v5p chips).
    weights_cast: float
    gradients: float
    optimizer: float
    kv_cache: float  # serving: keys and values (or MLA's latent) of every attention layer
    saved_activations: float  # kept across layers for the backward
    logits: float  # the loss's logits (and gradient when training), one vocab tile
    attention_peak: float  # one layer's attention at its backward (forward when serving)
    dense_ffn_peak: float  # one dense feed-forward layer's working set (0 without one)

    @property
    def at_rest(self) -> float:
        return self.weights + self.weights_cast + self.gradients + self.optimizer + self.kv_cache

    def total(self, moe_block: float) -> float:
        """The step's peak, given the MoE block's transient bytes (its program less
        the weights and gradients that rest)."""
        layer = self.attention_peak + max(moe_block, self.dense_ffn_peak)
        return self.at_rest + self.saved_activations + max(self.logits, layer)

    def breakdown(self, moe_block: float) -> dict:
        d = asdict(self)
        d["moe_block"] = moe_block
        d["total"] = self.total(moe_block)
        return d


def non_expert_shards(mesh: MeshView) -> int:
    """Devices a non-expert weight is split over: every axis but the data axes."""
    axes = set(mesh.embed_axes) | set(mesh.hidden_axes) | set(mesh.expert_axes)
    return mesh.product(sorted(axes))


def named_activations(cfg: Config, layer: int) -> dict[str, float]:
    """Elements per token of each checkpoint name decoder layer `layer` can save."""
    hq, hkv, hd = cfg.base_num_query_heads, cfg.base_num_kv_heads, cfg.head_dim
    if cfg.attention_type == "mla":
        qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
        names = {"query_proj": hq * qk, "key_proj": hq * qk, "value_proj": hq * cfg.v_head_dim}
        names["context"] = hq * cfg.v_head_dim
    elif not is_full_attention(cfg, layer):
        # A Gated DeltaNet layer: its projections carry no checkpoint names in MaxText
        # 0.2.5; its output projection is the layer's out_proj.
        names = {}
    else:
        names = {"query_proj": hq * hd, "key_proj": hkv * hd, "value_proj": hkv * hd}
        names["context"] = hq * hd
    names["out_proj"] = cfg.base_emb_dim
    if not is_moe_layer(cfg, layer):
        names.update(mlpwi_0=cfg.base_mlp_dim, mlpwi_1=cfg.base_mlp_dim, mlpwo=cfg.base_emb_dim)
    return names


def saved_per_token(cfg: Config) -> float:
    """Elements per token every layer keeps for the backward: its input, and what the
    remat policy saves."""
    saves = REMAT_SAVES[cfg.remat_policy]
    total = 0.0
    for layer in range(cfg.base_num_decoder_layers):
        named = named_activations(cfg, layer)
        total += cfg.base_emb_dim + sum(named.get(name, 0) for name in saves)
    return total


def kv_per_token(cfg: Config) -> float:
    """Cache elements per token over every full-attention layer."""
    if cfg.attention_type == "mla":
        per_layer = cfg.kv_lora_rank + cfg.qk_rope_head_dim
    else:
        per_layer = 2 * cfg.base_num_kv_heads * cfg.head_dim
    layers = cfg.base_num_decoder_layers
    if is_qwen3_next(cfg):
        layers //= max(cfg.inhomogeneous_layer_cycle_interval, 1)
    return per_layer * layers


def layer_working_set(weights: float, activations: float, xb: int, train: bool) -> float:
    """One layer's bytes at its peak: its `weights` (elements a device gathers) in the
    compute dtype, and its `activations` (bytes); training adds the weights' float32
    gradient before the reduce-scatter and a cotangent of each activation."""
    if not train:
        return weights * xb + activations
    return weights * (xb + 4) + 2 * activations


def attention_peak(cfg: Config, mesh: MeshView, tokens: float, train: bool) -> float:
    """One layer's attention working set: its weights gathered in the compute dtype
    (and their float32 gradient before the reduce-scatter, training); queries and
    output for the device's tokens, keys and values for every sequence shard's tokens
    (context parallelism all-gathers them); their cotangents when training."""
    xb = DTYPE_BYTES.get(cfg.dtype, 4)
    hidden = mesh.product(mesh.hidden_axes)
    layers = range(cfg.base_num_decoder_layers)
    weights = max((attention_params(cfg, i) for i in layers), default=0) / hidden
    full = next((i for i in layers if is_full_attention(cfg, i)), 0)
    named = named_activations(cfg, full)
    q = named.get("query_proj", 0) + named.get("context", 0) + cfg.base_emb_dim
    kv = (named.get("key_proj", 0) + named.get("value_proj", 0)) * mesh.cp
    return layer_working_set(weights, tokens * (q + kv) / hidden * xb, xb, train)


def dense_ffn_peak(cfg: Config, mesh: MeshView, tokens: float, train: bool) -> float:
    """One dense SwiGLU layer's working set (0 when every layer is an MoE layer)."""
    if not any(not is_moe_layer(cfg, i) for i in range(cfg.base_num_decoder_layers)):
        return 0.0
    xb = DTYPE_BYTES.get(cfg.dtype, 4)
    hidden = mesh.product(mesh.hidden_axes)
    weights = 3 * cfg.base_emb_dim * cfg.base_mlp_dim / hidden
    acts = tokens * (3 * cfg.base_mlp_dim / hidden + cfg.base_emb_dim) * xb
    return layer_working_set(weights, acts, xb, train)


def step_memory(
    cfg: Config, mesh: MeshView, dev: PerDevice, moe_state: float, moe_weights: float
) -> StepMemory:
    """The step's memory outside the MoE block's program. `moe_state`: every MoE layer's
    weights, gradients and optimizer state at rest (`cost.state_bytes`); `moe_weights`:
    of those, the weights alone."""
    train = cfg.mode is Mode.train
    xb, pb = DTYPE_BYTES.get(cfg.dtype, 4), DTYPE_BYTES.get(cfg.param_dtype, 4)
    params = model_params(cfg)
    # The MoE blocks' parameters are counted by their placement, in moe_state.
    other = (params.total - params.routed_experts - params.moe_other) / non_expert_shards(mesh)
    # Of those, the ones inside the scanned layers (not the embedding, head, final norm).
    outside = params.embedding + params.head + params.final_norm
    layer_other = other - outside / non_expert_shards(mesh)
    cast = (layer_other * xb + moe_weights / pb * xb) if cfg.param_dtype != cfg.dtype else 0.0
    moe_grads = moe_weights if train else 0.0
    tokens = dev.tokens_per_device
    hidden = mesh.product(mesh.hidden_axes)
    logit_tokens = tokens / max(cfg.num_vocab_tiling, 1)
    kv_cache = 0.0
    if not train:  # the cache of every sequence this device serves, split over cp
        cached = dev.local_batch * cfg.max_target_length / max(mesh.cp, 1)
        kv_cache = cached * kv_per_token(cfg) * xb
    return StepMemory(
        weights=other * pb + moe_weights,
        weights_cast=cast,
        gradients=(other * pb + moe_grads) if train else 0.0,
        optimizer=(
            other * cfg.optimizer_bytes_per_param + moe_state - moe_weights - moe_grads
            if train
            else 0.0
        ),
        kv_cache=kv_cache,
        saved_activations=tokens * saved_per_token(cfg) * xb if train else 0.0,
        logits=logit_tokens * cfg.vocab_size / hidden * LOGIT_BYTES * (2 if train else 1),
        attention_peak=attention_peak(cfg, mesh, tokens, train),
        dense_ffn_peak=dense_ffn_peak(cfg, mesh, tokens, train),
    )
