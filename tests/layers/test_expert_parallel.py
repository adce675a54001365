"""Expert parallelism: routed rows exchanged by all-to-all with the experts' owners.

Parity against the plain reference (output, d/dx and every weight gradient), the same
global statistics as the gathered path, skewed routing that needs several exchange
rounds, and the compiled program's collectives and argument sizes.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hlo import classify, collectives, value_shapes
from layer_helpers import (
    ROUTINGS,
    assert_close,
    build,
    host_weights,
    inputs,
    loss_and_grads,
    reference_grads,
    weight_shapes,
)
from reference import reference_choices, reference_moe

from layers.programs import compile_fwd_bwd

BATCH, SEQ = 8, 32
EP = ("expert_exchange=all_to_all",)
MESHES = {
    "expert2_cp4": {"expert": 2, "context": 4},
    "data2_cp4_folded": {"data": 2, "context": 4},
    "expert4_cp2": {"expert": 4, "context": 2},
    "fsdp2_expert2_cp2": {"fsdp": 2, "expert": 2, "context": 2},
    "data2_expert4_cp1": {"data": 2, "expert": 4},
    "tensor2_cp4": {"context": 4, "tensor": 2},
    "fsdp2_cp4_fsdp_folded": {"fsdp": 2, "context": 4},
}
# The group each mesh's test exchanges over, asked for by name (auto weighs the groups by
# their counted time): the expert axes with the sequence axes folded in; on one mesh
# fsdp folded in as well, so the experts rest split over (fsdp, context) and no device
# gathers an expert's weights over fsdp.
FOLDED = ("expert_group=expert_and_sequence",)
RULES = {"fsdp2_cp4_fsdp_folded": ("expert_group=expert_sequence_and_fsdp",)}
GROUPS = {
    "expert2_cp4": ("expert", "context"),
    "data2_cp4_folded": ("context",),
    "expert4_cp2": ("expert", "context"),
    "fsdp2_expert2_cp2": ("expert", "context"),
    "data2_expert4_cp1": ("expert",),
    "tensor2_cp4": ("context",),
    "fsdp2_cp4_fsdp_folded": ("fsdp", "context"),
}


def check_against_reference(model, x, cot, what: str):
    y, stats, gw, gx = loss_and_grads(model, x, cot)
    ry, rgw, rgx = reference_grads(model, x, cot, 1)
    assert_close(y, ry, what=f"{what} output")
    assert_close(gx, rgx, what=f"{what} d/dx")
    for name in ("gate_ME", "wi_0_EMH", "wi_1_EMH", "wo_EHM"):
        assert_close(getattr(gw, name), getattr(rgw, name), what=f"{what} d/d{name}")
    return stats


@pytest.mark.parametrize("mesh_name", list(MESHES))
def test_matches_reference_and_the_gathered_statistics(jax_cpu8, mesh_name):
    model = build("megablox", MESHES[mesh_name], BATCH, SEQ, *EP, *RULES.get(mesh_name, FOLDED))
    assert model.plan.placement.group_axes == GROUPS[mesh_name]
    group = math.prod(MESHES[mesh_name].get(a, 1) for a in GROUPS[mesh_name])
    assert model.wi_0[...].sharding.shard_shape(model.wi_0[...].shape)[0] == 8 // group
    x, cot = inputs(BATCH, SEQ)
    stats = check_against_reference(model, x, cot, mesh_name)
    gathered = build("megablox", MESHES[mesh_name], BATCH, SEQ, "expert_exchange=gather")
    _, gathered_stats, _, _ = loss_and_grads(gathered, x, cot)
    for key in ("load_balance_loss", "tokens_per_expert", "dropped_tokens", "nonfinite_tokens"):
        np.testing.assert_array_equal(stats[key], gathered_stats[key], err_msg=key)
    # Balanced routing takes two rounds: the default B is half of 1.125 x the even share.
    assert float(stats["exchange_rounds"]) == 2


def test_ragged_dot_backend_matches_reference(jax_cpu8):
    """XLA's ragged_dot as the exchanged block's grouped matmul: its backward goes through
    jax.vjp a slot at a time and adds each slot's weight gradient to the accumulators."""
    model = build(
        "megablox", MESHES["expert2_cp4"], BATCH, SEQ, *EP, *FOLDED, "gmm_backend=ragged_dot"
    )
    assert model.plan.gmm_backend == "ragged_dot"
    x, cot = inputs(BATCH, SEQ)
    check_against_reference(model, x, cot, "ragged_dot")


def test_fsdp_in_the_group_keeps_the_router_and_shared_experts_split(jax_cpu8):
    """With fsdp folded into the expert group, each routed expert rests whole on one
    device, while the router kernel and the gated shared expert (held by every device)
    still rest split over fsdp by their embedding dim; output and every gradient match
    the reference."""
    mesh = MESHES["fsdp2_cp4_fsdp_folded"]
    model = build(
        "megablox", mesh, BATCH, SEQ, *EP, *RULES["fsdp2_cp4_fsdp_folded"], *ROUTINGS["qwen3_next"]
    )
    w = model.weights()
    for name in ("gate_ME", "shared_wi_0_MS", "shared_wi_1_MS", "shared_gate_M1"):
        a = getattr(w, name)
        assert a.sharding.shard_shape(a.shape)[0] == a.shape[0] // mesh["fsdp"], name
    assert w.shared_wo_SM.sharding.shard_shape(w.shared_wo_SM.shape)[1] == 64 // mesh["fsdp"]
    assert w.wi_0_EMH.sharding.shard_shape(w.wi_0_EMH.shape)[0] == 16 // 8
    x, cot = inputs(BATCH, SEQ)
    y, _, gw, gx = loss_and_grads(model, x, cot)
    ry, rgw, rgx = reference_grads(model, x, cot, 1)
    assert_close(y, ry, what="output")
    assert_close(gx, rgx, what="d/dx")
    for name in ("gate_ME", "wi_0_EMH", "wo_EHM", "shared_wi_0_MS", "shared_wo_SM"):
        assert_close(getattr(gw, name), getattr(rgw, name), what=f"d/d{name}")
    assert_close(gw.shared_gate_M1, rgw.shared_gate_M1, what="d/dshared_gate_M1")


def skew(model, x, kind: str):
    """Every token's top-2 on expert 0 and 1 (owner 0's experts, or one expert each)."""
    kernel = np.array(model.gate.kernel[...])
    kernel[0, :] = -50.0
    kernel[0, 0] = 50.0
    if kind == "one_owner":
        kernel[0, 1] = 49.0  # second choice: expert 1, also on group member 0
    model.gate.kernel[...] = jnp.asarray(kernel)
    return x.at[..., 0].set(4.0)


@pytest.mark.parametrize("kind", ["one_expert", "one_owner"])
def test_skewed_routing_takes_more_rounds_and_stays_exact(jax_cpu8, kind):
    model = build("megablox", MESHES["data2_cp4_folded"], BATCH, SEQ, *EP)
    x, cot = inputs(BATCH, SEQ)
    x = skew(model, x, kind)
    stats = check_against_reference(model, x, cot, kind)
    _, ref = reference_moe(host_weights(model), x, model.spec)
    np.testing.assert_array_equal(stats["tokens_per_expert"], ref["tokens_per_expert"])
    counts = np.asarray(stats["tokens_per_expert"])
    assert counts[0] == BATCH * SEQ and float(stats["dropped_tokens"]) == 0
    expected = expected_rounds(model, x, data=2, cp=4, group=4)
    assert expected > 1 and float(stats["exchange_rounds"]) == expected


def expected_rounds(model, x, data: int, cp: int, group: int) -> int:
    """Rounds the exchange needs, from the plain reference routing: the most rows any
    device sends one owner, over B = expert_buffer_factor x its rows / group (rounded up
    to 8)."""
    ids_TK = reference_choices(host_weights(model), x, model.spec)
    ids = np.asarray(ids_TK).reshape(BATCH, SEQ, -1)
    local_experts = model.spec.num_experts // group
    most = 0
    for b in np.split(ids, data, axis=0):
        for shard in np.split(b, cp, axis=1):
            owners = np.bincount(shard.reshape(-1) // local_experts, minlength=group)
            most = max(most, int(owners.max()))
            rows = shard.size
    factor = model.spec.exchange.buffer_factor
    buffer = 8 * math.ceil(factor * rows / group / 8)
    return math.ceil(most / buffer)


def compiled_ep(mesh_name, batch=2, seq=2048):
    model = build("megablox", MESHES[mesh_name], batch, seq, *EP, *RULES.get(mesh_name, FOLDED))
    return model, compile_fwd_bwd(model, batch, seq)


@pytest.mark.parametrize("mesh_name", ["data2_cp4_folded", "expert2_cp4", "fsdp2_cp4_fsdp_folded"])
def test_only_routed_rows_cross_devices_and_weights_stay_home(jax_cpu8, mesh_name):
    batch, seq, emb = 2, 2048, 64
    model, program = compiled_ep(mesh_name, batch, seq)
    text = program.as_text()
    local = batch * seq // model.layout.size(model.layout.token_axes)
    moved = classify(text, weight_shapes(model), local * emb, batch * seq)
    big = moved["activations"]
    assert big and all(op.startswith("all-to-all") for op in big), big
    # With fsdp in the group the router kernel (every device's, split over fsdp by its
    # embedding dim) is gathered like any non-expert weight; no expert weight is.
    m, e = model.spec.emb, model.spec.num_experts
    router_split = set(model.layout.shared_embed) - set(model.layout.embed)
    router = {f"[{m}, {e}]", f"[{e}, {m}]"} if router_split else set()
    gathers = [
        op
        for op in moved["weights"]
        if op.startswith(("all-gather", "reduce-scatter")) and op.split(" ", 1)[1] not in router
    ]
    assert gathers == [], f"expert weights left their owners: {gathers}"
    reductions = [op for op in moved["small"] if op.startswith("all-reduce")]
    assert reductions and all(_elements(op) <= 64 * 8 + 8 for op in reductions), reductions
    # Each device's expert-weight arguments are its E / group experts.
    (w_shardings, _), _ = program.input_shardings
    group = model.layout.size(model.layout.group)
    for name in ("wi_0_EMH", "wi_1_EMH", "wo_EHM"):
        full = getattr(model.weights(), name).shape
        assert getattr(w_shardings, name).shard_shape(full)[0] == full[0] // group


def test_owner_runs_its_experts_one_slot_at_a_time(jax_cpu8):
    """The owner's hidden-sized buffers (gate, up, activation and their gradients) hold
    one slot of B rows, never the whole (G x B)-row receive buffer: B read from the
    compiled program's all-to-all of (G, B, M) row buffers (XLA may split it into G
    pieces of (1, B, M))."""
    batch, seq = 2, 2048
    model, program = compiled_ep("data2_cp4_folded", batch, seq)
    text = program.as_text()
    emb, hidden = model.wi_0[...].shape[1:]
    group = model.layout.size(model.layout.group)
    exchanged = {s for op, shapes in collectives(text) if op == "all-to-all" for s in shapes}
    slots = {s[1] for s in exchanged if len(s) == 3 and s[2] == emb}
    assert len(slots) == 1, exchanged
    (slot,) = slots
    shapes = set(value_shapes(text).values())
    assert (slot, hidden) in shapes, "no slot-sized hidden buffer: the expert matmuls moved"
    assert (group * slot, hidden) not in shapes, "a hidden buffer spans the receive buffer"


def _elements(label: str) -> int:
    """Elements over every result of a collective's label (`op [a, b] [c]`)."""
    shapes = label.split(" ", 1)[1].replace("]", "").split("[")[1:]
    return sum(math.prod(int(d) for d in s.split(",") if d.strip()) for s in shapes)


def test_ragged_backend_lowers_to_ragged_all_to_all(jax_cpu8):
    """The GPU/TPU backend is wired: a plan resolved for an H100 node names it, and the
    block lowers to XLA's ragged-all-to-all (XLA:CPU cannot run it, so it is lowered,
    not executed, here)."""
    from flax import nnx

    import layers
    import selector
    from layers.programs import abstract_inputs, block_forward, fwd_bwd_loss

    cfg = h100_ep_config(2, 256)
    plan = selector.resolve(cfg)  # no live mesh: the H100 platform stands
    assert plan.exchange_backend == "ragged_all_to_all" and plan.gmm_backend == "tiled_gmm"
    model = layers.MoEBlock(cfg, mesh=layers.mesh_for_plan(plan), plan=plan, rngs=nnx.Rngs(0))
    assert model.spec.exchange.backend == "ragged_all_to_all"
    w, x = abstract_inputs(model, 2, 256)
    lowered = jax.jit(jax.grad(fwd_bwd_loss(block_forward(model)), argnums=(0, 1))).lower(w, x)
    text = lowered.as_text()
    assert text.count("ragged_all_to_all") >= 4  # rows and ids there, results back; bwd


def h100_ep_config(batch: int, seq: int, *extra: str):
    """An H100 node's config (its plan names the ragged backend) on (data=2, context=4)
    with the rows exchanged."""
    import selector

    return selector.compose(
        [
            "model=tiny",
            "mesh=h100_8",
            "ici_fsdp_parallelism=1",
            "ici_data_parallelism=2",
            "ici_context_parallelism=4",
            f"per_device_batch_size={batch / 8}",
            f"max_target_length={seq}",
            "dispatch=megablox",
            "allow_local_batch_inflation=true",
            "context_parallel_load_balance=false",
            *EP,
            *extra,
        ]
    )


def emulated_ragged_all_to_all(
    operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *, axis_name, **_
):
    """jax.lax.ragged_all_to_all's documented semantics from plain all_to_all (which
    XLA:CPU runs): the first send_sizes[i] rows from input_offsets[i] of this device's
    operand go to peer i and land at output_offsets[i] in that peer's output, which
    takes recv_sizes[j] rows from peer j. Both sizes are read: a row moves only when the
    sender sends it and the receiver expects it, so a wrong count on either side loses
    rows (and the parity test fails)."""
    peers = input_offsets.shape[0]
    cap = min(operand.shape[0], output.shape[0])
    rows = jnp.arange(cap)
    start = jnp.minimum(input_offsets, operand.shape[0] - cap)
    shift = input_offsets - start
    idx = start[:, None] + shift[:, None] + rows[None, :]
    slices = jnp.take(operand, jnp.minimum(idx, operand.shape[0] - 1).reshape(-1), axis=0)
    slices = slices.reshape(peers, cap, *operand.shape[1:])
    got = jax.lax.all_to_all(slices, axis_name, 0, 0, tiled=True)
    where = jax.lax.all_to_all(output_offsets, axis_name, 0, 0, tiled=True)
    sent = jax.lax.all_to_all(send_sizes, axis_name, 0, 0, tiled=True)  # peer j's to me
    target = where[:, None] + rows[None, :]
    keep = (rows[None, :] < recv_sizes[:, None]) & (rows[None, :] < sent[:, None])
    target = jnp.where(keep, target, output.shape[0]).reshape(-1)
    return output.at[target].set(got.reshape(-1, *operand.shape[1:]), mode="drop")


def test_ragged_rounds_send_each_real_row_once_and_never_overrun_a_slot(jax_cpu8):
    """What the ragged transport tells ragged_all_to_all to send each round: every
    real row of a slot exactly once over the rounds, at most B a round (more would write
    into the next member's slot, whose rows XLA may land in either order), never a
    negative count, and nothing once the rows are spent (empty rows would cross the
    link, which is what the ragged transport exists to avoid). The emulated collective
    cannot show these: its later writes win, and empty rows arrive as empty rows."""
    from layers.expert_parallel import _slot_sizes

    buffer_rows = 8
    counts_G = jnp.asarray([0, 1, 8, 9, 17, 24], jnp.int32)
    needed = math.ceil(int(counts_G.max()) / buffer_rows)
    sizes = np.stack([np.asarray(_slot_sizes(counts_G, r, buffer_rows)) for r in range(needed + 2)])
    assert sizes.dtype == np.int32
    assert sizes.min() >= 0 and sizes.max() <= buffer_rows
    np.testing.assert_array_equal(sizes.sum(0), np.asarray(counts_G))
    np.testing.assert_array_equal(sizes[needed:], 0)
    # Full buffers first: a round sends B rows while B or more are left.
    np.testing.assert_array_equal(sizes[0], [0, 1, 8, 8, 8, 8])


@pytest.mark.parametrize("most", [1, 7, 8, 9, 16, 17])
def test_every_device_agrees_on_enough_rounds_for_the_largest_send(jax_cpu8, most):
    """rounds_needed over 8 devices, one of which sends an owner `most` rows in
    buffers of 8: the fewest rounds that carry them (one more row than a whole number
    of buffers takes one more round), the same on every device."""
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    from layers.expert_parallel import ExchangeGroup, rounds_needed

    mesh = jax.make_mesh((8,), ("context",), axis_types=(AxisType.Explicit,))
    ex = ExchangeGroup(
        group_axes=("context",),
        group_size=8,
        count_axes=("context",),
        buffer_factor=1.0,
        backend="all_to_all",
        gmm_backend="tiled_gmm",
        dtype=jnp.float32,
    )
    counts = np.zeros((8, 8), np.int32)  # (device, owner): what each device sends each owner
    counts[:, 3] = 1
    counts[5, 2] = most

    def body(counts_G):
        return rounds_needed(counts_G[0], 8, ex)[None]

    split = NamedSharding(mesh, P("context"))
    rounds = jax.shard_map(body, mesh=mesh, in_specs=P("context"), out_specs=P("context"))(
        jax.device_put(counts, split)
    )
    np.testing.assert_array_equal(np.asarray(rounds), math.ceil(most / 8))


@pytest.mark.parametrize("kind", ["balanced", "one_owner"])
def test_ragged_backend_logic_with_an_emulated_collective(jax_cpu8, monkeypatch, kind):
    """The ragged transport's offsets and sizes, run on CPU through an emulation of the
    collective: parity with the reference, balanced and over several rounds."""
    from flax import nnx

    import layers
    import selector

    monkeypatch.setattr(jax.lax, "ragged_all_to_all", emulated_ragged_all_to_all)
    cfg = h100_ep_config(BATCH, SEQ, "dtype=float32")
    plan = selector.resolve(cfg)
    assert plan.exchange_backend == "ragged_all_to_all"
    model = layers.MoEBlock(cfg, mesh=layers.mesh_for_plan(plan), plan=plan, rngs=nnx.Rngs(0))
    x, cot = inputs(BATCH, SEQ)
    if kind == "one_owner":
        x = skew(model, x, kind)
    stats = check_against_reference(model, x, cot, f"ragged {kind}")
    assert float(stats["exchange_rounds"]) == expected_rounds(model, x, data=2, cp=4, group=4)
