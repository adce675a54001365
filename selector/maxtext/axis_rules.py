"""MaxText's logical axis rules resolved the way flax resolves them, onto our axis roles.

RoutedMoE (MaxText 0.2.5) names its activations (activation_batch_moe,
activation_length_moe, activation_embed_moe) and its expert weights (exp, embed_moe,
mlp_moe); flax's logical_to_mesh_axes walks the rule list in order and gives a rule to
a dim only while none of its mesh axes is taken by another dim of the same tensor.
"""

from __future__ import annotations

from typing import Any

from ..config import MESH_AXES, AxisRules
from .files import MaxTextError


def _assign(dims: tuple[str, ...], rules: list) -> tuple[list[list[str]], list[str]]:
    """Mesh axes per dim as flax's logical_to_mesh_axes assigns them: walk the rules in
    order; a rule for one of the dims applies when that dim is still unassigned and
    none of its mesh axes is already used by another dim. Also returns the rules that
    were skipped because an axis was taken (the axis a user meant for two dims)."""
    result: list[list[str] | None] = [None] * len(dims)
    skipped = []
    for entry in rules:
        if not isinstance(entry, (list, tuple)) or len(entry) != 2:
            raise MaxTextError(
                f"logical_axis_rules entry {entry!r} is not a [logical_name, mesh_axes] pair; "
                "fix the file."
            )
        name, axes = entry
        if name not in dims:
            continue
        axes = [axes] if isinstance(axes, str) else list(axes or [])
        pos = dims.index(name)
        used = {a for r in result if r for a in r}
        if result[pos] is None and not used & set(axes):
            result[pos] = axes
        elif result[pos] is None:
            skipped.append((pos, f"{name} -> {axes} ({', '.join(sorted(used & set(axes)))} taken)"))
    # A skipped rule matters only when no later rule gave its dim any axes: duplicate
    # entries are MaxText's own fallbacks (base.yml lists embed_moe twice on purpose).
    lost = [text for pos, text in skipped if result[pos] is None]
    return [r or [] for r in result], lost


def axis_rules(rules: Any, dropped: list[str] | None = None) -> AxisRules:
    """Axis roles as MaxText 0.2.5's RoutedMoE resolves its tensors' logical names
    (activations: activation_batch_moe, activation_length_moe, activation_embed_moe;
    expert weights: exp, embed_moe, mlp_moe; the general names when a config has no
    MoE-specific ones). Mesh axes this check does not model (fsdp_transpose, ...) are
    left out; MAXTEXT_AXIS_NOT_MODELLED reports one whose parallelism is > 1."""
    if rules is None:
        return AxisRules()
    names = {str(e[0]) for e in rules if isinstance(e, (list, tuple)) and e}
    act = ("activation_batch_moe", "activation_length_moe", "activation_embed_moe")
    if "activation_batch_moe" not in names:
        act = ("activation_batch", "activation_length", "activation_embed")
    weight = ("exp", "embed_moe", "mlp_moe") if "embed_moe" in names else ("exp", "embed", "mlp")
    (batch, sequence, _), _ = _assign(act, rules)
    (experts, embed, hidden), skipped = _assign(weight, rules)
    if dropped is not None:
        dropped += skipped

    def ours(axes):
        return [a for a in axes if a in MESH_AXES]

    return AxisRules(
        batch=ours(batch),
        sequence=ours(sequence),
        experts=ours(experts),
        hidden=ours(hidden),
        embed=ours(embed),
    )
