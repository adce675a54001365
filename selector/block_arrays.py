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
from .traits import Traits

ROUTER_BYTES = 4  # router logits and probabilities are float32 whatever the dtype


@dataclass(frozen=True)
class BlockArray:
    """One array of a block's forward pass.

    Args:
      written: elements the pass writes into it, over every round.
      held: elements of it live at the block's peak (0: gone by then).
      itemsize: bytes an element.
      grouped: the grouped matmul's rows (in, hidden products, their product, out),
        whose traffic the Pallas kernels count from their own tile plan.
    """

    written: float
    held: float
    itemsize: int
    grouped: bool = False


def block_arrays(
    strategy: Dispatch, exchange: Exchange, p: Problem, compiler: Traits
) -> tuple[BlockArray, ...]:
    """The arrays `strategy`'s forward pass makes on one device (the module's table).

    Args:
      strategy: the dispatch.
      exchange: how its expert weights meet the rows (gathered, or exchanged).
      p: the placed problem (`selector.problem.placed`).
      compiler: the compiler's traits: how many of the exchange's (G, B, M) round
        buffers and (T, M) token buffers it holds at once (`exchange_row_buffers`,
        `exchange_token_buffers`).

    Returns:
      The arrays, in the order the pass makes them. Four tokens, one expert each,
      through the gathered grouped matmul:

      >>> from selector.block_arrays import block_arrays, held_bytes, written_bytes
      >>> from selector.config import Dispatch, Exchange
      >>> from selector.problem import Problem
      >>> from selector.traits import traits
      >>> p = Problem(T=4, G=1, S=4, E=2, k=1, C=2, M=8, H=16, Hs=0, E_c=2, group=1,
      ...     gathered=1, rest_shards=1, gate_shards=1, replicas=1, xb=2, pb=4, passes=1,
      ...     tile=8, gmm_dense=False, buffer_factor=1.0, ragged=False, train=False)
      >>> arrays = block_arrays(Dispatch.megablox, Exchange.gather, p, traits("cpu"))
      >>> written_bytes(arrays), held_bytes(arrays)
      (608.0, 352.0)
    """
    T, M, H, xb = p.T, p.M, p.H, p.xb
    arrays = [
        BlockArray(T * 2 * p.Hs, T * 2 * p.Hs, xb),  # the shared experts' hidden products
        BlockArray(T * p.Hs, 0, xb),  # and their product
        BlockArray(T * M, 0, xb),  # the block's output
    ]
    if strategy is Dispatch.mlp:
        return (
            *arrays,
            BlockArray(T * 2 * H, T * 2 * H, xb),  # hidden products
            BlockArray(T * H, 0, xb),  # their product
        )
    arrays.append(BlockArray(T * p.E, T * p.E, ROUTER_BYTES))  # router probabilities
    if strategy is Dispatch.megablox:
        rows = T * p.k
        exchanged = exchange is Exchange.all_to_all
        b = buffer_rows(p)
        arrays += [
            BlockArray(rows * M, 0 if exchanged else rows * M, xb, True),  # rows in
            # hidden products; exchanged, one slot's are live at a time
            BlockArray(rows * 2 * H, (b if exchanged else rows) * 2 * H, xb, True),
            BlockArray(rows * H, 0, xb, True),  # their product
            BlockArray(rows * M, 0, xb, True),  # rows out
        ]
        if exchanged:
            # the round buffers, sent and received; as many held as the compiler holds
            held = compiler.exchange_row_buffers[p.train] * p.group * b * M
            arrays.append(BlockArray(2 * rows * M, held, xb))
            # training: the tokens' input gradient the rounds add into, and its cotangent
            tokens = compiler.exchange_token_buffers * T * M if p.train else 0
            arrays.append(BlockArray(0, tokens, xb))
        return tuple(arrays)
    # dense: every token through every expert it computes with; the capacity path: the
    # (subgroup, expert, slot) buffers. Both hold all but the product of the hidden pair.
    slots = T * p.E_c if strategy is Dispatch.dense else p.G * p.E * p.C
    dispatched = slots * M * (strategy is Dispatch.subgroup_capacity)
    return (
        *arrays,
        BlockArray(dispatched, dispatched, xb),  # the capacity path's dispatched rows
        BlockArray(slots * 2 * H, slots * 2 * H, xb),  # hidden products
        BlockArray(slots * H, 0, xb),  # their product
        BlockArray(slots * M, slots * M, xb),  # expert outputs
    )


def written_bytes(arrays: Iterable[BlockArray]) -> float:
    """Bytes `arrays` write over one forward pass (each is read once more)."""
    return float(sum(a.written * a.itemsize for a in arrays))


def held_bytes(arrays: Iterable[BlockArray]) -> float:
    """Bytes of `arrays` live at the block's peak."""
    return float(sum(a.held * a.itemsize for a in arrays))
