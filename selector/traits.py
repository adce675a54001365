"""What each compiler does differently, as data: one row per compiler, and per jax
release where its behaviour changed. The counts read a row (`traits`) instead of
branching on the platform or the release, so a new compiler or release is a new row.

Every trait was read from compiled programs (buffer assignments, HLO, memory analysis)
or measured; the comment beside each field says where.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass, replace
from importlib import metadata

from .targets import GPU_PER_HOST

# The jax release assumed when none is installed (the selector alone): the newest stack
# this project is tested on.
NEWEST_TESTED_JAX = (0, 12)


@dataclass(frozen=True)
class Traits:
    """One compiler's behaviour, as the counts and rules read it.

    Attributes:
      weight_copy_in_f32: the matmuls read bfloat16 weights through a float32 copy
        (XLA:CPU: its dots multiply in float32).
      fuses_weight_cast: a cast of weights that are not gathered fuses into the dots, so
        no converted copy is held (XLA:TPU, the small decode programs: 0.4 MiB of temp
        where the copy would be 6.9).
      gathered_gradients_held: the share of the three gathered weight gradients held at
        once before their reduce-scatter (jax 0.12's XLA:GPU reduce-scatters each
        matrix's before forming the next: one of three; XLA:TPU, where it gathers by an
        all-reduce (`all_reduce_gather_devices`), the three).
      all_gather_gradients_held: the same where the weights are all-gathered within one
        slice, where it differs (None: as `gathered_gradients_held`). XLA:TPU holds
        none: a gathered training block's temp is 1.1 to 1.4 times its gathered weights
        there, 2.2 to 2.3 times where the gather is an all-reduce (8 to 128 v5p chips,
        both libtpu releases; `bench.calibration.gathered_gradients`).
      gathered_forward_second_layout: a serving forward of the gathered grouped matmul
        holds a second layout of one gathered matrix and the expert outputs beside the
        sorted rows (jax 0.10's XLA:GPU; jax 0.12's holds neither).
      hoists_f32_expert_stacks: a training step converts the stacked expert weights to
        float32 once, out of the layer loop (XLA:GPU's step dumps; XLA:TPU gathers them
        in place).
      exchange_collective: the collective that moves routed rows to their experts'
        owners (XLA:CPU has no ragged_all_to_all: a padded all_to_all).
      native_gmm: the grouped matmul `gmm_backend=auto` runs.
      ragged_dot_dense: XLA's `ragged_dot` lowers to masked dense work over every group.
      runs_pallas_megablox: the Pallas megablox kernels run (natively on TPU; in
        interpret mode on CPU; not at all on GPU).
      capacity_masks_f32, capacity_masks_compute: how many copies of the capacity
        path's (tokens, E, C) dispatch mask the program holds at its peak, in float32
        and in the compute dtype, (training, forward), beside the counted activations
        (read in the buffer assignments of the capacity block compiled on 2 to 4
        devices, E 8 to 64, k 1 to 8, C 320 to 1,280, training and prefill, on jax
        0.10.2 and 0.12.0.1). XLA:TPU fuses the one-hot masks into their einsums and
        holds none; XLA:GPU holds two compute-dtype copies training and one forward
        (one more on a single device, not counted); XLA:CPU three float32 and one
        compute-dtype copy training and two float32 forward (k <= 2; at k = 4 it held
        five and two).
      gather_relayouts: which routed weight matrices the compiler copies into another
        layout around their all-gather over the embed axes (and their gradients'
        reduce-scatter), a full gathered matrix each way: "gate_up", the two (E, M, H)
        matrices whose embed dim is in the middle, and "out", the (E, H, M) matrix whose
        embed dim is minor. Read in the compiled gathered block (8 devices, fsdp 2 x
        context 4, 32 MiB matrices): XLA:CPU and jax 0.10's XLA:GPU gather in a layout
        with the gathered dim major and copy (CPU) or transpose (GPU) every matrix back;
        jax 0.12's XLA:GPU runs the grouped matmul's loops on the gathered layout, with
        no copy; XLA:TPU (libtpu 0.0.42 and 0.0.50) gathers the gate and up matrices in
        place and copies only the out matrix.
      dense_activation_copies: the dense path's activations the compiled block writes
        in another layout, (forward, training), each (hidden keeping its minor dim,
        hidden changing it, per-expert output keeping it, changing it): a hidden
        activation is (tokens, E, H), a per-expert output (tokens, E, M). Read in the
        compiled dense block (8 devices, context 8, E 24, k 6, 1,024 tokens a device;
        jax 0.10.2 and 0.12.0.1; `tests/selector/test_timing.py` compiles it again):
        XLA:CPU computes each expert's batch in an expert-major layout and copies the
        results to and from the token-major one, fused into the elementwise passes
        around the einsums; XLA:TPU and XLA:GPU choose layouts that need no copy.
      exchange_row_buffers: how many (G, B, M) round buffers of the exchange the
        program holds at its peak, (forward, training). Read in the buffer assignments
        and live ranges of exchanged blocks compiled ahead of time (Qwen3-30B-A3B,
        Qwen3-Next-80B-A3B and DeepSeek-V3 layers, 16 to 128 v5p and 4 to 8 H200,
        expert groups of 8 to 128 devices, 2,048 to 16,384 tokens a device; jax 0.10.2
        and 0.12.0.1; none in a judge set). The forward holds a round's packed send
        buffer and what it receives; the backward also the rows received for the
        recomputation beside their received cotangents. XLA:GPU holds one more each
        way: its asynchronous ragged_all_to_all keeps the zeroed output operand apart
        from the result, where XLA:TPU writes the result into it. XLA:CPU runs a padded
        all_to_all; its rows were not read this way (2, 2).
      exchange_token_buffers: the (T, M) token buffers the exchange's backward holds
        beside its round buffers at the peak: the input gradient the rounds add into and
        the cotangent they read (2 on XLA:TPU and XLA:GPU, read with the round buffers).
        XLA:CPU's were not read (0: its count is the one constant below times the
        buffers counted before, and adding these took the CPU memory study's exchanged
        points further over).
      exchange_heap: XLA's temp over the counted buffers for the exchanged training
        block that holds its experts whole (fsdp folded into the expert group: nothing
        gathered) and more than one of them, as a factor, (at or below, above) the
        point where a round's rows (G x B x M) outweigh one local expert matrix (E_c x
        M x H). libtpu reports temp that no buffer of its dump names, or less than its
        buffer assignment holds live, and it jumps at that point; XLA:GPU holds less
        than is counted, by a factor that jumps at the same point. Measured on small
        blocks in no judge set (`bench.calibration.exchange_heap`: 25 shapes on 8 to 64
        v5p, E_c 4 to 32, M 1,024 to 4,096, H 384 to 3,072, k 2 to 8, 1,024 to 8,192
        tokens a device, cp 1 and 2; `--chip h200`: 22 shapes on 4 and 8 H200, E_c 2 to
        64, the same ranges, cp 1 to 4), the median of temp over the count on each
        side; the spread is in docs/results/memory-holdout.md. With one local expert
        XLA:GPU holds what is counted (7 shapes, H 768 to 12,288: -24% to +8%), so the
        factor is not applied there; no TPU shape had one. Not read for the gathered or
        context-only groups (their weights' copies dominate and the count holds alone),
        or off XLA:TPU and XLA:GPU.
      exchange_serving_heap: XLA:TPU's temp over the counted buffers for the exchanged
        serving forward that holds its experts whole, as a factor, (outside, inside) the
        window below. Measured on small blocks in no judge set
        (`bench.calibration.exchange_heap`: 34 forwards on 8 to 64 v5p, E_c 2 to 32, M
        1,024 to 4,096, H 384 to 3,072, k 2 to 16, 1,024 to 8,192 tokens a device, a
        shared expert bare and gated), the median of temp over the count on each side.
        libtpu 0.0.42 holds what is counted (every point within 15%: 1, 1); libtpu
        0.0.50 holds about two round buffers more inside the window.
      exchange_serving_window: where that forward's temp jumps, as bytes (a round
        buffer from, a round buffer below, the (T, M) tokens below): the study's edges,
        the round buffer between 31.5 and 36 MiB and between 63 and 72 MiB, the tokens
        between 14 and 16 MiB. A shared expert without a gate closes the window (one
        point: in the window's range, it compiled to the outside factor). (0, 0, 0): no
        window.
      all_reduce_gather_devices: the fewest devices of one slice from which a tensor
        gathered whole over every device of the slice is gathered by an all-reduce,
        which leaves one more buffer the size of the program's largest such tensor that
        no buffer of the dump names (0: never). Measured on small programs in no judge
        set (`bench.calibration.libtpu_temp`, v5p, libtpu 0.0.42.1 and 0.0.50.1): a
        bfloat16 tensor of 224 MiB to 7 GiB gathered over every chip of 64, 128 or 256
        (one mesh axis or two that cover them) is all-reduced and leaves that buffer;
        over 8 to 32 chips, or over fewer than every chip of a slice, it is
        all-gathered and leaves none. One slice only; other TPU generations not
        measured.
      logits_gradient_held_from_cp: the smallest context parallelism at which the
        loss's logits gradient (in the compute dtype, one vocabulary tile of it) stays
        live through the layers' backward, beside each layer's working set, on a slice
        where the weights are all-gathered (0: never). Read at the heap's peak in
        MaxText 0.2.5's train steps compiled for v5p (libtpu 0.0.50;
        `bench.calibration.logits_lifetime`: four decoder layers, in no judge set): at
        cp 1 the gradient is gone before the layers' backward; from cp 2 on 8 and 16
        chips it is live there; on a whole slice of 64 chips, where the weights are
        gathered by an all-reduce (`all_reduce_gather_devices`), it is not. Across
        slices not measured (not held); libtpu 0.0.42 not read (MaxText 0.2.5 needs
        jax 0.12): its row keeps the same.
      host_devices: the devices of one host that share its fast links (NVLink: 8 GPUs of
        an H100 or H200 host), where a slice is a host; 0 where a slice's own links
        join every device of it (a TPU slice's ICI torus; the simulated CPU devices).
      compiler_factor: the one constant that scales the counted buffers to the
        compiler's temp. XLA:TPU and XLA:GPU: 1, the count alone (against the real
        presets' layers compiled for 64 v5p and 8 H200 on both stacks,
        bench.calibration.memory_holdout). XLA:CPU, where nobody deploys but the suite and the small
        examples run: 1.45, the median of its compiled temp over the count on the 438
        small points bench.calibration.calibrate compiled (it schedules for speed, not memory, and
        holds more of the forward into the backward than the other two).
    """

    weight_copy_in_f32: bool = False
    fuses_weight_cast: bool = False
    gathered_gradients_held: float = 1.0
    all_gather_gradients_held: float | None = None
    gathered_forward_second_layout: bool = False
    hoists_f32_expert_stacks: bool = False
    exchange_collective: str = "ragged_all_to_all"
    native_gmm: str = "tiled_gmm"
    ragged_dot_dense: bool = True
    runs_pallas_megablox: bool = True
    capacity_masks_f32: tuple[float, float] = (0.0, 0.0)
    capacity_masks_compute: tuple[float, float] = (0.0, 0.0)
    gather_relayouts: tuple[str, ...] = ("gate_up", "out")
    dense_activation_copies: tuple[tuple[int, ...], tuple[int, ...]] = ((0, 0, 0, 0), (0, 0, 0, 0))
    exchange_row_buffers: tuple[int, int] = (2, 2)
    exchange_token_buffers: int = 2
    exchange_heap: tuple[float, float] = (1.0, 1.0)
    exchange_serving_heap: tuple[float, float] = (1.0, 1.0)
    exchange_serving_window: tuple[float, float, float] = (0.0, 0.0, 0.0)
    all_reduce_gather_devices: int = 0
    logits_gradient_held_from_cp: int = 0
    host_devices: int = 0
    compiler_factor: float = 1.0

    @property
    def ragged_exchange(self) -> bool:
        """Whether the exchange sends only the routed rows (ragged), not padded slots."""
        return self.exchange_collective == "ragged_all_to_all"


# XLA:GPU as jax 0.10's CUDA plugin compiles; jax 0.12's changes some traits (below).
_XLA_GPU = Traits(
    capacity_masks_compute=(2.0, 1.0),
    gathered_forward_second_layout=True,
    hoists_f32_expert_stacks=True,
    runs_pallas_megablox=False,
    exchange_row_buffers=(3, 4),
    exchange_heap=(0.75, 0.88),
    host_devices=GPU_PER_HOST,
)

# XLA:TPU as libtpu 0.0.42 (jax 0.10) compiles; libtpu 0.0.50 (jax 0.12) changes its heap.
_XLA_TPU = Traits(
    fuses_weight_cast=True,
    all_gather_gradients_held=0.0,
    native_gmm="pallas_megablox",
    ragged_dot_dense=False,
    gather_relayouts=("out",),
    exchange_row_buffers=(2, 3),
    exchange_heap=(0.85, 1.40),
    all_reduce_gather_devices=64,
    logits_gradient_held_from_cp=2,
)

# (platform, first jax release the row holds for): the row. A platform's rows are read
# newest first; the first whose release is not newer than the one asked for holds.
TRAITS: dict[tuple[str, tuple[int, int]], Traits] = {
    ("cpu", (0, 0)): Traits(
        weight_copy_in_f32=True,
        exchange_collective="all_to_all",
        exchange_token_buffers=0,
        dense_activation_copies=((0, 1, 0, 1), (5, 3, 0, 2)),
        capacity_masks_f32=(3.0, 2.0),
        capacity_masks_compute=(1.0, 0.0),
        compiler_factor=1.45,
    ),
    ("tpu", (0, 0)): _XLA_TPU,
    ("tpu", (0, 12)): replace(  # libtpu 0.0.50
        _XLA_TPU,
        exchange_heap=(1.41, 1.63),
        exchange_serving_heap=(1.30, 2.16),
        exchange_serving_window=(32 * 2**20, 64 * 2**20, 16 * 2**20),
    ),
    ("gpu", (0, 0)): _XLA_GPU,
    ("gpu", (0, 12)): replace(
        _XLA_GPU,
        gathered_gradients_held=1 / 3,
        gathered_forward_second_layout=False,
        gather_relayouts=(),
        exchange_heap=(0.85, 0.88),
    ),
}
PLATFORMS = tuple(sorted({platform for platform, _ in TRAITS}))


@functools.lru_cache(maxsize=8)
def jax_release(version: str = "auto") -> tuple[int, int]:
    """(major, minor) of `version`, or of the jax installed here for `auto` (read from
    its package metadata: the selector stays jax-free).

    Args:
      version: a jax version ("0.10.2", "0.12.0.1") or "auto" (`Hardware.jax_version`).

    Returns:
      (major, minor); the newest tested release where `auto` finds no jax installed.

    Raises:
      ValueError: `version` is not a jax version.

    Examples:
      >>> from selector.traits import jax_release
      >>> jax_release("0.12.0.1")
      (0, 12)
    """
    if version == "auto":
        try:
            version = metadata.version("jax")
        except metadata.PackageNotFoundError:
            return NEWEST_TESTED_JAX
    found = re.match(r"(\d+)\.(\d+)", version.strip())
    if not found:
        raise ValueError(
            f"hardware.jax_version={version!r} is not a jax version: give one such as "
            "0.10.2 or 0.12.0.1, or auto (the jax installed here)"
        )
    return int(found.group(1)), int(found.group(2))


@functools.lru_cache(maxsize=16)  # read once per estimate, on the hot path
def traits(platform: str, release: tuple[int, int] = NEWEST_TESTED_JAX) -> Traits:
    """The row of `platform`'s compiler for jax `release`.

    Args:
      platform: "cpu", "gpu" or "tpu" (`Hardware.platform`).
      release: (major, minor) of jax, as `jax_release` reads it.

    Returns:
      The newest row of that platform whose release is not newer than `release`.

    Examples:
      >>> from selector.traits import traits
      >>> traits("gpu", (0, 10)).gathered_gradients_held, traits("gpu", (0, 12)).gathered_gradients_held
      (1.0, 0.3333333333333333)
      >>> traits("cpu").exchange_collective
      'all_to_all'
    """
    rows = sorted((since, row) for (name, since), row in TRAITS.items() if name == platform)
    if not rows:
        raise ValueError(f"no compiler traits for platform {platform!r}: one of {PLATFORMS}")
    held = [row for since, row in rows if since <= release]
    return held[-1] if held else rows[0][1]
