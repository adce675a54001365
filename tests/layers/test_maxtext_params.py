"""Weights port both ways between MaxText's MoE parameter trees and our block.

The expected tree is read from MaxText 0.2.5's own source (its wheel, fetched at test
time): the `self.<name> = <Module>(...)` assignments in each module's __init__, followed
recursively from RoutedMoE, RoutedAndSharedMoE and Qwen3NextSparseMoeBlock down to the
nnx variables. A MaxText checkpoint laid out that way loads into our block and comes
back out bit for bit, and the loaded block computes the reference MoE of those arrays.
"""

import ast

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from layer_helpers import ROUTINGS, assert_close, build, host_weights, inputs
from reference import reference_moe

from layers.maxtext_params import layout_for, load_maxtext, to_maxtext

VARIABLES = {"Param", "MoEBiasVar"}  # leaves of the tree
SOURCES = ("layers/moe.py", "layers/linears.py", "models/qwen3.py")


def module_attrs(maxtext_dir) -> dict[str, dict[str, set[str]]]:
    """class -> {attribute -> names of what __init__ assigns to it}."""
    classes: dict[str, dict[str, set[str]]] = {}
    for rel in SOURCES:
        tree = ast.parse((maxtext_dir / rel).read_text())
        for cls in (n for n in tree.body if isinstance(n, ast.ClassDef)):
            init = next((f for f in cls.body if getattr(f, "name", "") == "__init__"), None)
            if init is None:
                continue
            attrs: dict[str, set[str]] = {}
            for node in ast.walk(init):
                if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call):
                    for target in node.targets:
                        if (
                            isinstance(target, ast.Attribute)
                            and isinstance(target.value, ast.Name)
                            and target.value.id == "self"
                        ):
                            attrs.setdefault(target.attr, set()).add(_callee(node.value))
            source = ast.get_source_segment((maxtext_dir / rel).read_text(), init) or ""
            # MlpBlock names its input projections wi_{idx} through setattr (one per
            # activation; the SwiGLU's two activations give wi_0 and wi_1).
            if 'f"wi_{idx}"' in source and "setattr(self, dense_name, module)" in source:
                attrs["wi_0"] = attrs["wi_1"] = {"DenseGeneral"}
            classes.setdefault(cls.name, attrs)
    return classes


def _callee(call: ast.Call) -> str:
    f = call.func
    return f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")


def maxtext_paths(classes, root: str) -> set[tuple[str, ...]]:
    """Every variable path under MaxText module `root`."""
    out = set()
    for attr, callees in classes[root].items():
        for callee in callees:
            if callee in VARIABLES:
                out.add((attr,))
            elif callee in classes:
                out |= {(attr, *p) for p in maxtext_paths(classes, callee)}
    return out


def leaves(tree, prefix=()):
    for key, value in tree.items():
        if isinstance(value, dict):
            yield from leaves(value, (*prefix, key))
        else:
            yield (*prefix, key), value


MODULES = {
    "routed": ("RoutedMoE", ("num_experts=16", "num_experts_per_tok=2")),
    "routed_and_shared": ("RoutedAndSharedMoE", ROUTINGS["deepseek_v3"]),
    "qwen3_next": ("Qwen3NextSparseMoeBlock", ROUTINGS["qwen3_next"]),
}


@pytest.mark.parametrize("layout", list(MODULES))
def test_our_tree_is_maxtexts_tree(jax_cpu8, maxtext_dir, layout):
    module, overrides = MODULES[layout]
    model = build("megablox", {"data": 2, "context": 4}, 8, 32, *overrides)
    assert layout_for(model) == layout
    ours = {path for path, _ in leaves(to_maxtext(model))}
    theirs = maxtext_paths(module_attrs(maxtext_dir), module)
    assert ours <= theirs, sorted(ours - theirs)
    # The variables every such MaxText layer has; the rest are variants MaxText builds
    # only when asked (fused_mlp / prefuse_moe_weights' `wi`, biases, scales).
    core = {p for p in theirs if p[-1] in ("kernel", "wi_0", "wi_1", "wo") and "wi" not in p}
    assert core <= ours, sorted(core - ours)


@pytest.mark.parametrize("layout", list(MODULES))
def test_a_maxtext_checkpoint_round_trips_bit_for_bit(jax_cpu8, layout):
    _, overrides = MODULES[layout]
    model = build("megablox", {"data": 2, "context": 4}, 8, 32, *overrides)
    rng = np.random.default_rng(5)
    checkpoint = jax.tree.map(
        lambda a: rng.standard_normal(a.shape).astype(a.dtype) * 0.1, to_maxtext(model)
    )
    load_maxtext(model, checkpoint)
    back = to_maxtext(model)
    for path, value in leaves(checkpoint):
        got = np.asarray(dict(leaves(back))[path])
        assert got.dtype == value.dtype and np.array_equal(got, value), path
    x, _ = inputs(8, 32)
    y, _ = model(jax.device_put(x, model.layout.named(model.layout.x_BSM)))
    ry, _ = reference_moe(host_weights(model), x, model.spec)
    assert_close(y, ry, what=f"{layout} forward after loading")


def test_a_wrong_tree_is_refused(jax_cpu8):
    model = build("megablox", {"data": 2, "context": 4}, 8, 32, *MODULES["qwen3_next"][1])
    tree = to_maxtext(model)
    tree["routed_experts"]["wi_0"] = jnp.zeros((3, 3, 3), model.param_dtype)
    with pytest.raises(ValueError, match="routed_experts/wi_0"):
        load_maxtext(model, tree)
    with pytest.raises(ValueError, match="does not hold"):
        load_maxtext(model, {**to_maxtext(model), "extra": {"kernel": jnp.zeros(1)}})


def test_a_refused_tree_leaves_the_block_unchanged(jax_cpu8):
    """wi_0 fits and comes before the misfit wo: nothing is written, wi_0 included."""
    model = build("megablox", {"data": 2, "context": 4}, 8, 32, *MODULES["qwen3_next"][1])
    before = jax.tree.map(np.asarray, to_maxtext(model))
    tree = jax.tree.map(lambda a: np.full(a.shape, 7, a.dtype), before)
    tree["routed_experts"]["wo"] = jnp.zeros((3, 3, 3), model.param_dtype)
    with pytest.raises(ValueError, match="routed_experts/wo"):
        load_maxtext(model, tree)
    for path, value in leaves(before):
        assert np.array_equal(np.asarray(dict(leaves(to_maxtext(model)))[path]), value), path


def test_shared_expert_width_follows_maxtexts_source(jax_cpu8, maxtext_dir):
    """With shared_experts=2, MaxText 0.2.5 builds Qwen3-Next's gated shared expert at
    the expert width (models/qwen3.py: intermediate_dim=cfg.moe_mlp_dim) and DeepSeek's
    at twice it (layers/moe.py: shared_experts x the shared width). Our blocks take the
    same shapes, so a MaxText tree of either loads."""
    qwen3 = (maxtext_dir / "models" / "qwen3.py").read_text()
    routed = (maxtext_dir / "layers" / "moe.py").read_text()
    assert "intermediate_dim=cfg.moe_mlp_dim" in qwen3
    assert "intermediate_dim=self.config.shared_experts * shared_expert_mlp_dim" in routed
    for routing, width in (("qwen3_next", 1), ("deepseek_v3", 2)):
        overrides = [o for o in ROUTINGS[routing] if not o.startswith("shared_experts=")]
        model = build("megablox", {"data": 8}, 8, 32, *overrides, "shared_experts=2")
        hidden = model.spec.hidden
        assert model.weights().shared_wi_0_MS.shape == (model.spec.emb, width * hidden)
        tree = to_maxtext(model)
        load_maxtext(model, tree)  # the tree MaxText's shapes describe loads back
