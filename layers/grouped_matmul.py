"""Grouped matmul: rows sorted by expert times that expert's weights.

gmm(x_RK, w_EKN, group_sizes_E) -> y_RN: rows [start_e, start_e + size_e) use w[e].
Rows past sum(group_sizes) come out zero.

Backends (the plan's `gmm_backend`): `pallas_megablox` on TPU (the Pallas kernel),
`ragged_dot` (XLA's native op; on CPU it becomes a masked copy of the input per expert
and a dense product over all experts: E times the FLOPs and memory), `tokamax`
(tokamax's ragged_dot: its Mosaic GPU or Triton kernel on GPU, XLA's op elsewhere; an
optional package, Python >= 3.12), and `tiled_gmm`,
ours, for CPU and anywhere without a native kernel:

- each expert's rows are read in place with dynamic slices, in full tiles of 512 rows,
  then the remainder in at most one tile each of 256, 128 and 64 rows (no mask), then
  one masked tail tile of 64; no padded copy of the rows is ever made;
- the loops run only over real tiles (a data-dependent trip count), which reverse-mode
  autodiff cannot do, hence the custom VJP: the input gradient is the same kernel
  against transposed weights (a dot_general, no transposed copy) and the weight
  gradient (tgmm) accumulates x^T dy per expert locally, then writes it once.
Work is the routed rows plus under one 64-row tile per expert. Its pieces are public,
as JAX's megablox exposes gmm and tgmm: `tiled_forward` (no VJP: for callers that
write their own, like the exchange), `tiled_input_grad` and `tiled_weight_grad` (with
`existing_out` to accumulate into a float32 buffer), and `tile_plan`, the schedule the
benchmarks count work with.

Legend: R rows, K contraction, N output, E experts, T tile rows.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from .pallas_gmm import pallas_gmm
from .vma import reduce_like, varying_like

TILE_ROWS = (512, 256, 128, 64)  # full-tile sizes, largest first


def tile_classes(rows: int) -> tuple[int, ...]:
    """Tile sizes usable for an array of `rows` rows (a tile never exceeds the array)."""
    fits = tuple(t for t in TILE_ROWS if t <= rows)
    return fits or (1 << (max(rows, 1).bit_length() - 1),)


def _dot(a, b, transpose_b: bool):
    dims = (((1,), (1,)), ((), ())) if transpose_b else (((1,), (0,)), ((), ()))
    return lax.dot_general(a, b, dims, preferred_element_type=jnp.float32).astype(a.dtype)


def tile_plan(group_sizes_E, classes):
    """Cut each expert's rows into full tiles, largest class first, then one masked tail.

    Returns ([(tile, count_E, first_row_E)] per class, (tile, count_E, first_row_E) of
    the tail, ends_E). After the largest class, each smaller one is used at most once
    (the binary digits of the remainder), so an expert costs (size // 512) + 4 tiles
    at most, and only the tail (under 64 rows) is masked.
    """
    ends_E = jnp.cumsum(group_sizes_E)
    used_E = jnp.zeros_like(group_sizes_E)
    full = []
    for tile in classes:
        count_E = (group_sizes_E - used_E) // tile
        full.append((tile, count_E, ends_E - group_sizes_E + used_E))
        used_E = used_E + count_E * tile
    tail_E = (group_sizes_E > used_E).astype(group_sizes_E.dtype)
    return full, (classes[-1], tail_E, ends_E - group_sizes_E + used_E), ends_E


def _flat_schedule(counts_E, max_tiles: int):
    """(expert, index within expert, total) for a flat loop over every expert's tiles."""
    ends = jnp.cumsum(counts_E)
    tile = jnp.arange(max_tiles)
    expert = jnp.minimum(jnp.searchsorted(ends, tile, side="right"), counts_E.shape[0] - 1)
    within = tile - (ends - counts_E)[expert]
    return expert.astype(jnp.int32), within.astype(jnp.int32), ends[-1]


def _tail_window(first, end, rows: int, tile: int):
    """(start, keep_T1): a `tile`-row window inside the array holding rows [first, end),
    and the mask of those rows (the start is clamped as dynamic_slice would clamp it)."""
    start = jnp.minimum(first, rows - tile)
    row = start + jnp.arange(tile)
    return start, ((row >= first) & (row < end))[:, None]


def _row_tiles(xs_RK, group_sizes_E, num_experts: int, tile_fn, outs_RN):
    """Run `tile_fn(e, x tiles) -> out tiles` over every expert's row tiles, writing the
    results in place into `outs_RN` (full tiles unmasked, the tail tile masked)."""
    rows = xs_RK[0].shape[0]
    full, (tail, tail_E, tail_first_E), ends_E = tile_plan(group_sizes_E, tile_classes(rows))

    for tile, count_E, first_E in full:
        expert, within, total = _flat_schedule(count_E, rows // tile + 1)

        def full_tile(i, outs, tile=tile, first_E=first_E, expert=expert, within=within):
            e = expert[i]
            start = first_E[e] + within[i] * tile
            ys = tile_fn(e, [lax.dynamic_slice_in_dim(x, start, tile) for x in xs_RK])
            return tuple(
                lax.dynamic_update_slice_in_dim(o, y, start, 0)
                for o, y in zip(outs, ys, strict=True)
            )

        outs_RN = lax.fori_loop(0, total, full_tile, outs_RN)

    expert, _, total = _flat_schedule(tail_E, num_experts)

    def tail_tile(i, outs):
        e = expert[i]
        start, keep = _tail_window(tail_first_E[e], ends_E[e], rows, tail)
        ys = tile_fn(e, [lax.dynamic_slice_in_dim(x, start, tail) for x in xs_RK])
        return tuple(
            lax.dynamic_update_slice_in_dim(
                o, jnp.where(keep, y, lax.dynamic_slice_in_dim(o, start, tail)), start, 0
            )
            for o, y in zip(outs, ys, strict=True)
        )

    return lax.fori_loop(0, total, tail_tile, outs_RN)


def tiled_forward(x_RK, ws_EKN, group_sizes_E):
    """(x @ w[e] for each w in ws), all from one pass over x's row tiles."""
    rows = x_RK.shape[0]
    outs = tuple(
        varying_like(jnp.zeros((rows, w.shape[2]), x_RK.dtype), x_RK, w, group_sizes_E)
        for w in ws_EKN
    )
    if rows == 0:
        return outs

    def tile_fn(e, x_tiles):
        return [_dot(x_tiles[0], w[e], False) for w in ws_EKN]

    return _row_tiles([x_RK], group_sizes_E, ws_EKN[0].shape[0], tile_fn, outs)


def tiled_input_grad(dys_RN, ws_EKN, group_sizes_E):
    """sum_i dy_i @ w_i[e]^T: the input gradient of `tiled_forward`, one output buffer."""
    rows = dys_RN[0].shape[0]
    dx = varying_like(
        jnp.zeros((rows, ws_EKN[0].shape[1]), dys_RN[0].dtype), *dys_RN, *ws_EKN, group_sizes_E
    )
    if rows == 0:
        return dx

    def tile_fn(e, dy_tiles):
        total = _dot(dy_tiles[0], ws_EKN[0][e], True)
        for dy, w in zip(dy_tiles[1:], ws_EKN[1:], strict=True):
            total = total + _dot(dy, w[e], True)
        return [total]

    return _row_tiles(list(dys_RN), group_sizes_E, ws_EKN[0].shape[0], tile_fn, (dx,))[0]


def _xt_dy(x_TK, dy_TN):
    return lax.dot_general(
        x_TK, dy_TN, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32
    )


def tiled_weight_grad(x_RK, dy_RN, group_sizes_E, existing_out=None):
    """dw_EKN[e] = x[rows of e]^T @ dy[rows of e], accumulated per expert in a local carry.

    With `existing_out` (a float32 accumulator) the result is added to it in place instead:
    a caller summing many calls holds one float32 buffer, not one more per call. Only the
    experts with rows are visited: an empty expert's slice is left as it is (zero, or
    the accumulator's), neither read nor written."""
    rows, k = x_RK.shape
    n = dy_RN.shape[1]
    num_experts = group_sizes_E.shape[0]
    add = existing_out is not None
    if not add:
        existing_out = jnp.zeros((num_experts, k, n), x_RK.dtype)
    dw_EKN = varying_like(existing_out, x_RK, dy_RN, group_sizes_E)
    if rows == 0:
        return dw_EKN
    full, (tail, tail_E, tail_first_E), ends_E = tile_plan(group_sizes_E, tile_classes(rows))

    def expert_body(e, dw):
        acc_KN = varying_like(jnp.zeros((k, n), jnp.float32), x_RK, dy_RN, group_sizes_E)
        (big, big_E, big_first_E), *once = full

        def big_tile(j, acc):
            start = big_first_E[e] + j * big
            return acc + _xt_dy(
                lax.dynamic_slice_in_dim(x_RK, start, big),
                lax.dynamic_slice_in_dim(dy_RN, start, big),
            )

        acc_KN = lax.fori_loop(0, big_E[e], big_tile, acc_KN)
        # Smaller classes are used at most once per expert: a cond, not a loop.
        for tile, count_E, first_E in once:

            def one_tile(acc, tile=tile, start=first_E[e]):
                return acc + _xt_dy(
                    lax.dynamic_slice_in_dim(x_RK, start, tile),
                    lax.dynamic_slice_in_dim(dy_RN, start, tile),
                )

            acc_KN = lax.cond(count_E[e] > 0, one_tile, lambda acc: acc, acc_KN)

        def tail_tile(acc):
            start, keep = _tail_window(tail_first_E[e], ends_E[e], rows, tail)
            x_TK = jnp.where(keep, lax.dynamic_slice_in_dim(x_RK, start, tail), 0)
            return acc + _xt_dy(x_TK, lax.dynamic_slice_in_dim(dy_RN, start, tail))

        acc_KN = lax.cond(tail_E[e] > 0, tail_tile, lambda acc: acc, acc_KN)
        if add:
            acc_KN = acc_KN + lax.dynamic_index_in_dim(dw, e, 0, keepdims=False)
        return lax.dynamic_update_index_in_dim(dw, acc_KN.astype(dw.dtype), e, 0)

    # Only the experts with rows: their ids in order, then as many trips as there are
    # (a data-dependent trip count), so an empty expert's slice of `dw` (the caller's
    # float32 accumulator) is neither read nor written.
    served_E = jnp.nonzero(group_sizes_E > 0, size=num_experts, fill_value=0)[0]
    served = jnp.sum(group_sizes_E > 0)
    return lax.fori_loop(0, served, lambda i, dw: expert_body(served_E[i], dw), dw_EKN)


@jax.custom_vjp
def tiled_gmm(x_RK, ws_EKN, group_sizes_E):
    """Our grouped matmul of x against each weight in the tuple `ws_EKN` (one pass over
    the rows; see the module docstring); differentiable in x and the weights."""
    return tiled_forward(x_RK, ws_EKN, group_sizes_E)


def _tiled_fwd(x_RK, ws_EKN, group_sizes_E):
    return tiled_gmm(x_RK, ws_EKN, group_sizes_E), (x_RK, ws_EKN, group_sizes_E)


def _tiled_bwd(res, dys_RN):
    x_RK, ws_EKN, group_sizes_E = res
    dx_RK = tiled_input_grad(dys_RN, ws_EKN, group_sizes_E)
    dws = tuple(  # in the weights' dtype, as JAX's megablox returns it
        reduce_like(tiled_weight_grad(x_RK, dy, group_sizes_E).astype(w.dtype), w)
        for dy, w in zip(dys_RN, ws_EKN, strict=True)
    )
    return reduce_like(dx_RK, x_RK), dws, None


tiled_gmm.defvjp(_tiled_fwd, _tiled_bwd)


def gmm_multi(
    x_RK, ws_EKN, group_sizes_E, backend: str = "tiled_gmm", *, platform=None, row_tile=None
):
    """(gmm(x, w) for w in ws_EKN): the tiled backend reads x once for all of them and
    writes one input gradient; other backends run one gmm each."""
    group_sizes_E = group_sizes_E.astype(jnp.int32)
    if backend == "tiled_gmm":
        return tiled_gmm(x_RK, tuple(ws_EKN), group_sizes_E)
    return tuple(
        gmm(x_RK, w, group_sizes_E, backend, platform=platform, row_tile=row_tile) for w in ws_EKN
    )


def gmm(x_RK, w_EKN, group_sizes_E, backend: str = "tiled_gmm", *, platform=None, row_tile=None):
    """Grouped matmul with the named backend (see the module docstring).

    Args:
      x_RK: rows sorted by group (expert), (R, K).
      w_EKN: one (K, N) matrix per group, (E, K, N).
      group_sizes_E: rows of each group, (E,) int; rows past their sum come out zero.
      backend: "tiled_gmm", "ragged_dot", "pallas_megablox" or "tokamax".
      platform: the platform of the mesh the program is compiled for (`pallas_megablox`
        runs natively on "tpu", in Pallas interpret mode elsewhere); default: JAX's
        backend.
      row_tile: `pallas_megablox`'s rows a tile (the plan's `GmmTiling.tm`); default:
        128. tiled_gmm walks its own classes and ragged_dot is XLA's, so they ignore it.

    Returns:
      y_RN: row r times the matrix of its group.

    Examples:
      >>> import jax.numpy as jnp
      >>> from layers.grouped_matmul import gmm
      >>> x = jnp.ones((4, 2))
      >>> w = jnp.stack([jnp.eye(2), 2 * jnp.eye(2)])  # group 0: identity, group 1: twice
      >>> gmm(x, w, jnp.array([1, 2])).tolist()  # 1 row of group 0, 2 of group 1, 1 left
      [[1.0, 1.0], [2.0, 2.0], [2.0, 2.0], [0.0, 0.0]]
    """
    group_sizes_E = group_sizes_E.astype(jnp.int32)
    if backend == "tiled_gmm":
        return tiled_gmm(x_RK, (w_EKN,), group_sizes_E)[0]
    if backend == "ragged_dot":
        return lax.ragged_dot(x_RK, w_EKN, group_sizes_E)
    if backend == "pallas_megablox":
        platform = jax.default_backend() if platform is None else platform
        tile = {} if row_tile is None else {"row_tile": row_tile}
        return pallas_gmm(x_RK, w_EKN, group_sizes_E, interpret=platform != "tpu", **tile)
    if backend == "tokamax":
        import tokamax  # optional: the selector refuses gmm_backend=tokamax without it

        return tokamax.ragged_dot(x_RK, w_EKN, group_sizes_E)
    raise ValueError(
        f"unknown gmm backend {backend!r}: tiled_gmm, ragged_dot, pallas_megablox or tokamax"
    )
