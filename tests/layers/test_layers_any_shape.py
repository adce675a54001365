"""One MoEBlock at any input the mesh divides: built once for (2, 32) on (fsdp=2,
context=4), called at other (batch, sequence) in training (forward and gradients),
prefill and decode, each against the plain reference MoE at the parity tests' tolerance;
an input no plan can serve is refused with the selector's finding and its fix."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from layer_helpers import assert_close, build, host_weights, inputs, reference_grads_and_keep
from reference import reference_capacity, reference_keep, reference_moe

import selector

MESH = {"fsdp": 2, "context": 4}
CP = 4
BUILT = (2, 32)
# (dispatch, extra overrides, capacity_factor, the other input): capacity 0.5 drops
# tokens, and its per-subgroup capacity at 64 tokens (16 a subgroup: 2) is not the
# built one (8 a subgroup: 1), so numbers kept from the build would show.
TRAINING = {
    "dense": ("dense", (), None, (4, 8)),
    "subgroup_capacity": ("subgroup_capacity", (), 0.5, (2, 64)),
    "megablox_gathered": ("megablox", (), None, (6, 8)),
    "megablox_exchanged": ("megablox", ("expert_exchange=all_to_all",), None, (2, 64)),
}


@pytest.fixture(scope="module")
def blocks(jax_cpu8):
    """Blocks built once for (2, 32), shared by the tests below."""
    built = {
        name: build(strategy, MESH, *BUILT, *extra, capacity_factor=cf)
        for name, (strategy, extra, cf, _) in TRAINING.items()
    }
    assert built["megablox_exchanged"].layout.group  # the rows really are exchanged
    assert not built["megablox_gathered"].layout.group
    return built


@nnx.jit
def _fwd_bwd(model, x, cot):
    def loss(model, x):
        y, stats = model(x)
        return jnp.sum(y * cot), (y, stats)

    grad_fn = nnx.value_and_grad(loss, argnums=(0, 1), has_aux=True)
    (_, (y, stats)), (grads, gx) = grad_fn(model, x)
    return y, stats, grads, gx


@nnx.jit
def _forward(model, x):
    return model(x)


def _on_mesh(model, x):
    return jax.device_put(x, model.layout.named(model.layout.x_BSM))


@pytest.mark.parametrize("name", list(TRAINING))
def test_training_at_another_shape_matches_reference(blocks, name):
    model = blocks[name]
    batch, seq = TRAINING[name][3]
    x, cot = inputs(batch, seq)
    y, stats, grads, gx = _fwd_bwd(model, _on_mesh(model, x), cot)
    ry, rgw, rgx, keep = reference_grads_and_keep(model, x, cot, CP)
    assert y.shape == (batch, seq, 64)
    assert float(stats["dropped_tokens"]) == float(np.sum(~keep))
    assert float(np.sum(stats["tokens_per_expert"])) == batch * seq * model.spec.top_k
    assert_close(y, ry, what="output")
    assert_close(gx, rgx, what="d/dx")
    got = {
        "gate_ME": grads["gate"]["kernel"][...],
        "wi_0_EMH": grads["wi_0"][...],
        "wi_1_EMH": grads["wi_1"][...],
        "wo_EHM": grads["wo"][...],
    }
    for field, g in got.items():
        assert_close(g, getattr(rgw, field), what=f"d/d{field}")
    # The numbers are this input's; the block's own plan is still the built one.
    plan, _, spec = model.at_shape(x.shape)
    assert plan.per_device.tokens_per_device == batch * seq / 8
    assert model.plan.per_device.tokens_per_device == BUILT[0] * BUILT[1] / 8
    if name == "subgroup_capacity":
        assert np.sum(~keep) > 0  # the case must exercise drops
        assert spec.capacity(seq // CP) == reference_capacity(seq // CP, spec) == 2


def test_prefill_at_another_shape_matches_reference(jax_cpu8):
    model = build("subgroup_capacity", MESH, *BUILT, "mode=prefill", capacity_factor=0.5)
    assert not model.plan.training
    x, _ = inputs(4, 64)
    y, stats = _forward(model, _on_mesh(model, x))
    w = host_weights(model)
    keep = reference_keep(w, x, model.spec, CP)
    ry, rstats = reference_moe(w, x, model.spec, keep)
    assert rstats["dropped_tokens"] > 0
    assert float(stats["dropped_tokens"]) == rstats["dropped_tokens"]
    assert_close(y, ry, what="prefill output")


@pytest.mark.parametrize("batch", [4, 16])
def test_decode_at_another_batch_matches_reference(jax_cpu8, batch):
    model = build("megablox", {"fsdp": 4, "context_autoregressive": 2}, 8, 32, "mode=decode")
    assert model.plan.per_device.seq_len == 1
    x, _ = inputs(batch, 1)
    y, stats = _forward(model, _on_mesh(model, x))
    ry, rstats = reference_moe(host_weights(model), x, model.spec)
    assert_close(y, ry, what="decode output")
    np.testing.assert_allclose(stats["tokens_per_expert"], rstats["tokens_per_expert"], rtol=0)
    with pytest.raises(selector.ConfigError, match="mode=prefill") as info:
        model(jnp.zeros((batch, 2, 64)))
    assert [f.code for f in info.value.findings] == ["INPUT_SEQUENCE_FOR_MODE"]


@pytest.mark.parametrize(
    "shape, code, fix",
    [
        ((3, 32, 64), "BATCH_NOT_DIVISIBLE", "per_device_batch_size=0.25"),
        ((2, 30, 64), "SEQUENCE_NOT_DIVISIBLE", "max_target_length=32"),
        ((2, 32, 48), "INPUT_EMB_MISMATCH", "base_emb_dim=48"),
    ],
)
def test_an_input_no_plan_serves_is_refused_with_finding_and_fix(blocks, shape, code, fix):
    model = blocks["megablox_gathered"]
    with pytest.raises(selector.ConfigError) as info:
        model(jnp.zeros(shape))
    errors = [f for f in info.value.findings if f.severity is selector.Severity.error]
    assert [f.code for f in errors] == [code]
    assert fix in [f.render() for f in errors[0].fixes]
    assert str(shape) in str(info.value) and fix in str(info.value)


def test_the_built_strategy_stays_with_this_shapes_numbers(jax_cpu8):
    """auto chose dense at (2, 32); at (2, 1024) it would choose megablox, but the block
    keeps dense (its weights, its semantics) with the numbers of (2, 1024)."""
    model = build("auto", MESH, *BUILT)
    assert model.plan.strategy is selector.Dispatch.dense
    cfg = selector.compose(
        [
            "model=tiny",
            "mesh=cpu_8",
            "hardware=cpu",
            "ici_fsdp_parallelism=2",
            "ici_context_parallelism=4",
            "per_device_batch_size=0.25",
            "max_target_length=1024",
            "expert_exchange=gather",
            "allow_local_batch_inflation=true",
            "context_parallel_load_balance=false",
        ]
    )
    fresh = selector.resolve(cfg, model.layout.mesh)
    assert fresh.strategy is selector.Dispatch.megablox  # the shape would flip the choice
    plan, layout, spec = model.at_shape((2, 1024, 64))
    assert plan.strategy is selector.Dispatch.dense
    assert plan.placement == model.plan.placement
    assert plan.per_device == fresh.per_device
    assert layout.weight_specs() == model.layout.weight_specs()
    again = model.at_shape((2, 1024, 64))[0]
    assert again.per_device is plan.per_device  # resolved once per shape, then cached
    assert model.at_shape((2, 32, 64))[0] is model.plan
