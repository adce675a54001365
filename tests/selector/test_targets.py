"""Every dispatch the selector can choose compiles for the chips users train on, and the
compiled TPU and GPU programs move what the plan says: XLA:TPU (libtpu) for a v5p slice
of 8 chips and XLA:GPU (JAX's CUDA plugin) for a node of 8 H100s, compiled ahead of time
on abstract devices (nothing runs). Skipped with the extra to install when a compiler
plugin is absent; CI installs both."""

from __future__ import annotations

import math
import os

import pytest
from hlo import collectives, dot_flops

import layers
import selector
from checks.compiled import compile_plan
from checks.targets import devices
from selector import targets

EMB, HIDDEN, EXPERTS, TOP_K = 128, 384, 8, 2
TARGETS = {"tpu": targets.Target("v5p", 8), "gpu": targets.Target("h100", 8)}
HARDWARE = {"tpu": "v5p", "gpu": "h100"}
# (mode, mesh, batch, seq): training and prefill split the sequence 4 ways; decode's one
# new token per sequence is split over the batch axes only.
SHAPES = {
    "train": ({"fsdp": 2, "context": 4}, 2, 1280),
    "prefill": ({"fsdp": 2, "context": 4}, 2, 1280),
    "decode": ({"fsdp": 2, "expert": 4}, 40, 1),  # 5 tokens a device: far under a tile
}
# Backends the selector can choose on each platform (auto's pick first).
BACKENDS = {
    "tpu": ("pallas_megablox", "tiled_gmm", "ragged_dot"),
    "gpu": ("tiled_gmm", "ragged_dot"),
}


def target_devices(platform: str):
    try:
        return devices(TARGETS[platform])
    except targets.TargetUnavailable as exc:
        pytest.skip(str(exc))


def cases():
    """(platform, mode, dispatch, exchange, backend, dtype) for each program compiled."""
    out = []
    for platform in TARGETS:
        for mode in SHAPES:
            dispatches = (
                ["megablox"] if mode == "decode" else ["megablox", "dense", "subgroup_capacity"]
            )
            for dispatch in dispatches:
                for exchange in ("gather", "all_to_all") if dispatch == "megablox" else ("gather",):
                    backends = BACKENDS[platform] if dispatch == "megablox" else ("auto",)
                    if mode != "train" or exchange == "all_to_all":
                        backends = backends[:1]  # every backend is compiled for training
                    for backend in backends:
                        out.append((platform, mode, dispatch, exchange, backend, "bfloat16"))
        # float32 training: every dispatch, the grouped matmul gathered and exchanged
        for dispatch, exchange in (
            ("megablox", "gather"),
            ("megablox", "all_to_all"),
            ("dense", "gather"),
            ("subgroup_capacity", "gather"),
        ):
            backend = BACKENDS[platform][0] if dispatch == "megablox" else "auto"
            out.append((platform, "train", dispatch, exchange, backend, "float32"))
    return out


def build(platform, mode, dispatch, exchange, backend, dtype, mesh_sizes=None):
    sizes, batch, seq = SHAPES[mode]
    sizes = mesh_sizes or sizes
    mesh = layers.make_mesh(sizes, target_devices(platform))
    knobs = [f"ici_{axis}_parallelism={n}" for axis, n in sizes.items()]
    cfg = selector.compose(
        [
            "model=tiny",
            f"hardware={HARDWARE[platform]}",
            f"num_devices={math.prod(sizes.values())}",
            "ici_fsdp_parallelism=1",
            *knobs,
            f"mode={mode}",
            f"dispatch={dispatch}",
            f"expert_exchange={exchange}",
            f"gmm_backend={backend}",
            f"capacity_factor={1.25 if dispatch == 'subgroup_capacity' else -1}",
            f"base_emb_dim={EMB}",
            f"base_moe_mlp_dim={HIDDEN}",
            f"num_experts={EXPERTS}",
            f"num_experts_per_tok={TOP_K}",
            f"max_target_length={seq if mode != 'decode' else 1024}",
            f"per_device_batch_size={batch / math.prod(sizes.values())}",
            f"dtype={dtype}",
            f"param_dtype={dtype}",
            "context_parallel_load_balance=false",
            *(["allow_local_batch_inflation=true"] if mesh_sizes else []),
        ]
    )
    plan = selector.resolve(cfg, mesh)
    block, program, _, _ = compile_plan(cfg, plan, TARGETS[platform])
    return block, program, batch, seq


def case_id(case):
    return "-".join(case)


def token_traffic(text: str, moves_rows: tuple[str, ...] = ()) -> list:
    """Collectives carrying token-sized data other than by the ops in `moves_rows`.
    Every token dim here (sequence 1280, its shards, the rows routed from them, decode's
    40 tokens) holds the factor 5 and no weight dim does (2^a 3^b), so a result with a
    dim divisible by 5 is token data, however the compiler permutes or merges dims."""
    return [
        (op, shapes)
        for op, shapes in collectives(text)
        if op not in moves_rows and any(d % 5 == 0 for s in shapes for d in s)
    ]


@pytest.mark.parametrize("case", cases(), ids=case_id)
def test_compiles_for_target_and_moves_what_the_plan_says(case):
    platform, mode, dispatch, exchange, backend, dtype = case
    block, program, batch, seq = build(*case)
    plan = block.plan
    assert plan.strategy.value == dispatch and plan.placement.exchange.value == exchange
    if dispatch == "megablox":
        want = backend if backend != "auto" else BACKENDS[platform][0]
        assert plan.gmm_backend == want
    text = program.as_text()
    assert program.memory_analysis().temp_size_in_bytes > 0
    weight_moves = [
        math.prod(max(shapes, key=math.prod))
        for op, shapes in collectives(text)
        if op in ("all-gather", "reduce-scatter") and shapes
    ]
    if exchange == "all_to_all":
        transport = "ragged-all-to-all"  # the GPU/TPU transport, compiled natively
        assert plan.exchange_backend == "ragged_all_to_all"
        assert any(op == transport for op, _ in collectives(text)), "no ragged all-to-all"
        assert token_traffic(text, ("all-to-all", transport)) == []
        # Owners keep their E / group experts: nothing larger than that is gathered.
        owned = EXPERTS // block.layout.size(block.layout.group) * EMB * HIDDEN
        assert max(weight_moves, default=0) <= owned, "expert weights left their owners"
    else:
        assert token_traffic(text) == [], "tokens crossed devices"
        assert max(weight_moves) >= EXPERTS * EMB * HIDDEN, "the weights must be gathered"
    if dispatch == "megablox" and backend in ("auto", "pallas_megablox") and platform == "tpu":
        kernels = text.count('custom_call_target="tpu_custom_call"')
        want = 3 if mode != "train" else 9  # gmm x 3 forward; + gmm x 3 and tgmm x 3 back
        assert kernels >= want, f"{kernels} Mosaic kernels: the Pallas kernel was not compiled"


def expert_flops(platform: str, program) -> float:
    """Per-device FLOPs of the expert matmuls: the `expert_compute` dots of XLA:GPU's
    optimized HLO; XLA:TPU rewrites dots as convolutions, so there its own cost
    analysis of the whole program (the expert matmuls are all but about 1% of it)."""
    if platform == "gpu":
        return dot_flops(program.as_text(), "expert_compute")
    return program.cost_analysis()["flops"]


@pytest.mark.parametrize("platform", list(TARGETS))
def test_tensor_axis_splits_the_expert_matmuls_on_target(platform):
    """tensor=2 beside context=4 halves each device's expert-matmul FLOPs, counted on
    the target's compiled program, with no weight gathered over tensor."""
    case = (platform, "train", "dense", "gather", "auto", "bfloat16")
    _, split, _, _ = build(*case, mesh_sizes={"context": 4, "tensor": 2})
    _, whole, _, _ = build(*case, mesh_sizes={"context": 4})
    ratio = expert_flops(platform, split) / expert_flops(platform, whole)
    exact = platform == "gpu"
    assert ratio == 0.5 if exact else 0.5 <= ratio <= 0.51, ratio
    # No weight is gathered over tensor: nothing holds every expert's whole hidden dim.
    whole_hidden = [
        (op, shapes)
        for op, shapes in collectives(split.as_text())
        if op == "all-gather" and any(math.prod(s) >= EXPERTS * EMB * HIDDEN for s in shapes)
    ]
    assert whole_hidden == [], whole_hidden
    assert token_traffic(split.as_text(), ("all-reduce",)) == []


@pytest.mark.parametrize("platform", list(TARGETS))
def test_decode_on_the_decode_axis_compiles_for_target(platform):
    """Decode with context_autoregressive=2 (MaxText's decode axis) beside fsdp=4: the
    selector warns that the MoE token is repeated there, and the target's compiler
    takes the block: the tokens enter split over fsdp only, none crosses devices, and
    the weights resting over both axes are gathered whole."""
    case = (platform, "decode", "megablox", "gather", BACKENDS[platform][0], "bfloat16")
    block, program, _, _ = build(*case, mesh_sizes={"fsdp": 4, "context_autoregressive": 2})
    assert "DECODE_TOKEN_REPEATED" in {f.code for f in block.plan.warnings}
    assert block.layout.sequence == () and "context_autoregressive" in block.layout.embed
    _, x_sharding = program.input_shardings[0]
    assert "context_autoregressive" not in str(x_sharding.spec), x_sharding.spec
    text = program.as_text()
    assert token_traffic(text) == [], "tokens crossed devices"
    gathered = [
        math.prod(max(shapes, key=math.prod))
        for op, shapes in collectives(text)
        if op == "all-gather" and shapes
    ]
    assert max(gathered) >= EXPERTS * EMB * HIDDEN, "the weights must be gathered whole"


def test_target_descriptions():
    assert targets.Target("v5p", 64).describe() == "v5p, 64 chips (4x4x4)"
    assert targets.torus("v6e", 8) == (2, 4)
    assert targets.Target.from_hardware("h200", 16).describe() == "h200, 2 hosts x 8 GPUs"
    assert targets.describe("v5p", 8, 0) == ""  # no slices: no target, and no crash
    assert targets.describe("tpu-v9", 8) == ""
    with pytest.raises(ValueError, match="unknown chip"):
        targets.Target("v9", 8)
    assert "h100" in targets.gpu_chips() and "h200" in targets.gpu_chips()


def test_the_exchange_round_count_compiles_for_64_gpus_over_two_axes():
    """The exchange agrees on its round count with a pmax of ROUND_COUNT_LANES int32
    over the token axes. On jax 0.12.0.1 XLA:GPU aborts the process compiling a smaller
    one over two mesh axes of 64 GPUs (tests/probes/gpu_small_allreduce.py); compiled here in a
    process of its own, for 64 abstract H200s as fsdp=16 x context=4."""
    import subprocess

    from subproc import ROOT, probe_command

    from layers.expert_parallel import ROUND_COUNT_LANES

    pytest.importorskip("jax_plugins.xla_cuda12", reason="the gpu extra (JAX's CUDA plugin)")
    cmd = probe_command("gpu_small_allreduce", "--case", "64", "4")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    got = subprocess.run(
        [*cmd, "fsdp,context", str(ROUND_COUNT_LANES)], capture_output=True, text=True, env=env
    )
    assert got.returncode == 0 and "compiled" in got.stdout, got.stderr[-2000:]
