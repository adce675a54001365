"""The activations of each dispatch, one table: every array a block's forward pass
makes, with the elements it writes over the pass and the elements live at the block's
peak. The cost model's traffic (each array written once and read once more) and the
memory model's held activations are both sums over this one table, so an array is
written down once.

Letters as in `selector.problem`; B is an exchange slot's rows (`buffer_rows`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from .config import Dispatch, Exchange
from .problem import Problem, buffer_rows

ROUTER_BYTES = 4  # router logits and probabilities are float32 whatever the dtype


@dataclass(frozen=True)
class BlockArray:
    """One array of a block's forward pass.

    Args:
      name: what it is.
      written: elements the pass writes into it, over every round.
      held: elements of it live at the block's peak (0: gone by then).
      itemsize: bytes an element.
      grouped: the grouped matmul's rows (in, hidden products, their product, out),
        whose traffic the Pallas kernels count from their own tile plan.
    """

    name: str
    written: float
    held: float
    itemsize: int
    grouped: bool = False


def block_arrays(
    strategy: Dispatch,
    exchange: Exchange,
    p: Problem,
    round_buffers: int = 2,
    token_buffers: int = 0,
) -> tuple[BlockArray, ...]:
    """The arrays `strategy`'s forward pass makes on one device (the module's table).

    Args:
      strategy, exchange: the dispatch, and how its expert weights meet the rows.
      p: the placed problem (`selector.problem.placed`).
      round_buffers: the exchange's (G, B, M) round buffers the compiler holds at once.
      token_buffers: the (T, M) buffers it holds beside them (training's input gradient
        and the cotangent the rounds read).

    Returns:
      The arrays, in the order the pass makes them. Four tokens, one expert each,
      through the gathered grouped matmul:

      >>> from selector.block_arrays import block_arrays, held_bytes, written_bytes
      >>> from selector.config import Dispatch, Exchange
      >>> from selector.problem import Problem
      >>> p = Problem(T=4, G=1, S=4, E=2, k=1, C=2, M=8, H=16, Hs=0, E_c=2, group=1,
      ...     gathered=1, rest_shards=1, gate_shards=1, replicas=1, xb=2, pb=4, passes=1,
      ...     tile=8, gmm_dense=False, buffer_factor=1.0, ragged=False, train=False)
      >>> arrays = block_arrays(Dispatch.megablox, Exchange.gather, p)
      >>> written_bytes(arrays), held_bytes(arrays)
      (608.0, 352.0)
    """
    T, M, H, xb = p.T, p.M, p.H, p.xb
    arrays = [
        BlockArray("the shared experts' hidden products", T * 2 * p.Hs, T * 2 * p.Hs, xb),
        BlockArray("the shared experts' product", T * p.Hs, 0, xb),
        BlockArray("the block's output", T * M, 0, xb),
    ]
    if strategy is Dispatch.mlp:
        return (
            *arrays,
            BlockArray("hidden products", T * 2 * H, T * 2 * H, xb),
            BlockArray("their product", T * H, 0, xb),
        )
    arrays.append(BlockArray("router probabilities", T * p.E, T * p.E, ROUTER_BYTES))
    if strategy is Dispatch.megablox:
        rows = T * p.k
        exchanged = exchange is Exchange.all_to_all
        b = buffer_rows(p)
        arrays += [
            BlockArray("rows in", rows * M, 0 if exchanged else rows * M, xb, True),
            # exchanged, one slot's hidden products are live at a time
            BlockArray(
                "hidden products", rows * 2 * H, (b if exchanged else rows) * 2 * H, xb, True
            ),
            BlockArray("their product", rows * H, 0, xb, True),
            BlockArray("rows out", rows * M, 0, xb, True),
        ]
        if exchanged:
            held = round_buffers * p.group * b * M
            arrays.append(BlockArray("round buffers", 2 * rows * M, held, xb))
            arrays.append(BlockArray("token gradients", 0, token_buffers * T * M, xb))
        return tuple(arrays)
    # dense: every token through every expert it computes with; the capacity path: the
    # (subgroup, expert, slot) buffers. Both hold all but the product of the hidden pair.
    slots = T * p.E_c if strategy is Dispatch.dense else p.G * p.E * p.C
    dispatched = strategy is Dispatch.subgroup_capacity
    return (
        *arrays,
        BlockArray("dispatched rows", slots * M * dispatched, slots * M * dispatched, xb),
        BlockArray("hidden products", slots * 2 * H, slots * 2 * H, xb),
        BlockArray("their product", slots * H, 0, xb),
        BlockArray("expert outputs", slots * M, slots * M, xb),
    )


def written_bytes(arrays: Iterable[BlockArray]) -> float:
    """Bytes `arrays` write over one forward pass (each is read once more)."""
    return float(sum(a.written * a.itemsize for a in arrays))


def held_bytes(arrays: Iterable[BlockArray]) -> float:
    """Bytes of `arrays` live at the block's peak."""
    return float(sum(a.held * a.itemsize for a in arrays))
