"""Sharding proven from the compiled fwd+bwd program, not from the Python."""

import jax
import pytest
from hlo import activation_sized, collectives
from layer_helpers import build, compiled_fwd_bwd

from layers.programs import compile_fwd_bwd

BATCH, SEQ, EMB = 2, 2048, 64
CP1, CP4 = {"data": 2, "context": 1}, {"data": 2, "context": 4}
STRATEGIES = ["dense", "megablox", "subgroup_capacity"]
_compiled = {}


def compiled(strategy, sizes):
    key = (strategy, tuple(sizes.items()))
    if key not in _compiled:
        cf = 2.0 if strategy == "subgroup_capacity" else None
        model = build(strategy, sizes, BATCH, SEQ, capacity_factor=cf)
        _compiled[key] = (model, compiled_fwd_bwd(model, BATCH, SEQ, EMB))
    return _compiled[key]


def param_shapes(model):
    return {tuple(a.shape) for a in jax.tree.leaves(model.weights())}


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_no_activation_sized_collective_at_cp4(jax_cpu8, strategy):
    model, program = compiled(strategy, CP4)
    local_tokens = BATCH // 2 * SEQ // 4
    text = program.as_text()
    assert collectives(text), "expected the statistics and gradient reductions"
    bad = activation_sized(text, local_tokens * EMB, BATCH * SEQ, param_shapes(model))
    assert bad == [], f"{strategy} moves activations between devices: {bad}"


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_temp_memory_at_cp4_is_under_030_of_cp1(jax_cpu8, strategy):
    temp1 = compiled(strategy, CP1)[1].memory_analysis().temp_size_in_bytes
    temp4 = compiled(strategy, CP4)[1].memory_analysis().temp_size_in_bytes
    assert temp4 <= 0.30 * temp1, f"{strategy}: {temp4 / temp1:.3f} of the cp=1 temp memory"


def test_the_checker_catches_the_flatten_baseline(jax_cpu8):
    """Today's flatten-and-sort-globally block does move activations: the check sees it."""
    model, _ = compiled("megablox", CP4)
    text = compile_fwd_bwd(model, BATCH, SEQ, flatten_baseline=True).as_text()
    local_tokens = BATCH // 2 * SEQ // 4
    assert activation_sized(text, local_tokens * EMB, BATCH * SEQ, param_shapes(model))
