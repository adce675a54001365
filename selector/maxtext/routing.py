"""The routing MaxText 0.2.5's get_topk runs for a decoder family, as our block's
routing settings (read from maxtext/layers/moe.py): DeepSeek-V3's family selects on
biased scores within groups and weighs by the unbiased ones, renormalised and scaled;
the DeepSeek decoder otherwise weighs by the chosen scores times the scaling factor;
every other decoder softmaxes over the top-k logits, i.e. always renormalises."""

from __future__ import annotations

from ..config import ScoreFunc
from ..findings import Finding, warning
from .files import coerce

DEEPSEEK_V3_FAMILY = ("deepseek3", "deepseek4", "kimi-k2")  # MaxText's deepseek_routing
SHARED_GATE_DECODERS = ("qwen3_next", "qwen3_5")  # Qwen3NextSparseMoeBlock


def routing(
    raw: dict, model_name: str, base: dict, notes: list[str]
) -> tuple[dict, list[str], list[Finding]]:
    """The block's routing settings for what MaxText 0.2.5's get_topk does with this
    decoder and model, what our block cannot reproduce, and routing facts (a fact that
    only base.yml's own default triggers is a note, not a finding)."""
    decoder = str(raw.get("decoder_block", "llama2"))
    score = str(raw.get("routed_score_func", "") or "")
    bias = coerce("routed_bias", raw.get("routed_bias", False), bool)
    scale = coerce("routed_scaling_factor", raw.get("routed_scaling_factor", 1.0), float)
    norm = coerce("norm_topk_prob", raw.get("norm_topk_prob", False), bool)
    groups = coerce("n_routing_groups", raw.get("n_routing_groups", -1), int)
    top_groups = coerce("topk_routing_group", raw.get("topk_routing_group", -1), int)
    shared = coerce("shared_experts", raw.get("shared_experts", 0), int)
    out: dict = {"shared_expert_gate": decoder in SHARED_GATE_DECODERS and shared > 0}
    unsupported, found = [], []
    out["routed_score_func"] = ScoreFunc.sigmoid if score == "sigmoid" else ScoreFunc.softmax
    if score not in ("", "softmax", "sigmoid"):
        unsupported.append(f"routed_score_func={score}")
    if decoder in ("deepseek", "deepseek4"):
        if score == "":
            unsupported.append("decoder_block=deepseek with routed_score_func='' (raw logits)")
        out["norm_topk_prob"] = score == "sigmoid"  # deepseek_scale_weights
        out["routed_scaling_factor"] = scale
        if model_name.startswith(DEEPSEEK_V3_FAMILY):
            out["routed_bias"] = bias
            out["n_routing_groups"], out["topk_routing_group"] = groups, top_groups
        elif bias:
            unsupported.append("routed_bias outside the DeepSeek-V3 family (bias weighs too)")
    elif decoder in ("llama4", "gemma4"):
        unsupported.append(f"decoder_block={decoder} routing")
        out["norm_topk_prob"] = norm
    else:
        # Softmax over the top-k logits: renormalised whatever norm_topk_prob says, and
        # neither routed_scaling_factor nor groups are applied.
        out["norm_topk_prob"] = True
        if score not in ("", "softmax"):
            unsupported.append(f"routed_score_func={score} then a softmax over the top-k")
        if bias:
            unsupported.append("routed_bias outside the DeepSeek-V3 family (bias weighs too)")
        if not norm:
            text = (
                f"norm_topk_prob=false with decoder_block={decoder}: MaxText still normalises "
                "the top-k weights (a softmax over the top-k logits; read from its source and "
                "measured), so the block runs norm_topk_prob=true to match. Only "
                "decoder_block=deepseek with routed_score_func=softmax leaves them unnormalised."
            )
            if base.get("norm_topk_prob") == raw.get("norm_topk_prob"):
                notes.append(text)
            else:
                found.append(warning("MAXTEXT_NORM_TOPK_PROB_IGNORED", "norm_topk_prob", text))
    acts = raw.get("mlp_activations", ["silu", "linear"])
    if list(acts or []) != ["silu", "linear"]:
        unsupported.append(f"mlp_activations={acts}")
    for key in ("mlp_activations_limit", "first_num_hash_layers"):
        if float(raw.get(key, 0) or 0) > 0:
            unsupported.append(f"{key}={raw[key]}")
    for key in ("mlp_bias", "use_random_routing"):
        if coerce(key, raw.get(key, False), bool):
            unsupported.append(f"{key}=true")
    if unsupported:
        found.append(
            warning(
                "MAXTEXT_ROUTING_NOT_IN_BLOCK",
                "decoder_block",
                f"layers.MoEBlock does not compute what MaxText does for "
                f"{', '.join(unsupported)}: its plan (memory, time, sharding) still holds, "
                "but its outputs would differ from MaxText's.",
            )
        )
    return out, unsupported, found
