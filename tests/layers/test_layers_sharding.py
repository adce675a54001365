"""Sharding proven from the compiled fwd+bwd program, not from the Python."""

import math

import jax
import numpy as np
import pytest
from hlo import classify, collectives, dot_flops
from layer_helpers import build, compiled_fwd_bwd, weight_shapes

from bench.flatten_baseline import flatten_block_forward
from layers.programs import compile_fwd_bwd

BATCH, SEQ, EMB = 2, 2048, 64
CP1, CP4 = {"data": 2, "context": 1}, {"data": 2, "context": 4}
STRATEGIES = ["dense", "megablox", "subgroup_capacity"]
WEIGHTS = ("wi_0_EMH", "wi_1_EMH", "wo_EHM")
_compiled = {}


def compiled(strategy, sizes, batch=BATCH, seq=SEQ):
    key = (strategy, tuple(sizes.items()), batch, seq)
    if key not in _compiled:
        cf = 2.0 if strategy == "subgroup_capacity" else None
        model = build(strategy, sizes, batch, seq, capacity_factor=cf)
        _compiled[key] = (model, compiled_fwd_bwd(model, batch, seq, EMB))
    return _compiled[key]


def traffic(model, program, batch=BATCH, seq=SEQ):
    local_tokens = batch * seq // model.layout.size(model.layout.token_axes)
    return classify(program.as_text(), weight_shapes(model), local_tokens * EMB, batch * seq)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_only_weights_and_statistics_cross_devices_at_cp4(jax_cpu8, strategy):
    model, program = compiled(strategy, CP4)
    moved = traffic(model, program)
    assert moved["weights"], "the at-rest weights must be gathered into the block"
    assert moved["small"], "expected the statistics reduction"
    assert moved["activations"] == [], f"{strategy} moves activations: {moved['activations']}"


def total_bytes(program) -> int:
    """What one device holds for the program: arguments, outputs and temporaries."""
    m = program.memory_analysis()
    return (
        m.argument_size_in_bytes
        + m.output_size_in_bytes
        + m.temp_size_in_bytes
        - m.alias_size_in_bytes
    )


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_memory_per_device_at_cp4_is_under_030_of_cp1(jax_cpu8, strategy):
    """Everything a device holds (weights at rest, input, gradients, temporaries) at
    cp = 4 against cp = 1 for the same global batch. The gathered weight copy does not
    shrink with cp (that is what expert parallelism is for), so this runs at a length
    where the activations dominate, as they do in long-context training."""
    seq = 8192
    cp1 = total_bytes(compiled(strategy, CP1, seq=seq)[1])
    cp4 = total_bytes(compiled(strategy, CP4, seq=seq)[1])
    assert cp4 <= 0.30 * cp1, f"{strategy}: {cp4 / cp1:.3f} of the cp=1 memory"


def test_the_checker_catches_the_flatten_baseline(jax_cpu8):
    """Today's flatten-and-sort-globally block does move activations: the check sees it."""
    model, _ = compiled("megablox", CP4)
    program = compile_fwd_bwd(model, BATCH, SEQ, forward=flatten_block_forward(model))
    assert traffic(model, program)["activations"]


def _weight_arg_bytes(model, program) -> int:
    """Per-device bytes of the expert weights among the compiled program's arguments."""
    (w_shardings, _), _ = program.input_shardings
    total = 0
    for name in WEIGHTS:
        full = getattr(model.weights(), name)
        shard = getattr(w_shardings, name).shard_shape(full.shape)
        total += math.prod(shard) * full.dtype.itemsize
    return total


def test_weights_rest_sharded_over_context_and_gradients_leave_that_way(jax_cpu8):
    """At (data=2, context=4) a device holds 1/4 of the expert weights it holds at
    (data=2), and the compiled gradients come out in exactly the at-rest sharding."""
    model2, prog2 = compiled("megablox", {"data": 2})
    model8, prog8 = compiled("megablox", CP4)
    assert _weight_arg_bytes(model8, prog8) * 4 == _weight_arg_bytes(model2, prog2)
    # The arguments XLA allocates agree with the shardings read above (x is the rest).
    x_bytes = BATCH * SEQ * EMB * 4 // 8
    gate_bytes = EMB * 8 * 4 // 4
    args = prog8.memory_analysis().argument_size_in_bytes
    assert args == _weight_arg_bytes(model8, prog8) + x_bytes + gate_bytes
    grads_w, _ = prog8.output_shardings
    ins_w, _ = prog8.input_shardings[0]
    for name in (*WEIGHTS, "gate_ME"):
        ndim = getattr(model8.weights(), name).ndim
        assert getattr(grads_w, name).is_equivalent_to(getattr(ins_w, name), ndim), name
    assert any(op.startswith("reduce-scatter") for op in traffic(model8, prog8)["weights"])


TENSOR_MESHES = {"tensor2_cp4": {"context": 4, "tensor": 2}, "cp4": {"context": 4}}


@pytest.mark.parametrize("strategy", ["dense", "subgroup_capacity"])
def test_tensor_axis_splits_the_expert_matmuls(jax_cpu8, strategy):
    """With tensor=2 each device computes half of every expert's hidden dim: no weight
    is gathered over tensor, and the FLOPs of the compiled expert matmuls (forward and
    backward, counted from the HLO's dots) halve per device. (megablox's grouped
    matmul runs in loops whose trip counts HLO does not state; its split is proven by
    the same layout and by parity.)"""
    model, program = compiled(strategy, TENSOR_MESHES["tensor2_cp4"], batch=2, seq=512)
    _, plain = compiled(strategy, TENSOR_MESHES["cp4"], batch=2, seq=512)
    e, m, h = model.spec.num_experts, model.spec.emb, model.spec.hidden
    full_h = {(e, m, h), (e, h, m), (e, m // 4, h), (e, h, m // 4)}
    moved = traffic(model, program, batch=2, seq=512)
    gathered_over_tensor = [
        op for op in moved["weights"] if op.startswith("all-gather") and _shape(op) in full_h
    ]
    assert gathered_over_tensor == []
    split = dot_flops(program.as_text(), "expert_compute")
    whole = dot_flops(plain.as_text(), "expert_compute")
    assert whole > 0 and split / whole == 0.5, (split, whole)


@pytest.mark.parametrize("strategy", ["megablox", "dense"])
def test_the_input_gradient_is_summed_over_tensor_once_per_token(jax_cpu8, strategy):
    """tensor=2 x context=4, the weights gathered: each device holds half of every
    expert's hidden dim, so the block's output and its input gradient are partial sums
    over tensor. Each is all-reduced once, over the T tokens a device holds: never over
    its T x k routed rows (megablox; k times the bytes), nor once per matrix that reads
    the tokens (dense: gate and up). What `selector.cost.traffic` counts."""
    model, program = compiled(strategy, TENSOR_MESHES["tensor2_cp4"], batch=2, seq=512)
    tokens = 2 * 512 // 4
    rows = tokens * model.spec.top_k
    assert model.spec.top_k > 1 and model.plan.placement.exchange.value == "gather"
    reduced = [
        s for op, shapes in collectives(program.as_text()) if op == "all-reduce" for s in shapes
    ]
    by_rows = [s for s in reduced if s[-1:] == (EMB,) and math.prod(s) == rows * EMB]
    by_tokens = [s for s in reduced if s[-1:] == (EMB,) and math.prod(s) == tokens * EMB]
    assert not by_rows, f"input gradient summed over the routed rows: {by_rows}"
    assert len(by_tokens) == 2, by_tokens  # the output (forward), the input gradient


def _shape(label: str) -> tuple[int, ...]:
    return tuple(int(d) for d in label.split("[", 1)[1].rstrip("]").split(",") if d.strip())


def test_block_places_its_parameters_without_a_replica(jax_cpu8):
    """The parameters come out of creation in their at-rest sharding (never replicated
    and moved), with the sharding recorded as Flax metadata."""
    from flax import nnx

    model = build("megablox", {"fsdp": 2, "context": 2, "tensor": 2}, 4, 64)
    specs = nnx.get_partition_spec(nnx.state(model, nnx.Param))
    weights = model.weights()
    names, _, shardings = model.param_layout()
    for name, want in zip(names, shardings, strict=True):
        value = getattr(weights, name)
        assert value.sharding.spec == want.spec, name
        assert not value.sharding.is_fully_replicated
    assert specs["wi_0"].get_value() == model.layout.weight_specs()["wi_0_EMH"]
    assert np.all(np.isfinite(np.asarray(jax.device_get(model.wo[...]))))


@pytest.mark.parametrize("strategy", ["megablox", "dense"])
def test_gradients_of_replicated_shards_are_summed_after_the_reduce_scatter(jax_cpu8, strategy):
    """On (data=2, expert=4), gathered: the expert weights rest split 4 ways over
    expert and alike on both data devices. Their gradients leave by a reduce-scatter
    over expert and are summed over data on the shard it leaves (E/4 experts), never as
    the whole gathered gradient of all E experts (4x the bytes) before it."""
    model, program = compiled(strategy, {"data": 2, "expert": 4}, batch=8, seq=256)
    experts = model.spec.num_experts
    assert model.plan.placement.exchange.value == "gather"
    reduced = [
        s for op, shapes in collectives(program.as_text()) if op == "all-reduce" for s in shapes
    ]
    whole = [s for s in reduced if len(s) == 3 and s[0] == experts]
    shard = [s for s in reduced if len(s) == 3 and s[0] == experts // 4]
    assert not whole, f"whole gathered gradients all-reduced: {whole}"
    assert len(shard) == 3  # wi_0, wi_1, wo: each shard summed over data once
