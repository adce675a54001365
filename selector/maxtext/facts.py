"""What MaxText 0.2.5's MoE block measurably does with a config, as findings.

Every statement here was measured with MaxText 0.2.5's RoutedMoE on CPU (8 simulated
devices, float32, identical weights and inputs to ours; see shared NOTES) or read from
its source (maxtext/layers/moe.py), and says which; nothing here was run on a TPU or GPU.
They read the resolved mesh (a -1 fill counts).
"""

from __future__ import annotations

from ..config import Config, Exchange, Mode, ScoreFunc
from ..findings import Finding, fix, warning
from ..mesh import MeshView

# Keys MaxText 0.2.5 reads in the MoE block that this check does not map: a changed
# value changes the block's output, memory or time. Only these are listed by name
# among the ignored keys.
MOE_KEYS_NOT_MAPPED = (
    "fused_mlp",
    "first_num_hash_layers",
    "load_balance_loss_weight",
    "mlp_activations",
    "mlp_activations_limit",
    "mlp_bias",
    "moe_expert_input_dim",
    "moe_use_megatron_seq_aux_loss",
    "num_moe_token_chunks",
    "prefuse_moe_weights",
    "ragged_buffer_factor",
    "remat_policy",
    "routed_bias_update_rate",
    "use_batch_split_schedule",
    "use_random_routing",
)
# MaxText 0.2.5 settings that change which mesh axes shard the MoE block's tokens or
# weights, and that this check does not model (what each does: its configs/types.py).
# A value other than base.yml's is a warning naming it.
SHARDING_KEYS_NOT_MODELLED = {
    "moe_dispatch_no_expert_sharding": "shards the MoE dispatch and MLP batch dim without 'expert'",
    "shard_exp_on_fsdp": "splits the experts' expert dim over the fsdp axis",
    "shard_embed_moe_on_fsdp": "keeps the MoE weights' embed dim split over fsdp for a "
    "manual all-gather",
    "use_2d_fsdp_sharding": "splits the MoE weights over fsdp in two dims",
    "moe_fsdp_use_two_stage_all_gather": "gathers the MoE weights over fsdp and "
    "fsdp_transpose in two all-gathers",
    "use_ring_of_experts": "runs Ring of Experts for the grouped matmul's expert parallelism",
    "context_sharding": "names the mesh axis that does context parallelism",
}
# Keys MaxText 0.2.5's config no longer has (it refuses unknown keys), with where their
# effect lives now.
RETIRED_KEYS = {
    "expert_shard_attention_option": (
        "MaxText 0.2.5's config has no expert_shard_attention_option (read in its "
        "configs/types.py, which refuses unknown keys; only its configs/pyconfig_deprecated.py "
        "still reads it, where 'context' counted the expert devices as context parallelism "
        "in attention). In 0.2.5 that layout is custom_mesh_and_rule=ep-as-cp (its file "
        "says the expert axis acts as context parallelism outside the MoE block's "
        "all-to-all); custom_mesh_and_rule=cp-as-ep rests the experts over context and "
        "expert instead. Read in MaxText's files, not run."
    ),
}


def placement_in_maxtext(placement, mesh: MeshView) -> str:
    """The MaxText 0.2.5 settings that give a plan's expert placement, or that none does
    (read in its configs: base.yml's rules and custom_mesh_and_rule/cp-as-ep.yml; the
    exchange over the expert axis in its layers/moe.py; not run here)."""
    if placement.exchange is not Exchange.all_to_all:
        return (
            "in MaxText: its default with ici_expert_parallelism=1 (base.yml's rules rest "
            "the expert weights split over fsdp, which its grouped matmul all-gathers; read "
            "in MaxText 0.2.5's files, not run)"
        )
    group = tuple(placement.group_axes)
    size = mesh.product(group)
    if group == ("expert",):
        return (
            f"in MaxText: ici_expert_parallelism={size} (its grouped matmul exchanges rows "
            "over the expert axis by ragged all-to-all; read in MaxText 0.2.5's "
            "layers/moe.py, not run)"
        )
    if "context" in group:
        return (
            f"MaxText 0.2.5 has no setting known to give it (an expert group over "
            f"{' x '.join(group)} while those devices split the sequence): its "
            "custom_mesh_and_rule=cp-as-ep rests the experts over context and expert but names "
            "no MoE sequence rule (activation_length_moe), so its MoE tokens are not split "
            "over context as this route reads it (AXIS_RULE_WEIGHTS_OFF_TOKENS); "
            "ici_expert_parallelism=N exchanges over an expert axis instead"
        )
    return f"MaxText 0.2.5 has no setting for an expert group over {' x '.join(group)}"


def sharding_not_modelled(raw: dict, base: dict) -> list[Finding]:
    """A warning for each MaxText sharding switch set away from base.yml's default."""
    found = []
    for key, what in SHARDING_KEYS_NOT_MODELLED.items():
        if key in raw and key in base and raw[key] != base[key]:
            found.append(
                warning(
                    "MAXTEXT_SHARDING_NOT_MODELLED",
                    key,
                    f"{key}={raw[key]} (base.yml: {base[key]}) {what} in MaxText (read in "
                    "MaxText 0.2.5's configs/types.py, not run); this check does not model "
                    "it: its placements, memory and traffic assume base.yml's value.",
                )
            )
    return found


# Mesh axes of MaxText's training mesh that the check does not model.
UNMODELLED_AXES = (
    "diloco",
    "stage",
    "fsdp_transpose",
    "tensor_sequence",
    "autoregressive",
    "sequence",
    "pipeline",
)


def _cp(mesh: MeshView) -> int:
    return mesh.product(("context", "context_usp_ulysses", "context_autoregressive"))


# MaxText 0.2.5 measured from outside this repository (the team's notes): its
# grouped-matmul paths on the TPU compiler (jax 0.12.0.1, libtpu 0.0.50.1, 8 abstract
# v5p chips, compiled ahead of time, not run; emb 2048, hidden 512, E=64, k=8, bf16,
# 4 x 8192 tokens, fsdp=2 x cp).
MEGABLOX_CP_NOTE = (
    "MaxText's grouped matmul with cp={cp}: both of its paths keep the sequence sharded, as "
    "compiled by XLA:TPU (MaxText 0.2.5, jax 0.12.0.1, libtpu 0.0.50.1, 8 abstract v5p "
    "chips, ahead of time: per-device temp of the Pallas megablox path 3209 -> 1926 -> 931 "
    "MiB at cp=1, 2, 4, args+temp cp4/cp1 0.287; the ragged path 0.267). An earlier 0.716 "
    "for the Pallas path came from Pallas interpret mode on CPU, an artefact."
)


def megablox_note(mesh: MeshView | None, sparse: bool) -> str | None:
    """What was measured of MaxText's grouped matmul under cp, when it applies."""
    cp = _cp(mesh) if mesh is not None else 1
    return MEGABLOX_CP_NOTE.format(cp=cp) if sparse and cp > 1 else None


def facts(raw: dict, cfg: Config, mesh: MeshView | None, sparse: bool, megablox: bool) -> list:
    """Findings about what MaxText does with this config (the resolved mesh's cp)."""
    found: list[Finding] = []
    cp = _cp(mesh) if mesh is not None else 1
    lb_weight = float(raw.get("load_balance_loss_weight", 0.0) or 0.0)
    inference = str(raw.get("model_call_mode", "")).lower() == "inference"
    cf = cfg.capacity_factor
    if sparse and cf > 0:
        found.append(
            warning(
                "MAXTEXT_SPARSE_IGNORES_CAPACITY",
                "capacity_factor",
                f"sparse_matmul=true runs MaxText's dropless grouped matmul, which does not "
                f"apply capacity_factor={cf:g} (read from its source).",
                [fix("say so", capacity_factor=-1.0)],
            )
        )
    if not sparse and cf > 0 and cp > 1 and not inference:
        found.append(
            warning(
                "MAXTEXT_CAPACITY_OVER_FULL_SEQUENCE",
                "capacity_factor",
                f"sparse_matmul=false with capacity_factor={cf:g} in training, cp={cp}: "
                "MaxText computes each expert's capacity over the whole sequence whatever the "
                "context axes are (measured); only model_call_mode=inference splits into "
                "subgroups, and only by context_autoregressive. layers.MoEBlock with "
                "dispatch=subgroup_capacity applies the capacity per sequence shard, so its "
                "drops differ from MaxText's at cp > 1 (they agree at cp=1 with "
                "capacity_rounding=maxtext, which this route sets).",
            )
        )
    if not sparse and cf > 0 and inference:
        found.append(
            warning(
                "MAXTEXT_INFERENCE_CAPACITY",
                "model_call_mode",
                "model_call_mode=inference with capacity_factor > 0: MaxText splits the "
                "capacity into subgroups by context_autoregressive alone, and its combine uses "
                "the softmax weights without renormalising them whatever norm_topk_prob says "
                "(measured).",
            )
        )
    if lb_weight > 0 and sparse and not megablox:
        found.append(
            warning(
                "MAXTEXT_LOAD_BALANCE_LOSS_LOCAL",
                "load_balance_loss_weight",
                f"load_balance_loss_weight={lb_weight:g} on MaxText's ragged path: the loss it "
                "returns is device 0's local loss, not reduced over devices (measured: 1.009833 "
                "where the mean over devices is 1.0253). layers.MoEBlock returns the loss over "
                "the global batch.",
            )
        )
    if lb_weight > 0 and not sparse:
        found.append(
            warning(
                "MAXTEXT_LOAD_BALANCE_LOSS_PER_SEQUENCE",
                "load_balance_loss_weight",
                f"load_balance_loss_weight={lb_weight:g} on MaxText's dense path: the loss it "
                "returns is the mean of per-sequence losses (measured 1.010766 where the "
                "global form gives 1.009689); layers.MoEBlock returns the global form.",
            )
        )
    if lb_weight > 0 and cfg.routed_score_func is ScoreFunc.sigmoid:
        megatron = str(raw.get("moe_use_megatron_seq_aux_loss", "")).lower() == "true"
        found.append(
            warning(
                "MAXTEXT_LOAD_BALANCE_LOSS_SIGMOID",
                "load_balance_loss_weight",
                f"load_balance_loss_weight={lb_weight:g} with sigmoid routing: MaxText's two "
                "paths take the loss's router probabilities differently (read in its "
                "layers/moe.py): the grouped matmul the softmax of the pre-bias sigmoid "
                "scores, the dense path the softmax of the gate logits with the bias added"
                + (
                    ", except that moe_use_megatron_seq_aux_loss=true gives Megatron-LM's "
                    "per-sequence loss on the per-token normalised scores"
                    if megatron
                    else ""
                )
                + ". On the same tokens and weights (DeepSeek-V3 routing, measured by an "
                "outside tester, not re-run here) they report 1.004384 (ragged) and 1.026532 "
                "(dense); layers.MoEBlock reports 1.002419: its probabilities are the sigmoid "
                "scores normalised per token to sum 1, over the global batch.",
            )
        )
    for axis in UNMODELLED_AXES:
        for tier in ("ici", "dcn"):
            key = f"{tier}_{axis}_parallelism"
            if key in raw and raw[key] not in (1, "1", None, -1):
                found.append(
                    warning(
                        "MAXTEXT_AXIS_NOT_MODELLED",
                        key,
                        f"{key}={raw[key]} shards MaxText's '{axis}' mesh axis, which this check "
                        "does not model; its per-device numbers assume it is 1.",
                    )
                )
    return found


def ignored_that_matter(raw: dict, used: set[str], base: dict) -> list[str]:
    """The ignored keys that could change the MoE block's numbers and differ from the
    base file's own defaults, as key=value."""
    return [
        f"{k}={raw[k]!r}"
        for k in MOE_KEYS_NOT_MAPPED
        if k in raw and k not in used and (k not in base or base[k] != raw[k])
    ]


def mode_of(raw: dict) -> Mode | None:
    return Mode.prefill if str(raw.get("model_call_mode", "")).lower() == "inference" else None
