"""The Pallas megablox kernels (JAX's `jax.experimental.pallas.ops.tpu.megablox`) wired
for use inside the block's `shard_map(check_vma=True)`.

JAX's kernels build their output as a `ShapeDtypeStruct` with no varying-axes type,
which a `check_vma=True` shard_map refuses at trace time ("`manual_axis_type` on
`jax.ShapeDtypeStruct` must not be `None`"), and JAX's own VJP for them (`ops.gmm`) is
traced in the backward pass, outside any scope the caller could open. So the kernel
(`gmm`, `tgmm`) stays JAX's and the VJP wiring is ours: each kernel call is traced with
the varying-axes check off, and its result is declared varying over exactly the mesh
axes its inputs vary over (the kernel computes per device, so that is what it is).
MaxText 0.2.5 instead turns the check off for its whole MoE shard_map (read in its
source); we keep the check for everything but the kernel call.

Rows are padded to a multiple of the row tile the plan chose (`GmmTiling.tm`,
selector.tiling; MaxText 0.2.5's source pads them the same way to its
`wi_tile_fwd_batch_seq`): the padding lies past every group, so it is neither computed
into nor read back.
Interpret mode (the kernel run by XLA, slowly) is for meshes that are not TPUs, decided
from the mesh's devices, not the local backend, as MaxText 0.2.5's layers/moe.py decides
it (read in its source), so a program compiled ahead of time for a TPU topology on a CPU
machine gets the native kernel.

Legend: R rows, K contraction, N output, E experts.
"""

from __future__ import annotations

import functools
import importlib

import jax
import jax.numpy as jnp
from jax import lax

# The varying-axes check of shard_map is a config state JAX keeps private; the kernel
# call is the one place it must be off (see the module docstring).
from jax._src import config as _jax_config

from selector.plan_sizes import pallas_kn_tile

from .vma import reduce_like, varying_like

# The kernels' module (the package's `gmm` attribute is JAX's VJP-wrapped function).
_kernels = importlib.import_module("jax.experimental.pallas.ops.tpu.megablox.gmm")

ROW_TILE = 128  # the row tile when no plan gives one (JAX's own default `tm`)


def _unchecked(kernel, *args, **kwargs):
    with _jax_config._check_vma(False):
        return kernel(*args, **kwargs)


def _gmm(x_RK, w_EKN, group_sizes_E, interpret: bool, tm: int, transpose_w: bool = False):
    k, n = (w_EKN.shape[2], w_EKN.shape[1]) if transpose_w else w_EKN.shape[1:]
    y_RN = _unchecked(
        _kernels.gmm,
        x_RK,
        w_EKN,
        group_sizes_E,
        x_RK.dtype,
        (tm, pallas_kn_tile(k), pallas_kn_tile(n)),
        transpose_rhs=transpose_w,
        interpret=interpret,
    )
    return varying_like(y_RN, x_RK, w_EKN, group_sizes_E)


def _tgmm(x_RK, dy_RN, group_sizes_E, dtype, interpret: bool, tm: int, existing_out=None):
    k, n = x_RK.shape[1], dy_RN.shape[1]
    into = {} if existing_out is None else {"existing_out": existing_out}
    dw_EKN = _unchecked(
        _kernels.tgmm,
        x_RK.swapaxes(0, 1),
        dy_RN,
        group_sizes_E,
        dtype,
        (tm, pallas_kn_tile(k), pallas_kn_tile(n)),
        interpret=interpret,
        **into,
    )
    return varying_like(dw_EKN, x_RK, dy_RN, group_sizes_E, *into.values())


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _padded_gmm(x_RK, w_EKN, group_sizes_E, interpret: bool, tm: int):
    return _gmm(x_RK, w_EKN, group_sizes_E, interpret, tm)


def _fwd(x_RK, w_EKN, group_sizes_E, interpret, tm):
    return _gmm(x_RK, w_EKN, group_sizes_E, interpret, tm), (x_RK, w_EKN, group_sizes_E)


def _bwd(interpret, tm, res, dy_RN):
    x_RK, w_EKN, group_sizes_E = res
    dx_RK = _gmm(dy_RN, w_EKN, group_sizes_E, interpret, tm, transpose_w=True)
    dw_EKN = _tgmm(x_RK, dy_RN, group_sizes_E, w_EKN.dtype, interpret, tm)
    return reduce_like(dx_RK, x_RK), reduce_like(dw_EKN, w_EKN), None


_padded_gmm.defvjp(_fwd, _bwd)


def _pad_rows(x_RK, row_tile: int):
    """x with zero rows appended up to a multiple of the row tile (past every group)."""
    rows = x_RK.shape[0]
    padded = -(-max(rows, 1) // row_tile) * row_tile
    return lax.pad(x_RK, jnp.zeros((), x_RK.dtype), ((0, padded - rows, 0), (0, 0, 0)))


def pallas_input_grad(dy_RN, w_EKN, group_sizes_E, *, interpret: bool, row_tile: int = ROW_TILE):
    """dy_RN rows of group e times w_EKN[e]^T: `pallas_gmm`'s input gradient, for callers
    that write their own VJP (the exchange)."""
    sizes = group_sizes_E.astype(jnp.int32)
    dy = _pad_rows(dy_RN, row_tile)
    return _gmm(dy, w_EKN, sizes, interpret, row_tile, transpose_w=True)[: dy_RN.shape[0]]


def pallas_weight_grad_into(
    x_RK, dy_RN, group_sizes_E, acc_EKN, *, interpret: bool, row_tile: int = ROW_TILE
):
    """acc_EKN[e] + x[rows of e]^T @ dy[rows of e] for every group, in acc's dtype (float32):
    `pallas_gmm`'s weight gradient added into an accumulator by the tgmm kernel itself
    (`existing_out`, aliased to its output), so no per-call gradient buffer is written
    and no separate add reads it back. The kernel still visits every group once (JAX's
    tgmm zeroes or keeps the groups without rows), reading and writing its block."""
    sizes = group_sizes_E.astype(jnp.int32)
    x, dy = _pad_rows(x_RK, row_tile), _pad_rows(dy_RN, row_tile)
    return _tgmm(x, dy, sizes, acc_EKN.dtype, interpret, row_tile, existing_out=acc_EKN)


def pallas_gmm(x_RK, w_EKN, group_sizes_E, *, interpret: bool, row_tile: int = ROW_TILE):
    """y_RN = x_RK rows of group e times w_EKN[e], by the Pallas megablox kernels
    (forward `gmm`; backward `gmm` against the transposed weights and `tgmm`), every
    one with `row_tile` rows a tile (the plan's `GmmTiling.tm`). The weight gradient
    comes back in the weights' dtype, as JAX's megablox returns it."""
    x_pad = _pad_rows(x_RK, row_tile)
    y = _padded_gmm(x_pad, w_EKN, group_sizes_E.astype(jnp.int32), interpret, row_tile)
    return y[: x_RK.shape[0]]
