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
- the largest transient: the loss's logits and their gradient over the vocabulary, in
  the head matmul's dtype (float32 with logits_dot_in_fp32, else the compute dtype: the
  float32 cast MaxText's loss takes fuses into its reductions), num_vocab_tiling chunks
  of the tokens at a time; or one layer's backward, which
  rematerialises the layer: its attention (the weights gathered in the compute dtype and
  their float32 gradient before the reduce-scatter, queries, keys and values gathered
  over the sequence shards, the output and the cotangents of each) plus its feed-forward
  (the MoE block's program from `cost`, or a dense SwiGLU's), beside the logits'
  gradient where the compiler keeps it live through the layers' backward (XLA:TPU
  under context parallelism: `Traits.logits_gradient_held_from_cp`);
- on a compiler that gathers a tensor whole over every device of a large slice by an
  all-reduce (`Traits.all_reduce_gather_devices`), one more buffer the size of the
  largest tensor so gathered, which the program holds beside its named buffers.

Attention is counted as a flash kernel computes it (no sequence x sequence scores), as
MaxText runs it on TPU and GPU. Qwen3-Next's Gated DeltaNet layers are counted from the
arrays MaxText's chunked delta rule keeps for its backward (`gdn_bytes_per_token`); a
layer's attention peak is the larger of the two kinds'. Nothing here is fitted: no
coefficient is read.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from .architecture import LayerParams, ModelParams, model_params
from .config import DTYPE_BYTES, Config, ContextStrategy, Dispatch, Exchange, Mode
from .memory_model import gathers_by_all_reduce, within_one_slice
from .mesh import MeshView
from .per_device import PerDevice
from .plan_sizes import shared_width
from .traits import jax_release, traits

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
# MaxText 0.2.5's base.yml gdn_chunk_size: the Gated DeltaNet's chunk of tokens (the
# config has no key for it).
GDN_CHUNK_SIZE = 64
# The parts of `StepMemory.breakdown`, in the order reports show them.
STEP_PARTS = (
    "weights",
    "weights_cast",
    "gradients",
    "optimizer",
    "kv_cache",
    "saved_activations",
    "logits",
    "logits_gradient_held",
    "attention_peak",
    "moe_block",
    "dense_ffn_peak",
    "all_reduce_copy",
)


@dataclass(frozen=True)
class StepMemory:
    """Bytes one device holds for the step, apart from the MoE block's own program."""

    weights: float  # every parameter at rest (the MoE layers' by their placement)
    # The layers' weights once more. In the compute dtype, when stored in another: XLA
    # converts the scanned layers' stacked weights once, outside the layer loop, and holds
    # the copy through the step (read in MaxText 0.2.5's compiled step: 6.96 GiB of bf16
    # copies of the float32 layer weights for Qwen3-30B-A3B on 8 v5p chips). Except the
    # expert matrices XLA:GPU gathers along a dimension that is not their leading one:
    # those it copies whole, in their stored dtype, into the layout its all-gather needs
    # (`moe_relaid`), and does not cast them.
    weights_cast: float
    gradients: float
    optimizer: float
    kv_cache: float  # serving: keys and values (or MLA's latent) of every attention layer
    saved_activations: float  # kept across layers for the backward
    logits: float  # the loss's logits (and gradient when training), one vocab tile
    # Of those, the gradient, where the compiler keeps it live through the layers'
    # backward (`Traits.logits_gradient_held_from_cp`; else 0).
    logits_gradient_held: float
    attention_peak: float  # one layer's attention at its backward (forward when serving)
    dense_ffn_peak: float  # one dense feed-forward layer's working set (0 without one)
    # The buffer an all-reduce that gathers a tensor whole leaves (0 where none does).
    all_reduce_copy: float = 0.0

    @property
    def at_rest(self) -> float:
        return self.weights + self.weights_cast + self.gradients + self.optimizer + self.kv_cache

    def total(self, moe_block: float) -> float:
        """The step's peak, given the MoE block's transient bytes (its program less
        the weights and gradients that rest)."""
        layer = self.attention_peak + max(moe_block, self.dense_ffn_peak)
        peak = max(self.logits, self.logits_gradient_held + layer)
        return self.at_rest + self.saved_activations + peak + self.all_reduce_copy

    def breakdown(self, moe_block: float) -> dict:
        d = asdict(self)
        d["moe_block"] = moe_block
        d["total"] = self.total(moe_block)
        return d


def non_expert_shards(mesh: MeshView) -> int:
    """Devices a non-expert weight is split over: every axis but the data axes."""
    axes = set(mesh.embed_axes) | set(mesh.hidden_axes) | set(mesh.expert_axes)
    return mesh.product(sorted(axes))


def largest_other_matrix(cfg: Config, params: ModelParams) -> int:
    """Elements of the largest weight outside the MoE blocks: the embedding (the head, when
    apart, is its size) or one matrix of a dense layer's SwiGLU (an attention projection
    is smaller than the embedding in every preset: 25 M elements at most, against 131 M
    and more)."""
    dense = cfg.base_emb_dim * cfg.base_mlp_dim if params.dense_layers else 0
    return max(params.embedding, dense)


def named_activations(cfg: Config, layer: LayerParams) -> dict[str, float]:
    """Elements per token of each checkpoint name a decoder layer (`layer`, one of
    `ModelParams.layers`) can save."""
    hq, hkv, hd = cfg.base_num_query_heads, cfg.base_num_kv_heads, cfg.head_dim
    if cfg.attention_type == "mla":
        qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
        names = {"query_proj": hq * qk, "key_proj": hq * qk, "value_proj": hq * cfg.v_head_dim}
        names["context"] = hq * cfg.v_head_dim
    elif not layer.full_attention:
        # A Gated DeltaNet layer: its projections carry no checkpoint names in MaxText
        # 0.2.5; its output projection is the layer's out_proj.
        names = {}
    else:
        names = {"query_proj": hq * hd, "key_proj": hkv * hd, "value_proj": hkv * hd}
        names["context"] = hq * hd
    names["out_proj"] = cfg.base_emb_dim
    if not layer.moe:
        names.update(mlpwi_0=cfg.base_mlp_dim, mlpwi_1=cfg.base_mlp_dim, mlpwo=cfg.base_emb_dim)
    elif cfg.moe_checkpoint_names and cfg.dispatch is Dispatch.megablox:
        # MaxText's sparse path: per routed row (k a token) the gate projection and the
        # down projection's output before the combine; the shared experts per token.
        # Exchanged, the rows are its receive buffer's: expert_buffer_factor times the
        # rows a device sends, which the MaxText route sets to MaxText's multiple
        # (`maxtext.importer.as_maxtext_exchanges`; its train_compile for
        # qwen3-next-80b-a3b at EP 16 held 370 GB of temporaries).
        k, emb = cfg.num_experts_per_tok, cfg.base_emb_dim
        if cfg.expert_exchange is Exchange.all_to_all:
            k *= cfg.expert_buffer_factor
        shared = shared_width(cfg.shared_experts, cfg.base_moe_mlp_dim, cfg.shared_expert_gate)
        names["mlpwi_0"] = k * cfg.base_moe_mlp_dim + shared
        names["mlpwo"] = k * emb + (emb if shared else 0)
        if shared:
            names["mlpwi_1"] = shared
    return names


def saved_per_token(cfg: Config, params: ModelParams) -> float:
    """Elements per token every layer of `params` (`model_params(cfg)`) keeps for the
    backward: its input, and what the remat policy saves."""
    saves = REMAT_SAVES[cfg.remat_policy]
    total = 0.0
    for layer in params.layers:
        named = named_activations(cfg, layer)
        total += cfg.base_emb_dim + sum(named.get(name, 0) for name in saves)
    return total


def kv_per_token(cfg: Config, params: ModelParams) -> float:
    """Cache elements per token over every full-attention layer of `params`."""
    if cfg.attention_type == "mla":
        per_layer = cfg.kv_lora_rank + cfg.qk_rope_head_dim
    else:
        per_layer = 2 * cfg.base_num_kv_heads * cfg.head_dim
    return per_layer * len(params.full_attention_layers)


def layer_working_set(weights: float, activations: float, xb: int, train: bool) -> float:
    """One layer's bytes at its peak: its `weights` (elements a device gathers) in the
    compute dtype, and its `activations` (bytes); training adds the weights' float32
    gradient before the reduce-scatter and a cotangent of each activation."""
    if not train:
        return weights * xb + activations
    return weights * (xb + 4) + 2 * activations


def gdn_bytes_per_token(cfg: Config, cp: int, train: bool) -> float:
    """Bytes a token of one Gated DeltaNet layer holds at the layer's peak, all heads
    (the caller splits them over the hidden axes).

    Training: the layer is rematerialised (remat_policy=full keeps only its input), so
    its backward first recomputes the forward and holds what JAX saves for the
    backward. Counted from MaxText 0.2.5's models/qwen3.py (Qwen3NextGatedDeltaNet.
    __call__ and jax_chunk_gated_delta_rule) and layers/normalizations.py
    (Qwen3NextRMSNormGated, RMSNorm), and checked against the residual list
    `jax.ad_checkpoint.saved_residuals` gives for them: each value once (a reshape,
    squeeze or transpose of a counted value is that value), leaving out the constant
    masks and arrays of a head or less a token (gates, decays, norm statistics).
    Added: the cotangents the chunk scan's backward emits (of its w, u, q, k inputs)
    and takes (of its float32 output), which live while the saved arrays do. Not
    counted: padding of the 64-wide chunk dimension to TPU tiles (more bytes), nor
    XLA fusing a saved elementwise value into its consumer instead (fewer).

    Serving runs the forward alone: counted at the chunk scan, where the layer's
    input, the gate z, the scan's inputs and its float32 output are live."""
    xb, f32 = DTYPE_BYTES.get(cfg.dtype, 4), 4
    chunk = GDN_CHUNK_SIZE
    hv, dk, dv = cfg.gdn_num_value_heads, cfg.gdn_key_head_dim, cfg.gdn_value_head_dim
    k = cfg.gdn_num_key_heads * dk  # queries or keys as projected
    v = hv * dv  # values, the gate z, the core output
    kr = hv * dk  # queries or keys repeated to the value heads (jnp.repeat)
    conv = 2 * k + v  # the convolved queries, keys and values
    hc = hv * chunk  # a chunk's C x C matrices: a row of C a head, per token
    state = hv * dk * dv / chunk  # a chunk's Dk x Dv state a head, per token
    emb = cfg.base_emb_dim
    if not train:
        # scan inputs w, u, q, k (compute dtype); its output o_chunks (float32); z.
        return xb * (emb + 3 * kr + v + v) + f32 * v
    # Qwen3NextGatedDeltaNet.__call__: in_proj_qkvz's input; conv1d's input (the
    # padded concatenation of q, k, v); its output in float32 and silu's two saved
    # values; the repeated query and key the delta rule's l2norm reads.
    call = xb * emb + xb * conv + 3 * f32 * conv + 2 * xb * kr
    # Qwen3NextRMSNormGated over the core output: RMSNorm's float32 input, its square's
    # derivative (2x) and normalised output, the scaled output; the gate z in float32
    # and silu's two saved values; then out_proj's input (compute dtype).
    call += 6 * f32 * v + xb * v
    # jax_chunk_gated_delta_rule, stage 2 (before the scan): the chunked normalised
    # keys and k_beta; v_c; S = k_beta k^T in float32, the masked decay differences,
    # their exp and the masked S; solve_triangular's three (I + S, its lower triangle
    # and the inverse A); v_beta and k_beta in float32, and k_beta * exp(g_cumsum).
    pre = 2 * xb * kr + xb * v + 7 * f32 * hc + f32 * v + 2 * f32 * kr
    # Stage 3, scan_body, each stacked over the chunks: q in float32, q_g, w in
    # float32, k in float32 and k_i_g_diff; q and k (compute dtype) for the
    # intra-chunk q k^T; attn, exp(g_diff) and attn_i (C x C); v_new; the state h.
    scan = 5 * f32 * kr + 2 * xb * kr + 3 * f32 * hc + f32 * v + f32 * state
    # The scan's backward: cotangents of w, u, q, k (compute dtype) and of o_chunks.
    cot = xb * (3 * kr + v) + f32 * v
    total = call + pre + scan + cot
    if cp > 1:
        # kernels/attention/gdn_cp.py, compose_local: its checkpointed scan body keeps
        # the carried affine map (A: Dk x Dk, B: Dk x Dv, float32) and its inputs w,
        # k, u for every chunk. (incoming_state's log2(cp) exchanged pairs are a few
        # Dk x Dk matrices a head, per layer, not per token: left out.)
        total += f32 * hv * dk * (dk + dv) / chunk + xb * (2 * kr + v)
    return total


def attention_peak(
    cfg: Config, mesh: MeshView, tokens: float, train: bool, params: ModelParams
) -> float:
    """One layer's attention working set, the larger over the attention kinds the
    decoder has. Full attention: its weights gathered in the compute dtype (and their
    float32 gradient before the reduce-scatter, training); queries and output for the
    device's tokens, keys and values for every sequence shard's tokens (context
    parallelism all-gathers them; `gathered_shards` for the other strategies); their
    cotangents when training. Gated DeltaNet: its
    weights likewise, and `gdn_bytes_per_token` for the device's tokens (its sequence
    stays sharded)."""
    xb = DTYPE_BYTES.get(cfg.dtype, 4)
    hidden = mesh.product(mesh.hidden_axes)
    full = params.full_attention_layers or params.layers[:1]
    weights = max(layer.attention for layer in full) / hidden
    named = named_activations(cfg, full[0])
    q = named.get("query_proj", 0) + named.get("context", 0) + cfg.base_emb_dim
    kv = (named.get("key_proj", 0) + named.get("value_proj", 0)) * gathered_shards(cfg, mesh)
    peak = layer_working_set(weights, tokens * (q + kv) / hidden * xb, xb, train)
    linear = [layer for layer in params.layers if not layer.full_attention]
    if linear:  # Gated DeltaNet layers
        gdn = layer_working_set(linear[0].attention / hidden, 0.0, xb, train)
        gdn += tokens * gdn_bytes_per_token(cfg, mesh.cp, train) / hidden
        peak = max(peak, gdn)
    return peak


def gathered_shards(cfg: Config, mesh: MeshView) -> int:
    """Sequence shards' keys and values a device holds at once in one attention layer,
    by MaxText's context_parallel_strategy: every shard's when all-gathered; its own and
    the one arriving round a ring; under Ulysses the whole sequence for 1/cp of the
    heads, the same bytes as its own shard (usp: Ulysses over context_usp_ulysses, the
    other context axes all-gathered)."""
    strategy = cfg.context_parallel_strategy
    if strategy is ContextStrategy.ring:
        return min(mesh.cp, 2)
    if strategy is ContextStrategy.ulysses:
        return 1
    if strategy is ContextStrategy.usp:
        return mesh.cp // max(mesh.size("context_usp_ulysses"), 1)
    return mesh.cp


def dense_ffn_peak(
    cfg: Config, mesh: MeshView, tokens: float, train: bool, params: ModelParams
) -> float:
    """One dense SwiGLU layer's working set (0 when every layer is an MoE layer)."""
    if not params.dense_layers:
        return 0.0
    xb = DTYPE_BYTES.get(cfg.dtype, 4)
    hidden = mesh.product(mesh.hidden_axes)
    weights = 3 * cfg.base_emb_dim * cfg.base_mlp_dim / hidden
    acts = tokens * (3 * cfg.base_mlp_dim / hidden + cfg.base_emb_dim) * xb
    return layer_working_set(weights, acts, xb, train)


@dataclass(frozen=True)
class StepOutside:
    """What the step holds outside the MoE blocks, the same for every candidate: counted
    once per config (`step_outside`), then joined with each candidate's MoE state
    (`step_memory`)."""

    train: bool
    compute_bytes: int  # an element in the compute dtype
    param_bytes: int  # an element in the weights' stored dtype
    optimizer_bytes_per_param: float
    other_params: float  # the parameters outside the MoE blocks a device holds
    layer_other_params: float  # of those, the ones inside the scanned layers
    kv_cache: float
    saved_activations: float
    logits: float
    logits_gradient_held: float
    attention_peak: float
    dense_ffn_peak: float
    # The largest weight outside the MoE blocks in the compute dtype, where the compiler
    # gathers it whole by an all-reduce (`gathers_by_all_reduce`; else 0).
    all_reduce_other: float = 0.0

    @property
    def recast(self) -> bool:
        """Whether the weights are stored in another dtype than they compute in."""
        return self.param_bytes != self.compute_bytes


def step_outside(cfg: Config, mesh: MeshView, dev: PerDevice) -> StepOutside:
    """The step's bytes outside the MoE blocks (see `StepMemory`), for one config."""
    train = cfg.mode is Mode.train
    xb, pb = DTYPE_BYTES.get(cfg.dtype, 4), DTYPE_BYTES.get(cfg.param_dtype, 4)
    params = model_params(cfg)
    # The MoE blocks' parameters are counted by their placement, in moe_state.
    other = (params.total - params.routed_experts - params.moe_other) / non_expert_shards(mesh)
    # Of those, the ones inside the scanned layers (not the embedding, head, final norm).
    outside = params.embedding + params.head + params.final_norm
    tokens = dev.tokens_per_device
    hidden = mesh.product(mesh.hidden_axes)
    logit_tokens = tokens / max(cfg.num_vocab_tiling, 1)
    logit_bytes = 4 if cfg.logits_dot_in_fp32 else xb
    compiler = traits(cfg.hardware.platform, jax_release(cfg.hardware.jax_version))
    # One vocabulary tile of logits on a device, in elements: held in the head's dtype
    # (with their gradient when training); the gradient alone, where the compiler keeps
    # it, in the compute dtype.
    logit_elements = logit_tokens * cfg.vocab_size / hidden
    # The logits' gradient outlives the loss where the compiler keeps it under context
    # parallelism, on one slice where it all-gathers the weights (not where it gathers
    # them by an all-reduce: measured at 64 chips, none held; across slices not
    # measured, not held), in the compute dtype whatever the head's; tiled logits never
    # hold a whole gradient (both measured).
    held_from = compiler.logits_gradient_held_from_cp
    all_reduce = gathers_by_all_reduce(compiler, mesh, other_gathered(mesh))
    held = train and held_from and mesh.cp >= held_from and not all_reduce
    held = held and within_one_slice(mesh) and cfg.num_vocab_tiling <= 1
    kv_cache = 0.0
    if not train:  # the cache of every sequence this device serves, split over cp
        cached = dev.local_batch * cfg.max_target_length / max(mesh.cp, 1)
        kv_cache = cached * kv_per_token(cfg, params) * xb
    return StepOutside(
        train=train,
        compute_bytes=xb,
        param_bytes=pb,
        optimizer_bytes_per_param=cfg.optimizer_bytes_per_param,
        other_params=other,
        layer_other_params=other - outside / non_expert_shards(mesh),
        kv_cache=kv_cache,
        saved_activations=tokens * saved_per_token(cfg, params) * xb if train else 0.0,
        logits=logit_elements * logit_bytes * (2 if train else 1),
        logits_gradient_held=logit_elements * xb if held else 0.0,
        attention_peak=attention_peak(cfg, mesh, tokens, train, params),
        dense_ffn_peak=dense_ffn_peak(cfg, mesh, tokens, train, params),
        all_reduce_other=largest_other_matrix(cfg, params) * xb if all_reduce else 0.0,
    )


def other_gathered(mesh: MeshView) -> int:
    """Devices a weight outside the MoE blocks is gathered from: its embed dim's split
    (the embed and expert axes; the hidden axes' split stays)."""
    return mesh.product(sorted(set(mesh.embed_axes) | set(mesh.expert_axes)))


def step_memory(
    outside: StepOutside,
    moe_state: float,
    moe_weights: float,
    moe_relaid: float = 0.0,
    moe_all_reduced: float = 0.0,
) -> StepMemory:
    """The step's memory outside the MoE block's program: `outside` (`step_outside`,
    once per config) with one candidate's MoE layers. `moe_state`: every MoE layer's
    weights, gradients and optimizer state at rest (`cost.state_bytes`); `moe_weights`:
    of those, the weights alone; `moe_relaid`: of those, the routed experts' matrices
    the compiler holds once more in their stored dtype, laid out for their all-gather
    (`cost.relaid_for_gather`), instead of a compute-dtype cast of them (0 when none);
    `moe_all_reduced`: one routed expert matrix as gathered, where the compiler gathers
    it by an all-reduce (`gathers_by_all_reduce`; else 0)."""
    o = outside
    xb, pb = o.compute_bytes, o.param_bytes
    moe_copy = moe_relaid + ((moe_weights - moe_relaid) / pb * xb if o.recast else 0.0)
    cast = (o.layer_other_params * xb if o.recast else 0.0) + moe_copy
    other = o.other_params
    # Training: the MoE layers' gradients are the size of their weights, and the rest of
    # their state at rest is the optimizer's.
    return StepMemory(
        weights=other * pb + moe_weights,
        weights_cast=cast,
        gradients=(other * pb + moe_weights) if o.train else 0.0,
        optimizer=(
            other * o.optimizer_bytes_per_param + moe_state - 2 * moe_weights if o.train else 0.0
        ),
        kv_cache=o.kv_cache,
        saved_activations=o.saved_activations,
        logits=o.logits,
        logits_gradient_held=o.logits_gradient_held,
        attention_peak=o.attention_peak,
        dense_ffn_peak=o.dense_ffn_peak,
        all_reduce_copy=max(o.all_reduce_other, moe_all_reduced),
    )
