"""The whole training (or serving) step's time on one device, counted from the decoder's
shapes and priced by the chip's constants, as `selector.timing` prices one MoE block.

The MoE blocks are the chosen candidate's counted time (`Estimate.time_parts`) once per
MoE layer. Everything else is counted here, per device per step:

- compute: the dots of every layer outside its MoE block (attention projections, the
  attention itself, dense feed-forward layers) and the output head, split over the
  tensor axis; forward once, backward twice that, and the forward again for what the
  remat policy does not save (MaxText's `remat_policy`; a saved projection is not
  recomputed, `full` recomputes the whole layer);
- network: the non-expert weights all-gathered over the axes they rest on (forward,
  again for the backward, and the gradients reduce-scattered), the gradients summed
  over the data-parallel axes, the tensor axis' two activation sums a layer, the keys
  and values context parallelism all-gathers for every full-attention layer (and their
  gradients reduce-scattered), Ulysses' four all-to-alls a layer; each over ICI, or
  DCN where the axis crosses slices;
- overhead: a loop trip per layer and pass (MaxText scans the layers), where the chip
  has the figure.

Not counted (the report says so): elementwise work outside the blocks (norms, rotary,
residual adds, the loss's softmax), the embedding lookup, and any overlap of
collectives with compute: every part is added. Gated DeltaNet's chunked scan is counted
as its dots (the chunk's C x C products and the state's updates).
"""

from __future__ import annotations

from dataclasses import dataclass

from .architecture import LayerParams, is_qwen3_next, model_params
from .config import DTYPE_BYTES, Config, Mode
from .cost import Estimate
from .mesh import MeshView
from .per_device import PerDevice
from .step_memory import GDN_CHUNK_SIZE, REMAT_SAVES, named_activations, non_expert_shards
from .timing import matmul_rate

# The parts of `StepTime.parts`, in the order reports show them.
STEP_TIME_PARTS = (
    "moe_blocks",
    "layer_dots",
    "attention",
    "head",
    "recompute",
    "weight_gathers",
    "gradient_sums",
    "tensor_sums",
    "context_exchange",
    "overhead",
)
NOT_COUNTED = (
    "elementwise work outside the MoE blocks (norms, rotary, residual adds, the loss)",
    "overlap of collectives with compute (every part is added)",
)


@dataclass(frozen=True)
class StepTime:
    """Seconds one device spends on one step, by part (`STEP_TIME_PARTS`)."""

    parts: tuple[tuple[str, float], ...]

    @property
    def total(self) -> float:
        return sum(s for _, s in self.parts)

    def as_dict(self) -> dict:
        return {**dict(self.parts), "total": self.total}


def _link_seconds(
    nbytes: float, axes: tuple[str, ...], mesh: MeshView, cfg: Config, collectives: float
) -> float:
    """Seconds to move `nbytes` out of a device over the link the axes use (DCN when
    any of them crosses slices, else ICI) in `collectives` collectives, each costing
    the chip's collective latency where it has the figure."""
    hw = cfg.hardware
    if nbytes <= 0:
        return 0.0
    bandwidth = hw.dcn_bandwidth_gbps if mesh.dcn_product(axes) > 1 else hw.ici_bandwidth_gbps
    return nbytes / (bandwidth * 1e9) + collectives * (hw.collective_latency_us or 0.0) * 1e-6


def _ring(group: int) -> float:
    """The fraction of an array a device sends in a ring all-gather or reduce-scatter."""
    return (group - 1) / group if group > 1 else 0.0


def _dot_seconds(flops: float, cfg: Config) -> float:
    return flops / matmul_rate(flops, cfg.hardware) if flops > 0 else 0.0


def _attention_core_flops(cfg: Config, layer: LayerParams, tokens: float, seq: int) -> float:
    """Forward FLOPs of one layer's attention over `tokens` queries of sequences of
    `seq` (causal: half the score matrix), all heads."""
    if cfg.attention_type == "mla":
        qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
        return 2 * tokens * seq * cfg.base_num_query_heads * (qk + cfg.v_head_dim) / 2
    if not layer.full_attention:
        # Gated DeltaNet: per chunk the C x C products (q k^T, the decay-masked
        # attention times values, the triangular solve's products) and per token the
        # state's read and update (Dk x Dv a head, twice).
        chunk = getattr(cfg, "gdn_chunk_size", GDN_CHUNK_SIZE)
        hv, dk, dv = cfg.gdn_num_value_heads, cfg.gdn_key_head_dim, cfg.gdn_value_head_dim
        return 2 * tokens * hv * (chunk * (2 * dk + dv) + 2 * dk * dv)
    hq, hd = cfg.base_num_query_heads, cfg.head_dim
    return 2 * 2 * tokens * seq * hq * hd / 2


# The checkpoint names an MoE layer's block may carry (`_moe_recomputed_share`).
_MOE_NAMES = ("mlpwi_0", "mlpwi_1", "mlpwo")


def _recomputed_share(cfg: Config, layer: LayerParams) -> float:
    """Of one layer's projection FLOPs outside the MoE block, the share the backward
    recomputes: what the remat policy does not save (by the saved outputs' width)."""
    saves = set(REMAT_SAVES.get(cfg.remat_policy, ()))
    named = named_activations(cfg, layer)
    named.pop("context", None)
    if layer.moe:  # the MoE block's names: `_moe_recomputed_share`
        for name in _MOE_NAMES:
            named.pop(name, None)
    width = sum(named.values())
    if not width:
        return 1.0
    return sum(w for name, w in named.items() if name not in saves) / width


def _moe_recomputed_share(cfg: Config) -> float:
    """Of the MoE block's forward, the share the backward recomputes. This project's
    block tags nothing, so all of it. MaxText's sparse path tags its gate projection
    (mlpwi_0) and down projection (mlpwo), each one of the three routed dots: a policy
    saving them spares those."""
    if not cfg.moe_checkpoint_names:
        return 1.0
    saves = set(REMAT_SAVES.get(cfg.remat_policy, ()))
    return 1.0 - sum(name in saves for name in ("mlpwi_0", "mlpwo")) / 3


def step_time(cfg: Config, mesh: MeshView, dev: PerDevice, chosen: Estimate) -> StepTime:
    """The whole step's counted time on one device (module docstring), given the MoE
    block's chosen candidate."""
    hw = cfg.hardware
    train = cfg.mode is Mode.train
    passes = 3.0 if train else 1.0  # forward, and the backward's two dots a dot
    tokens = dev.tokens_per_device
    tensor = mesh.size("tensor")
    xb = DTYPE_BYTES.get(cfg.dtype, 4)
    pb = DTYPE_BYTES.get(cfg.param_dtype, 4)

    # Every MoE block: the candidate's count, its program's call made once a step.
    call = (hw.call_us or 0.0) * 1e-6
    block = max(chosen.time_parts.total - call, 0.0)
    moe = block * cfg.num_moe_layers

    saves = set(REMAT_SAVES.get(cfg.remat_policy, ()))
    params = model_params(cfg)
    layer_dots = attention = recompute = 0.0
    for layer in params.layers:
        weights = layer.attention + layer.dense_ffn
        proj = _dot_seconds(2 * tokens * weights / tensor, cfg)
        core = _dot_seconds(_attention_core_flops(cfg, layer, tokens, dev.seq_len) / tensor, cfg)
        layer_dots += passes * proj
        attention += passes * core
        if train:  # the backward first recomputes what the policy did not save
            recompute += _recomputed_share(cfg, layer) * proj
            recompute += 0.0 if "context" in saves else core
    if train:
        # The MoE blocks' forward again: a third of their dots' time (the backward's
        # dots are two of each forward dot's size), less what the policy saves.
        forward = chosen.time_parts.compute / passes
        recompute += cfg.num_moe_layers * forward * _moe_recomputed_share(cfg)
    head = passes * _dot_seconds(2 * tokens * cfg.base_emb_dim * cfg.vocab_size / tensor, cfg)

    # Network. Non-expert weights rest over every axis but the data axes; the tensor
    # axis splits their dots, the others are gathered for them.
    non_expert = params.non_expert
    resting = non_expert_shards(mesh)
    gather_axes = tuple(
        a for a, s in mesh.sizes if s > 1 and a in set(mesh.embed_axes) | set(mesh.expert_axes)
    )
    gathered_group = max(resting // max(tensor, 1), 1)
    per_tensor_shard = non_expert / max(tensor, 1)
    gathers = (2 if train else 1) * _ring(gathered_group) * per_tensor_shard * xb
    if train:
        gathers += _ring(gathered_group) * per_tensor_shard * pb  # gradients scattered
    weight_gathers = _link_seconds(
        gathers, gather_axes, mesh, cfg, (3 if train else 1) * cfg.base_num_decoder_layers
    )

    gradient_sums = 0.0
    data_axes = tuple(a for a in mesh.batch_axes if a not in gather_axes and mesh.size(a) > 1)
    data = mesh.product(data_axes)
    if train and data > 1:
        held = non_expert / resting + chosen.state_bytes / max(
            pb + pb + cfg.optimizer_bytes_per_param, 1
        )
        gradient_sums = _link_seconds(2 * _ring(data) * held * pb, data_axes, mesh, cfg, 1)

    tensor_sums = context_exchange = 0.0
    layers = cfg.base_num_decoder_layers
    if tensor > 1:
        # Two sums a layer forward (attention out, feed-forward out), two backward.
        # The MoE layers' feed-forward sums are in the block's own count.
        dense_layers = layers - cfg.num_moe_layers
        sums = (layers + dense_layers) * (2 if train else 1)
        nbytes = sums * 2 * _ring(tensor) * tokens * cfg.base_emb_dim * xb
        tensor_sums = _link_seconds(nbytes, ("tensor",), mesh, cfg, sums)
    cp_axes = tuple(a for a in mesh.sequence_axes if mesh.size(a) > 1)
    if cp_axes and cfg.mode is not Mode.decode:
        full = params.full_attention_layers
        # Widths a token of a full-attention layer: its keys and values, its queries
        # and output (the checkpoint names' widths, `named_activations`).
        named = named_activations(cfg, full[0]) if full else {}
        kv_width = named.get("key_proj", 0) + named.get("value_proj", 0)
        q_width = named.get("query_proj", 0) + named.get("context", 0)
        ulysses = mesh.size("context_usp_ulysses")
        gathered = mesh.cp // max(ulysses, 1)
        kv = dev.local_batch * dev.seq_len * kv_width / max(tensor, 1) * xb
        nbytes = len(full) * (2 if train else 1) * _ring(gathered) * kv
        if ulysses > 1:  # queries, keys, values in and the output back, every layer
            width = q_width + kv_width
            nbytes += len(full) * (2 if train else 1) * _ring(ulysses) * tokens * width * xb
        context_exchange = _link_seconds(
            nbytes, cp_axes, mesh, cfg, len(full) * (2 if train else 1) * (1 + (ulysses > 1) * 4)
        )

    trip = (hw.loop_trip_us or 0.0) * 1e-6
    overhead = call + trip * layers * (3 if train else 1)
    if is_qwen3_next(cfg) and cfg.inhomogeneous_layer_cycle_interval > 1:
        overhead += trip * layers  # two layer kinds: one more loop a cycle
    return StepTime(
        parts=(
            ("moe_blocks", moe),
            ("layer_dots", layer_dots),
            ("attention", attention),
            ("head", head),
            ("recompute", recompute),
            ("weight_gathers", weight_gathers),
            ("gradient_sums", gradient_sums),
            ("tensor_sums", tensor_sums),
            ("context_exchange", context_exchange),
            ("overhead", overhead),
        )
    )


__all__ = ["NOT_COUNTED", "STEP_TIME_PARTS", "StepTime", "step_time"]
