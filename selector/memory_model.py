"""The counted memory model: the buffers a block's program holds at its peak.

Nothing here is fitted per program. Each program's peak is counted from what the layers
allocate (layers/: the dispatch's activations, the weights' compute copies, the weight
gradients before they leave the block), in the dtypes the compiler keeps them in, and
one constant per compiler (`Traits.compiler_factor`) scales the count to the compiler's temp.
The compiler's heap for the exchanged training block that holds its experts whole (more
than one) is a measured law of its own (`Traits.exchange_heap`, measured on small
blocks in no judge set, XLA:TPU and XLA:GPU): a factor on each side of the point where
a round's rows outweigh one local expert matrix. The same block's serving forward on
XLA:TPU has another (`Traits.exchange_serving_heap`): a factor inside and outside a
window of round-buffer sizes where libtpu 0.0.50 holds about two round buffers more.

What the peak holds, per program (bytes; letters as in `selector.problem`):

- weights: the compute copy of the expert weights a device multiplies with (E_c experts'
  hidden slice, the shared experts too), when it differs from the weights at rest:
  gathered over the embed (and, gathered, the expert) axes, or cast to the compute
  dtype (`has_weight_copy`). In their own dtype and not gathered, the matmuls read the
  arguments in place.
- gradients (training): gathered, the full-size weight gradients of the three matrices
  before their reduce-scatter. XLA:TPU's buffer assignment of a Qwen3-30B-A3B layer
  holds two of the three at its peak (W + 2/3 W + rows: 2,145 MiB assigned at cp=2,
  counted 2,146), but libtpu's temp adds, after buffer assignment, bytes no buffer of
  the dump names: 0 to 0.6 W in the gathered backward of the real layers at cp 1 to 4
  (bench.calibration.memory_holdout), none measurable in the exchanged one. All three gradients
  bound what is assigned and cover most of that; exchanged, every
  local expert's float32 accumulator (the exchange's backward adds each slot into
  them) and one matrix's cast to the compute dtype on its way out. Not gathered, the
  gradients are the program's outputs, not temporaries.
- activations: the arrays `selector.block_arrays` lists as live at the peak (its
  table: the rows, hidden products and outputs of each dispatch, the exchange's round
  buffers as many as the compiler holds, `Traits.exchange_row_buffers` and
  `exchange_token_buffers`, the router's probabilities and the shared experts' products);
  and the capacity path's one-hot dispatch masks (T x E x C) as many times as the
  compiler holds them (XLA:TPU fuses them into their einsums; `Traits.capacity_masks_*`).

XLA:CPU multiplies half-precision weights in float32 (bf16 weights are all-gathered and
multiplied as f32, read in its compiled programs), so on `platform=cpu` the weights'
compute copy is counted at 4 bytes an element whatever the compute dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

from .block_arrays import block_arrays, held_bytes
from .config import DTYPE_BYTES, Config, Dispatch, Exchange
from .mesh import MeshView
from .problem import Problem, round_buffer_bytes
from .traits import NEWEST_TESTED_JAX, Traits, traits

ACCUMULATOR_BYTES = 4  # the exchange's weight-gradient accumulators are float32


@dataclass(frozen=True)
class HeldBuffers:
    """Bytes a block's program holds at its peak, by what they are."""

    weights: float  # compute copies of the weights (gathered, or cast)
    gradients: float  # weight gradients before they leave the block
    activations: float  # rows, hidden products, router outputs
    # The capacity path's dispatch masks where the compiler holds them (Traits'
    # capacity_masks_*), read in buffer assignments: not scaled by the compiler factor.
    masks: float = 0.0
    # What the compiler's heap holds over the counted buffers, as a factor
    # (`Traits.exchange_heap` and `exchange_serving_heap`: the exchanged block that holds
    # its experts whole, training and serving).
    heap: float = 1.0

    @property
    def total(self) -> float:
        return self.weights + self.gradients + self.activations + self.masks


def weight_copy_bytes(platform: str, compute_bytes: int) -> int:
    """Bytes an element of the weights' compute copy takes on `platform`'s compiler."""
    return 4 if traits(platform).weight_copy_in_f32 else compute_bytes


def has_weight_copy(p: Problem, platform: str, gathered: int | None = None) -> bool:
    """Whether the matmuls read a copy of the weights rather than the arguments: gathered
    (from `gathered` devices; the routed experts' `p.gathered` unless given), or
    converted where the compiler keeps the conversion apart (XLA:CPU's float32 copy;
    XLA:TPU fuses a cast of weights it does not gather into the dots, measured on the
    small decode programs: 0.4 MiB of temp where the copy would be 6.9)."""
    if (p.gathered if gathered is None else gathered) > 1:
        return True
    if weight_copy_bytes(platform, p.xb) != p.xb:
        return True
    return p.pb != p.xb and not traits(platform).fuses_weight_cast


def routed_weight_elements(strategy: Dispatch, p: Problem) -> float:
    """Elements of the routed experts' weights a device multiplies with."""
    experts = 1 if strategy is Dispatch.mlp else p.E_c
    return experts * 3 * p.M * p.H


def within_one_slice(mesh: MeshView | None) -> bool:
    """Whether `mesh` lies on one slice (no axis split over DCN); no mesh (a problem made
    by hand): yes."""
    return mesh is None or mesh.dcn_product([a for a, _ in mesh.sizes]) == 1


def gathers_by_all_reduce(compiler: Traits, mesh: MeshView | None, devices: int) -> bool:
    """Whether `compiler` gathers a tensor split over `devices` of `mesh` by an
    all-reduce (`Traits.all_reduce_gather_devices`): on one slice, over every device of
    it, and at least that many. No mesh (a problem made by hand): no."""
    least = compiler.all_reduce_gather_devices
    if not least or mesh is None:
        return False
    return within_one_slice(mesh) and devices == mesh.num_devices >= least


def held_buffers(
    strategy: Dispatch,
    exchange: Exchange,
    p: Problem,
    platform: str,
    release: tuple[int, int] = NEWEST_TESTED_JAX,
) -> HeldBuffers:
    """What the block's program holds at its peak on `platform`'s compiler of jax
    `release` (see the module's docstring)."""
    compiler = traits(platform, release)
    routed = routed_weight_elements(strategy, p)
    # The shared experts rest split by their embedding dim over their own axes
    # (`gate_shards`), which differ from the routed experts' where the expert axes
    # gather only the routed ones, or fsdp joins the expert group and gathers only them.
    shared = 3 * p.M * p.Hs
    shared_gathered = p.gate_shards > 1
    compute = weight_copy_bytes(platform, p.xb)
    copy = compute if has_weight_copy(p, platform) else 0
    shared_copy = compute if has_weight_copy(p, platform, p.gate_shards) else 0
    weights = routed * copy + shared * shared_copy
    exchanged = strategy is Dispatch.megablox and exchange is Exchange.all_to_all
    gradients = 0.0
    if p.train and exchanged:
        gradients = routed * ACCUMULATOR_BYTES + routed * p.xb / 3
        gradients += shared * p.xb * 2 / 3 if shared_gathered else 0.0
    elif p.train and (p.gathered > 1 or shared_gathered):
        gradients = routed * p.xb * (p.gathered > 1) + shared * p.xb * shared_gathered
        # How many of the gathered gradients are held before their reduce-scatter is the
        # compiler's: jax 0.12's XLA:GPU one of three (its buffer assignment, Qwen3-30B-A3B
        # at cp=2 on 8 H200: four 384 MiB weight-sized buffers, the three gathered and one
        # gradient). XLA:TPU holds none where it all-gathers within one slice, the three
        # where it gathers by an all-reduce (bench.calibration.gathered_gradients); across
        # slices it was not measured, and the three are kept.
        share = compiler.gathered_gradients_held
        all_gather = not gathers_by_all_reduce(compiler, p.mesh, p.gathered)
        if (
            compiler.all_gather_gradients_held is not None
            and all_gather
            and within_one_slice(p.mesh)
        ):
            share = compiler.all_gather_gradients_held
        gradients *= share
    activations = held_bytes(block_arrays(strategy, exchange, p, compiler))
    gathered_forward = not p.train and strategy is Dispatch.megablox and not exchanged
    if compiler.gathered_forward_second_layout and gathered_forward:
        # jax 0.10's XLA:GPU forward of the gathered grouped matmul (tiled_gmm) holds a
        # second layout of one gathered matrix and the expert outputs beside the sorted
        # rows (its buffer assignment, Qwen3-30B-A3B at cp=2 on 8 H200: four 384 MiB
        # weight buffers where three are gathered, two 128 MiB row buffers); jax 0.12's
        # holds neither. Training's peak is in the backward, after the forward.
        weights += routed * copy / 3
        activations += p.T * p.k * p.M * p.xb
    masks = 0.0
    if strategy is Dispatch.subgroup_capacity:
        held = 0 if p.train else 1  # (training, forward)
        per_element = 4 * compiler.capacity_masks_f32[held]
        per_element += p.xb * compiler.capacity_masks_compute[held]
        masks = p.T * p.E * p.C * per_element
    heap = 1.0
    if exchanged and p.gathered == 1:  # the experts held whole: the compilers' heap laws
        round_bytes = round_buffer_bytes(p)
        if p.train and p.E_c > 1:
            # `routed` holds the three local matrices: the jump is at one of them. With one
            # local expert XLA:GPU holds what is counted (its study); no TPU point had one.
            below, above = compiler.exchange_heap
            heap = above if 3 * round_bytes > routed * p.pb else below
        elif not p.train:
            outside, inside = compiler.exchange_serving_heap
            low, high, tokens_below = compiler.exchange_serving_window
            window = low <= round_bytes < high and p.T * p.M * p.xb < tokens_below
            # a bare shared expert closes the window; behind its gate it does not
            heap = inside if window and (p.shared_gate or not p.Hs) else outside
    return HeldBuffers(weights, gradients, activations, masks, heap)


def temp_bytes(held: HeldBuffers, platform: str) -> float:
    """The compiler's temp for a program holding `held` on `platform`: the count times
    the compiler's one constant and its heap's factor for the program (`held.heap`)."""
    counted = held.total - held.masks
    return counted * traits(platform).compiler_factor * held.heap + held.masks


def program_key(strategy: Dispatch, exchange: Exchange, cfg: Config) -> str:
    """`{family} {mode} {program}` (for example `tpu train megablox_exchanged`): which
    program a candidate compiles to, as the studies group compiled points. XLA:CPU at
    half precision is a family of its own (it converts part of such a program to
    float32)."""
    if strategy is Dispatch.mlp:
        base = "dense"
    elif strategy is Dispatch.megablox and exchange is Exchange.all_to_all:
        base = "megablox_exchanged"
    else:
        base = strategy.value
    family = cfg.hardware.platform
    if family == "cpu" and DTYPE_BYTES.get(cfg.dtype, 4) < 4:
        family = "cpu_half"
    return f"{family} {cfg.mode.value} {base}"
