"""Weights both ways between a MaxText MoE layer's parameter tree and our block.

MaxText 0.2.5 (maxtext/layers/moe.py, models/qwen3.py) nests an MoE layer's
parameters in one of three ways, all with the same leaf shapes as ours:

- `RoutedMoE`: gate/kernel (M, E), gate/bias (E,) when routed_bias, wi_0 and wi_1
  (E, M, H), wo (E, H, M);
- `RoutedAndSharedMoE` (DeepSeek): the routed tree under MoeBlock_0, and the shared
  experts' MlpBlock under shared_experts: wi_0/kernel, wi_1/kernel (M, S), wo/kernel (S, M)
  with S = shared_experts x H (Qwen3-Next's gated shared expert: S = H whatever
  shared_experts > 0 says, as MaxText builds it; selector.problem.shared_width);
- `Qwen3NextSparseMoeBlock`: the routed tree under routed_experts, the shared expert
  under shared_expert, and its gate under shared_expert_gate/kernel (M, 1).

`to_maxtext(block)` returns the tree as nested dicts of arrays, `load_maxtext(block,
tree)` puts a tree's arrays into the block at its at-rest shardings (and checks every
leaf is used and every shape matches). Values are copied bit for bit (a dtype other than
the block's param_dtype is an error, not a silent cast).
"""

from __future__ import annotations

import jax
import numpy as np

from .ffn import ExpertWeights
from .weights import WEIGHTS

# Layout name -> where each part of `layers.weights` sits in MaxText's tree (the prefix
# of its subtree; a part the module lacks is absent).
LAYOUTS = {
    "routed": {"routed": ()},
    "routed_and_shared": {"routed": ("MoeBlock_0",), "shared": ("shared_experts",)},
    "qwen3_next": {
        "routed": ("routed_experts",),
        "shared": ("shared_expert",),
        "shared_gate": ("shared_expert_gate",),
    },
}


def layout_for(block) -> str:
    """The MaxText module a block corresponds to."""
    if block.spec.shared_expert_gate:
        return "qwen3_next"
    return "routed_and_shared" if block.spec.shared_experts else "routed"


def paths(layout: str) -> dict[str, tuple[str, ...]]:
    """ExpertWeights field -> path in the MaxText tree of `layout`."""
    prefixes = LAYOUTS[layout]
    return {w.field: prefixes[w.part] + w.maxtext for w in WEIGHTS if w.part in prefixes}


def to_maxtext(block, layout: str | None = None) -> dict:
    """The block's parameters as MaxText's nested tree (arrays keep their sharding)."""
    layout = layout or layout_for(block)
    tree: dict = {}
    weights = block.weights()
    for name, path in paths(layout).items():
        value = getattr(weights, name)
        if value is None:
            continue
        node = tree
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = value
    return tree


def _leaves(tree: dict, prefix=()) -> dict[tuple[str, ...], object]:
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out |= _leaves(value, (*prefix, key))
        else:
            out[(*prefix, key)] = value
    return out


def load_maxtext(block, tree: dict, layout: str | None = None) -> None:
    """Put a MaxText tree's arrays into the block, at the block's at-rest shardings."""
    layout = layout or layout_for(block)
    given = _leaves(tree)
    wanted = {path: name for name, path in paths(layout).items()}
    current = block.weights()
    unused = [path for path in given if path not in wanted]
    if unused:
        raise ValueError(
            f"MaxText tree has parameters the {layout} block does not hold: "
            f"{['/'.join(p) for p in unused]}"
        )
    # Every leaf is checked before any is written: a refused tree leaves the block as it was.
    writes = []
    for path, name in wanted.items():
        target = getattr(current, name)
        if target is None:
            continue
        if path not in given:
            raise ValueError(f"MaxText tree lacks {'/'.join(path)} ({name})")
        value = given[path]
        if tuple(value.shape) != tuple(target.shape) or np.dtype(value.dtype) != target.dtype:
            raise ValueError(
                f"{'/'.join(path)}: {value.dtype}{tuple(value.shape)} does not fit the block's "
                f"{target.dtype}{tuple(target.shape)} ({name})"
            )
        writes.append((name, value, target.sharding))
    for name, value, sharding in writes:
        block.variables()[name][...] = jax.device_put(value, sharding)


__all__ = ["LAYOUTS", "ExpertWeights", "layout_for", "load_maxtext", "paths", "to_maxtext"]
