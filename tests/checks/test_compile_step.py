"""Compile mode's whole training step (`checks.step`): the decoder of the preset with the
chosen MoE block, its layers scanned and rematerialised, AdamW, compiled from abstract
inputs for XLA:CPU's 8 simulated devices and for 8 abstract v5p chips (skipped with the
extra to install when libtpu is missing). What is asserted is read from the compiled
program (its memory analysis and HLO text), against the selector's own counts."""

from __future__ import annotations

import re

import pytest

import selector
from selector import targets
from selector.architecture import model_params

LAYERS = 5  # a trip count no other loop of the step has (attention blocks: 1, 2, 4)
TINY = [
    "model=tiny",
    "mesh=cpu_8",
    "ici_fsdp_parallelism=2",
    "ici_context_parallelism=4",
    "per_device_batch_size=0.25",
    "max_target_length=1024",
    f"base_num_decoder_layers={LAYERS}",
    "context_parallel_load_balance=false",
]
# Compiled peak over the estimate's device_bytes, at most (seen: XLA:CPU 2.3; XLA:TPU
# 4.6, its tiles padding every tiny dim of 16 or 64 to 128).
PEAK_OVER_ESTIMATE = {"cpu": 3.0, "tpu": 6.0}


def compiled(*more: str, target=None, layers: int = LAYERS):
    from checks.step import compile_step

    tiny = [o for o in TINY if not o.startswith("base_num_decoder_layers=")]
    cfg = selector.compose([*tiny, f"base_num_decoder_layers={layers}", *more])
    plan = selector.resolve(cfg)
    try:
        program, numbers = compile_step(cfg, plan, target)
    except targets.TargetUnavailable as exc:
        pytest.skip(str(exc))
    return cfg, plan, program, numbers


@pytest.fixture(scope="module")
def cpu_step(jax_cpu8):
    return compiled()


# Multi-head latent attention at tiny sizes (DeepSeek-V3's kind): its low-rank dims
# (32, 16) split over the 8 devices as MaxText's q_lora/kv_lora rules split them.
MLA = [
    "attention_type=mla",
    "q_lora_rank=32",
    "kv_lora_rank=16",
    "qk_nope_head_dim=16",
    "qk_rope_head_dim=8",
    "v_head_dim=16",
]


@pytest.fixture(scope="module")
def mla_cpu_step(jax_cpu8):
    return compiled(*MLA)


# Qwen3-Next's decoder at tiny sizes: two scanned cycles of three Gated DeltaNet layers
# and one gated full-attention layer, every layer with the MoE block, the sequence split
# over context=4 (the GDN's state and convolution halo cross the shards).
NEXT = [
    "decoder_block=qwen3_next",
    "inhomogeneous_layer_cycle_interval=4",
    "base_num_query_heads=4",
    "base_num_kv_heads=2",
    "head_dim=16",
    "gdn_num_key_heads=2",
    "gdn_num_value_heads=4",
    "gdn_key_head_dim=16",
    "gdn_value_head_dim=16",
]
NEXT_LAYERS = 8


@pytest.fixture(scope="module")
def next_cpu_step(jax_cpu8):
    return compiled(*NEXT, layers=NEXT_LAYERS)


@pytest.fixture(scope="module")
def tpu_step():
    # The Pallas megablox kernel does not trace inside the rematerialised scan (jax
    # 0.10.2: a vma mismatch in the shard_map's partial evaluation); the tiled gmm does.
    # The experts gathered over embed (what the relayout tests read; auto would exchange
    # them over the fsdp devices).
    return compiled(
        "hardware=v5p",
        "gmm_backend=tiled_gmm",
        "expert_exchange=gather",
        target=targets.Target("v5p", 8),
    )


@pytest.fixture(scope="module")
def gpu_step():
    return compiled("hardware=h200", "expert_exchange=gather", target=targets.Target("h200", 8))


def trip_counts(text: str) -> list[int]:
    return [int(n) for n in re.findall(r'known_trip_count":\{"n":"(\d+)"', text)]


def op_names(text: str) -> str:
    return " ".join(re.findall(r'op_name="([^"]*)"', text))


def test_flash_attention_matches_full_scores(jax_cpu8):
    """The blockwise kernel (several query and key blocks) gives the plain attention's
    output and gradients, queries of one shard against the whole sequence's keys."""
    import jax
    import jax.numpy as jnp

    import checks.flash as flash

    keys = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(keys[0], (2, 64, 2, 3, 8))
    k = jax.random.normal(keys[1], (2, 128, 2, 8))
    v = jax.random.normal(keys[2], (2, 128, 2, 6))
    q_pos, k_pos = 64 + jnp.arange(64), jnp.arange(128)

    def loss(fn):
        return lambda q, k, v: jnp.sum(jnp.sin(fn(q, k, v, q_pos, k_pos)))

    # Each computation compiled once (op by op, the block loops compile many small
    # programs); BLOCK is read while tracing, inside the try.
    saved, flash.BLOCK = flash.BLOCK, 16
    try:
        assert flash.block_size(64) == 16
        got = jax.jit(flash.flash_attention)(q, k, v, q_pos, k_pos)
        grads = jax.jit(jax.grad(loss(flash.flash_attention), argnums=(0, 1, 2)))(q, k, v)
    finally:
        flash.BLOCK = saved
    want = jax.jit(flash.reference_attention)(q, k, v, q_pos, k_pos)
    want_grads = jax.jit(jax.grad(loss(flash.reference_attention), argnums=(0, 1, 2)))(q, k, v)
    assert jnp.allclose(got, want, atol=1e-5)
    for g, w in zip(grads, want_grads, strict=True):
        assert jnp.allclose(g, w, atol=1e-5)


@pytest.mark.parametrize("step", ["cpu_step", "mla_cpu_step", "next_cpu_step"])
def test_cpu_step_holds_every_parameter_and_adamw_state(step, request):
    """The arguments are the parameters (the selector's count x 4 bytes / 8 shards: every
    weight is split over fsdp x context, MLA's up-projections and the GDN's convolution
    included; only the GDN's two scalars a value head rest whole), AdamW's two float32
    moments of each, the step count and the tokens; the donated parameters and state
    come back in place."""
    cfg, plan, program, numbers = request.getfixturevalue(step)
    m = program.memory_analysis()
    config = selector.to_config(cfg)
    count = model_params(config).total
    whole = 0
    if config.decoder_block == "qwen3_next":
        interval = config.inhomogeneous_layer_cycle_interval
        linear = NEXT_LAYERS // interval * (interval - 1)
        whole = 2 * config.gdn_num_value_heads * linear * 4  # a_log, dt_bias
    params = (count * 4 - whole) // 8 + whole
    tokens = 2 * round(plan.per_device.tokens_per_device) * 4  # inputs and targets, int32
    assert m.argument_size_in_bytes == params + 2 * params + 4 + tokens
    assert m.alias_size_in_bytes >= 3 * params
    assert numbers.params == params and numbers.optimizer == 2 * params + 4


def test_cpu_step_scans_layers_through_the_moe_block(cpu_step):
    """The HLO has the layers' loop (forward and backward, trip count = layers) and the
    MoE block's shard_map phases inside the step."""
    _, plan, program, _ = cpu_step
    text = program.as_text()
    assert trip_counts(text).count(LAYERS) >= 2
    names = op_names(text)
    assert "shard_map" in names
    for phase in ("route", "expert_compute", "combine"):
        assert phase in names, phase


def test_qwen3_next_step_scans_its_cycles_and_keeps_the_sequence_split(next_cpu_step):
    """The cycles' loop (forward and backward, trip count = cycles); the GDN's halo
    crosses the context shards by collective-permute and its state maps by all-gather;
    no GDN operand spans the whole sequence (1,024 tokens: a device's 256 only)."""
    cfg, _, program, _ = next_cpu_step
    text = program.as_text()
    assert trip_counts(text).count(NEXT_LAYERS // 4) >= 2
    assert "collective-permute" in text
    assert not re.search(r"\[1,1024,4,16\]|\[1,1024,64\]", text)


def test_cpu_step_peak_near_estimate(cpu_step):
    _, plan, _, numbers = cpu_step
    ratio = numbers.peak / plan.chosen_estimate.device_bytes
    assert 1 / PEAK_OVER_ESTIMATE["cpu"] <= ratio <= PEAK_OVER_ESTIMATE["cpu"], ratio


def test_more_remat_saves_more(jax_cpu8, cpu_step):
    """remat_policy=minimal keeps the named projections (query/key/value/out) across
    layers: the compiled step needs more temp than with full remat."""
    *_, full = cpu_step
    *_, minimal = compiled("remat_policy=minimal")
    assert minimal.temp > full.temp


def test_tpu_step_holds_parameters_and_state(tpu_step):
    """On XLA:TPU the parameters and both moments are there, within the padding of its
    (8, 128) tiles; the step has its loops (the layers scanned)."""
    cfg, plan, program, numbers = tpu_step
    m = program.memory_analysis()
    params = model_params(selector.to_config(cfg)).total * 4 // 8
    assert 3 * params <= m.argument_size_in_bytes <= 3 * numbers.params * 4
    # XLA:TPU's text names no trip counts: the layers' loop is seen as while loops.
    assert " while(" in program.as_text()
    ratio = numbers.peak / plan.chosen_estimate.device_bytes
    assert 1 / PEAK_OVER_ESTIMATE["tpu"] <= ratio <= PEAK_OVER_ESTIMATE["tpu"], ratio


def test_compile_mode_speaks_for_the_whole_step(jax_cpu8):
    """compile=true on a training config compiles the whole step: the candidate's bytes
    a device are the step's compiled peak, the report says so, and progress is heard."""
    from checks.compile_mode import check
    from selector.report import render_compiled

    heard = []
    config = selector.to_config(selector.compose(TINY))
    plan, findings, result = check(config, progress=heard.append)
    chosen = result.compiled[0]
    assert chosen.step is not None
    assert chosen.device_bytes == chosen.step.peak
    assert chosen.as_dict()["compiled_program"] == "whole step"
    assert any("whole training step" in line for line in heard)
    text = "\n".join(render_compiled(result, 1.0))
    assert "whole step" in text


def expert_stack(cfg, plan) -> tuple[list[int], float]:
    """One expert matrix's layer stack as a device holds it for its all-gather, with the
    embed shard leading (emb / embed shards, layers, local experts, hidden / hidden
    shards), and the bytes of all three matrices' stacks in float32 (tiny's weights)."""
    c = selector.to_config(cfg)
    place, mesh = plan.placement, plan.mesh
    shape = [
        c.base_emb_dim // mesh.product(place.embed_axes),
        LAYERS,
        c.num_experts // mesh.product(place.experts_axes),
        c.base_moe_mlp_dim // mesh.product(place.hidden_axes),
    ]
    return shape, 3 * 4 * shape[0] * shape[1] * shape[2] * shape[3]


def relaid_stacks(cfg, plan, text: str) -> list[str]:
    """Instructions of the compiled program whose result is such a stack."""
    dims = ",".join(map(str, expert_stack(cfg, plan)[0]))
    return re.findall(rf"= f32\[{dims}\]\{{[^}}]*\}} \S+\(", text)


def test_gpu_step_holds_the_expert_stacks_relaid_and_the_estimate_counts_them(gpu_step):
    """XLA:GPU all-gathers along an array's leading dimension: it copies each expert
    matrix's whole layer stack, in the stored dtype, into a layout with the embed shard
    leading (three matrices), and the estimate's weights_cast counts that copy (tiny
    stores and computes in float32, so nothing else is cast). Read from the compiled
    HLO."""
    cfg, plan, program, _ = gpu_step
    assert plan.placement.embed_axes, "a placement that gathers over embed"
    assert len(relaid_stacks(cfg, plan, program.as_text())) >= 3
    cast = plan.chosen_estimate.device_breakdown["weights_cast"]
    assert cast == pytest.approx(expert_stack(cfg, plan)[1], rel=1e-9)


def test_tpu_step_gathers_the_expert_stacks_in_place(tpu_step):
    """XLA:TPU makes no such copy, and the estimate counts none."""
    cfg, plan, program, _ = tpu_step
    assert plan.placement.embed_axes, "a placement that gathers over embed"
    assert relaid_stacks(cfg, plan, program.as_text()) == []
    assert plan.chosen_estimate.device_breakdown["weights_cast"] == 0


def test_cost_analysis_reads_what_jax_012s_xla_gpu_prints():
    """jax 0.12.0.1's XLA:GPU prints all-reduce-start with output_to_operand_aliasing,
    which its HLO parser rejects; the cost analysis drops that attribute and nothing
    else. The line is from that compiler's program for 64 H200s (Qwen3-30B-A3B, cp 1)."""
    from checks.compiled import _OPERAND_ALIASING

    printed = (
        "%all-reduce-start.1 = ((f32[256]{0}), f32[256]{0}) all-reduce-start("
        "%wrapped_concatenate.1), channel_id=1, use_global_device_ids=true, "
        "to_apply=%region_79.84, output_to_operand_aliasing={{1}: (0, {})}, "
        'metadata={op_name="jit(step)"}'
    )
    assert _OPERAND_ALIASING.sub("", printed) == (
        "%all-reduce-start.1 = ((f32[256]{0}), f32[256]{0}) all-reduce-start("
        "%wrapped_concatenate.1), channel_id=1, use_global_device_ids=true, "
        'to_apply=%region_79.84, metadata={op_name="jit(step)"}'
    )
