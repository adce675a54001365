"""Settings of the decoder around the MoE blocks, which the whole step's memory reads
(selector.architecture, selector.step_memory)."""

from __future__ import annotations

import math

from ..config import Config, ContextStrategy
from ..findings import Finding, Fix, error, fix
from ..mesh import MeshView
from ..step_memory import REMAT_SAVES
from .moves import move

ATTENTION_TYPES = ("global", "mla")  # of MaxText's attention_type values, those counted


def known_remat_policy(cfg: Config) -> list[Finding]:
    if cfg.remat_policy in REMAT_SAVES:
        return []
    return [
        error(
            "REMAT_POLICY_UNKNOWN",
            "remat_policy",
            f"remat_policy={cfg.remat_policy!r} is not one of MaxText 0.2.5's policies the "
            f"step's memory is counted for ({', '.join(REMAT_SAVES)}); `custom` and the "
            "quantization policies are not modelled. `full` saves the least.",
            [fix(remat_policy="full"), fix(remat_policy="minimal")],
        )
    ]


def known_attention(cfg: Config) -> list[Finding]:
    if cfg.attention_type in ATTENTION_TYPES:
        return []
    return [
        error(
            "ATTENTION_TYPE_UNKNOWN",
            "attention_type",
            f"attention_type={cfg.attention_type!r} is not counted here: global "
            "(grouped-query attention, with decoder_block=qwen3_next for Qwen3-Next's mix) "
            "or mla (DeepSeek's multi-head latent attention).",
            [fix(attention_type="global"), fix(attention_type="mla")],
        )
    ]


def decoder_sizes(cfg: Config) -> list[Finding]:
    """Every size the parameter count reads must be a positive whole number."""
    names = ["vocab_size", "base_num_query_heads", "base_num_kv_heads", "head_dim"]
    names += ["base_mlp_dim", "num_vocab_tiling"]
    if cfg.attention_type == "mla":
        names += ["kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"]
    found = []
    for name in names:
        value = getattr(cfg, name)
        if not isinstance(value, int) or value < 1:
            found.append(
                error(
                    "DECODER_SIZE_INVALID",
                    name,
                    f"{name}={value!r} must be a positive whole number: the whole step's "
                    "parameters and activations are counted from it. Set the model's own "
                    "value (its config.json or MaxText model file).",
                    no_fix="No override can help: only the model's own size is right.",
                )
            )
    return found


def recurrence_needs_ordered_shards(cfg: Config, mesh: MeshView, dev=None) -> list[Finding]:
    """Qwen3-Next's Gated DeltaNet layers carry a recurrence along the sequence: device
    i continues the state device i-1 leaves, so the load-balanced reordering of the
    sequence shards composes the segments out of order. MaxText 0.2.5 refuses the
    combination (read in its configs/types.py; the run would train with a wrong
    recurrence rather than fail)."""
    if cfg.decoder_block != "qwen3_next" or not cfg.context_parallel_load_balance:
        return []
    cp = mesh.size("context")  # MaxText checks ici x dcn context parallelism alone
    if cp <= 1:
        return []
    return [
        error(
            "RECURRENCE_LOAD_BALANCED",
            "context_parallel_load_balance",
            f"decoder_block=qwen3_next with context parallelism {cp}: its Gated DeltaNet "
            "layers carry a recurrence from one sequence shard to the next, which the "
            "load-balanced order (each device the i-th and the mirrored chunk) breaks. "
            "MaxText 0.2.5 refuses it (raised in its configs/types.py, read; its "
            "train_compile stopped on it for v5p-128 at cp=4, run ahead of time on a CPU "
            "machine).",
            [fix(context_parallel_load_balance=False)],
        )
    ]


def tensor_splits_whole_heads(cfg: Config, mesh: MeshView, dev=None) -> list[Finding]:
    """The tensor axis shards attention heads, and a head cannot be split: grouped-query
    attention needs the key/value heads (and the query heads) to be a multiple of it.
    MaxText 0.2.5 refuses the layout at its compile ("num_kv_heads ... must be divisible
    by 4, the combined size of the mesh axes ['tensor']": its train_compile for
    qwen3-next-80b-a3b, 2 key/value heads, tensor=4 on v5p-128, run ahead of time on a
    CPU machine). MLA's heads are all query heads, checked by the same divisibility."""
    tensor = mesh.size("tensor")
    if tensor <= 1 or cfg.attention_type not in ("global", "mla"):
        return []
    heads = [("base_num_query_heads", cfg.base_num_query_heads)]
    if cfg.attention_type == "global":
        heads.append(("base_num_kv_heads", cfg.base_num_kv_heads))
    bad = [(name, n) for name, n in heads if n % tensor]
    if not bad:
        return []
    name, n = bad[-1]
    whole = math.gcd(tensor, *(n for _, n in heads))
    fixes = []
    for to in ("fsdp", "context", "expert", "data"):
        moved = move(cfg, mesh, {"tensor": whole}, to=to)
        if moved:
            fixes.append(Fix(moved, f"tensor {whole}, its other devices moved to {to}"))
    return [
        error(
            "TENSOR_SPLITS_HEADS",
            "ici_tensor_parallelism",
            f"The tensor axis ({tensor} devices) shards the attention heads, but {name}={n} "
            f"is not a multiple of it: a head cannot be split. MaxText 0.2.5 refuses this "
            f"at compile. Use a tensor axis that divides the heads ({whole}), and give "
            "its other devices to another axis.",
            fixes,
            no_fix="No single move of the devices keeps the batch and the sequence split "
            "valid here; search=true lists the layouts of these chips that pass.",
        )
    ]


def ulysses_splits_whole_heads(cfg: Config, mesh: MeshView, dev=None) -> list[Finding]:
    """Ulysses attention trades a device's sequence shard for a share of the heads over
    its axis (`context` under context_parallel_strategy=ulysses, `context_usp_ulysses`
    under usp): the query and key/value heads a device holds after the tensor split must
    each be a multiple of that axis, and a single key/value head cannot be shared out.
    MaxText 0.2.5 refuses the layout when it builds the attention (read in its
    kernels/attention/ulysses_attention.py, validate_head_sharding; not run)."""
    strategy = cfg.context_parallel_strategy
    if strategy not in (ContextStrategy.ulysses, ContextStrategy.usp):
        return []
    axis = "context" if strategy is ContextStrategy.ulysses else "context_usp_ulysses"
    size, tensor = mesh.size(axis), mesh.size("tensor")
    if size <= 1 or cfg.attention_type != "global":
        return []
    heads = {"base_num_query_heads": cfg.base_num_query_heads}
    heads["base_num_kv_heads"] = cfg.base_num_kv_heads
    # A single key/value head left a device is among these: 1 is no multiple of size > 1.
    bad = [(k, n) for k, n in heads.items() if n % tensor or (n // tensor) % size]
    if not bad:
        return []
    name, n = bad[-1]
    return [
        error(
            "ULYSSES_SPLITS_HEADS",
            "context_parallel_strategy",
            f"context_parallel_strategy={strategy.value} shares each device's heads out over "
            f"{axis}={size}, but {name}={n} leaves {n / tensor:g} a device after tensor="
            f"{tensor}, not a multiple of {size}"
            + (" (and a single key/value head cannot be shared)" if n == 1 else "")
            + ". MaxText 0.2.5 refuses this when it builds the attention. All-gathering the "
            "keys and values needs no head split.",
            [fix(context_parallel_strategy=ContextStrategy.all_gather)],
        )
    ]


def context_strategy_axes(cfg: Config, mesh: MeshView, dev=None) -> list[Finding]:
    """MaxText 0.2.5 builds Ulysses attention only over a split context axis, and USP
    only over a split context axis and a split context_usp_ulysses axis (it raises
    otherwise: layers/attention_op.py, read; not run)."""
    strategy = cfg.context_parallel_strategy
    if strategy not in (ContextStrategy.ulysses, ContextStrategy.usp):
        return []
    axes = ["context", *(["context_usp_ulysses"] if strategy is ContextStrategy.usp else [])]
    unsplit = [a for a in axes if mesh.size(a) <= 1]
    if not unsplit:
        return []
    return [
        error(
            "CONTEXT_STRATEGY_AXES",
            "context_parallel_strategy",
            f"context_parallel_strategy={strategy.value} needs "
            + " and ".join(f"{a} > 1" for a in axes)
            + f", but {' and '.join(f'{a}={mesh.size(a)}' for a in unsplit)}: MaxText "
            "0.2.5 raises when it builds the attention. All-gathering the keys and values "
            "runs on any context axis.",
            [fix(context_parallel_strategy=ContextStrategy.all_gather)],
        )
    ]


MODEL_RULES = (known_remat_policy, known_attention, decoder_sizes)
# Rules that read the mesh: they run beside the layout rules, after the mesh is known.
MODEL_LAYOUT_RULES = (
    recurrence_needs_ordered_shards,
    tensor_splits_whole_heads,
    ulysses_splits_whole_heads,
    context_strategy_axes,
)
