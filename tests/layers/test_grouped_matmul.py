"""The tiled grouped matmul and its custom VJP against a plain per-expert reference."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from layer_helpers import assert_close

from layers.grouped_matmul import gmm, gmm_multi, tile_classes, tiled_weight_grad

CASES = {
    "uniform": [250, 250, 250, 250],
    "skewed_all_to_one": [1000, 0, 0, 0],
    "all_to_last": [0, 0, 0, 1000],
    "empty_experts": [300, 0, 650, 50],
    "tiny_groups": [1, 2, 3, 994],
    "every_tile_class": [512 + 256 + 128 + 64 + 7, 33, 0, 0],
    # An expert with more than one tile of the largest class: the loop over them steps
    # forward from the expert's first row.
    "two_largest_tiles": [40, 2 * 512 + 64 + 12, 0, 300],
    # More experts than the contraction's 24, each with a tail tile only: the tail
    # loop's schedule is sized by the experts, not by a weight's other dimensions.
    "more_experts_than_emb": [31] * 32,
}


def reference_gmm(x, w, sizes):
    """Row block e of x times w[e], one expert at a time, in float64."""
    x, w = np.asarray(x, np.float64), np.asarray(w, np.float64)
    out, start = np.zeros((x.shape[0], w.shape[2])), 0
    for e, n in enumerate(sizes):
        out[start : start + n] = x[start : start + n] @ w[e]
        start += n
    return out


def reference_grads(x, w, sizes, dy):
    x, w, dy = (np.asarray(a, np.float64) for a in (x, w, dy))
    dx, dw, start = np.zeros_like(x), np.zeros_like(w), 0
    for e, n in enumerate(sizes):
        rows = slice(start, start + n)
        dx[rows] = dy[rows] @ w[e].T
        dw[e] = x[rows].T @ dy[rows]
        start += n
    return dx, dw


@pytest.mark.parametrize("case", list(CASES))
def test_forward_and_gradients_match_reference(case):
    sizes = CASES[case]
    rows = sum(sizes)
    x = jax.random.normal(jax.random.key(0), (rows, 24))
    w = jax.random.normal(jax.random.key(1), (len(sizes), 24, 40))
    dy = jax.random.normal(jax.random.key(2), (rows, 40))
    gs = jnp.asarray(sizes, jnp.int32)
    y = jax.jit(gmm)(x, w, gs)
    assert_close(y, reference_gmm(x, w, sizes), what="gmm")
    dx, dw = jax.jit(jax.grad(lambda x, w: jnp.sum(gmm(x, w, gs) * dy), argnums=(0, 1)))(x, w)
    rdx, rdw = reference_grads(x, w, sizes, dy)
    assert_close(dx, rdx, what="dx")
    assert_close(dw, rdw, what="dw")
    empty = [e for e, n in enumerate(sizes) if n == 0]
    assert np.all(np.asarray(dw)[empty] == 0)


@pytest.mark.parametrize(
    "case", ["uniform", "empty_experts", "every_tile_class", "two_largest_tiles"]
)
def test_weight_gradient_adds_into_a_float32_accumulator(case):
    """The exchange's backward sums each slot's weight gradient into one float32 buffer
    through `existing_out`: the result is that buffer plus x^T dy per expert, experts with
    no rows keep what they held."""
    sizes = CASES[case]
    rows = sum(sizes)
    x = jax.random.normal(jax.random.key(0), (rows, 24))
    dy = jax.random.normal(jax.random.key(2), (rows, 40))
    held = jax.random.normal(jax.random.key(3), (len(sizes), 24, 40))
    gs = jnp.asarray(sizes, jnp.int32)
    got = jax.jit(tiled_weight_grad)(x, dy, gs, held)
    _, rdw = reference_grads(x, np.zeros((len(sizes), 24, 40)), sizes, dy)
    assert got.dtype == jnp.float32
    assert_close(got, np.asarray(held, np.float64) + rdw, what="dw accumulated")


def test_rows_past_the_groups_are_zero_and_get_no_gradient():
    x = jax.random.normal(jax.random.key(0), (100, 8))
    w = jax.random.normal(jax.random.key(1), (2, 8, 8))
    gs = jnp.asarray([30, 40], jnp.int32)
    y = gmm(x, w, gs)
    assert np.all(np.asarray(y)[70:] == 0)
    dx = jax.grad(lambda x: jnp.sum(gmm(x, w, gs)))(x)
    assert np.all(np.asarray(dx)[70:] == 0)


def test_multi_weights_share_one_pass_and_sum_input_gradients():
    sizes = [300, 0, 650, 50]
    x = jax.random.normal(jax.random.key(0), (1000, 16))
    w0, w1 = (jax.random.normal(jax.random.key(i), (4, 16, 32)) for i in (1, 2))
    gs = jnp.asarray(sizes, jnp.int32)
    a, b = gmm_multi(x, (w0, w1), gs)
    assert_close(a, reference_gmm(x, w0, sizes))
    assert_close(b, reference_gmm(x, w1, sizes))

    def loss(x, w0, w1):
        a, b = gmm_multi(x, (w0, w1), gs)
        return jnp.sum(jnp.sin(a) * b)

    def plain(x, w0, w1):
        return jnp.sum(jnp.sin(jax.lax.ragged_dot(x, w0, gs)) * jax.lax.ragged_dot(x, w1, gs))

    ours = jax.grad(loss, argnums=(0, 1, 2))(x, w0, w1)
    ref = jax.grad(plain, argnums=(0, 1, 2))(x, w0, w1)
    for o, r in zip(ours, ref, strict=True):
        assert_close(o, r)


def test_tile_plan_masks_a_tail_only_where_rows_are_left_over():
    """Each expert's rows as full tiles, largest first and each smaller class at most
    once, then one masked tail tile only for the rows left over (under 64): an expert
    whose rows are whole tiles, or which has none, runs no tail."""
    from layers.grouped_matmul import tile_plan

    sizes = jnp.asarray([1024 + 64, 0, 512 + 7, 63, 128], jnp.int32)
    full, (tail, tail_E, tail_first_E), ends_E = tile_plan(sizes, (512, 256, 128, 64))
    counts = {tile: np.asarray(count_E).tolist() for tile, count_E, _ in full}
    assert counts == {
        512: [2, 0, 1, 0, 0],
        256: [0, 0, 0, 0, 0],
        128: [0, 0, 0, 0, 1],
        64: [1, 0, 0, 0, 0],
    }
    assert tail == 64
    np.testing.assert_array_equal(tail_E, [0, 0, 1, 1, 0])
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    np.testing.assert_array_equal(np.asarray(tail_first_E)[[2, 3]], starts[[2, 3]] + [512, 0])
    np.testing.assert_array_equal(ends_E, np.cumsum(sizes))


def test_tile_classes_never_exceed_the_rows():
    assert tile_classes(10_000) == (512, 256, 128, 64)
    # A tile as large as the array is usable: 512 rows are one 512-row tile.
    assert tile_classes(512) == (512, 256, 128, 64)
    assert tile_classes(128) == (128, 64)
    assert tile_classes(100) == (64,)
    assert tile_classes(37) == (32,)
    assert tile_classes(1) == (1,)


@pytest.mark.parametrize("sizes", [[1, 0, 2, 0], [3, 0, 0, 0], [40, 77, 0, 83]])
def test_pallas_megablox_pads_rows_to_its_tile(sizes):
    """Decode-sized (3 rows) and ragged (200 rows) counts, neither a multiple of the
    128-row tile: the Pallas kernel (interpret mode on CPU) pads and drops the padding,
    and agrees with tiled_gmm forward and backward."""
    assert_agrees_with_tiled_gmm("pallas_megablox", sizes, rows=sum(sizes), hidden=128)


def assert_agrees_with_tiled_gmm(backend: str, sizes, rows: int, hidden: int) -> None:
    """`backend`'s rows, input gradient and weight gradient equal tiled_gmm's (rows past
    the groups' sum included)."""
    x = jax.random.normal(jax.random.key(0), (rows, 64))
    w = jax.random.normal(jax.random.key(1), (len(sizes), 64, hidden))
    dy = jax.random.normal(jax.random.key(2), (rows, hidden))
    gs = jnp.asarray(sizes, jnp.int32)

    def loss(name):
        return lambda x, w: jnp.sum(gmm(x, w, gs, name) * dy)

    y = gmm(x, w, gs, backend)
    assert y.shape == (rows, hidden)
    assert_close(y, gmm(x, w, gs, "tiled_gmm"), what=f"{backend} forward")
    got = jax.grad(loss(backend), argnums=(0, 1))(x, w)
    want = jax.grad(loss("tiled_gmm"), argnums=(0, 1))(x, w)
    assert_close(got[0], want[0], what=f"{backend} dx")
    assert_close(got[1], want[1], what=f"{backend} dw")


def _recording_kernels(monkeypatch):
    """Wrap the Pallas kernels the layers call, recording each call's (name, tiling,
    rows, whether it adds into an accumulator it is given: tgmm's `existing_out`)."""
    from layers import pallas_gmm

    seen = []
    for name in ("gmm", "tgmm"):
        kernel = getattr(pallas_gmm._kernels, name)

        def recorded(lhs, rhs, sizes, dtype, tiling, *args, _kernel=kernel, _name=name, **kw):
            rows = lhs.shape[1] if _name == "tgmm" else lhs.shape[0]  # tgmm takes x^T
            seen.append((_name, tuple(tiling), rows, "existing_out" in kw))
            return _kernel(lhs, rhs, sizes, dtype, tiling, *args, **kw)

        monkeypatch.setattr(pallas_gmm._kernels, name, recorded)
    return seen


@pytest.mark.parametrize("row_tile", [8, 32, 128])
def test_pallas_megablox_runs_the_row_tile_it_is_given(monkeypatch, row_tile):
    """The row tile a caller passes (the plan's) is the `tm` of every kernel call,
    forward gmm, input-gradient gmm and tgmm, the rows are padded to it, and the result
    still equals tiled_gmm's forward and backward."""
    seen = _recording_kernels(monkeypatch)
    sizes = [40, 0, 77, 83]
    rows = sum(sizes)
    x = jax.random.normal(jax.random.key(0), (rows, 64))
    w = jax.random.normal(jax.random.key(1), (len(sizes), 64, 128))
    dy = jax.random.normal(jax.random.key(2), (rows, 128))
    gs = jnp.asarray(sizes, jnp.int32)

    def loss(backend, **tile):
        return lambda x, w: jnp.sum(gmm(x, w, gs, backend, **tile) * dy)

    y = gmm(x, w, gs, "pallas_megablox", row_tile=row_tile)
    assert_close(y, gmm(x, w, gs, "tiled_gmm"), what="pallas forward")
    got = jax.grad(loss("pallas_megablox", row_tile=row_tile), argnums=(0, 1))(x, w)
    want = jax.grad(loss("tiled_gmm"), argnums=(0, 1))(x, w)
    assert_close(got[0], want[0], what="pallas dx")
    assert_close(got[1], want[1], what="pallas dw")
    assert {name for name, _, _, _ in seen} == {"gmm", "tgmm"}
    padded = -(-rows // row_tile) * row_tile
    assert {(tiling[0], m) for _, tiling, m, _ in seen} == {(row_tile, padded)}


@pytest.mark.parametrize("backend", ["tiled_gmm", "pallas_megablox"])
def test_weight_gradient_comes_back_in_the_weights_dtype(backend):
    """float32 rows against bfloat16 weights: the weight gradient is bfloat16, as JAX's
    megablox returns it, on every backend."""
    sizes = [100, 0, 28]
    x = jax.random.normal(jax.random.key(0), (sum(sizes), 128))
    w = jax.random.normal(jax.random.key(1), (3, 128, 128)).astype(jnp.bfloat16)
    gs = jnp.asarray(sizes, jnp.int32)
    dw = jax.grad(lambda w: jnp.sum(gmm(x, w, gs, backend).astype(jnp.float32)))(w)
    assert dw.dtype == jnp.bfloat16


_ROWS, _E = 600, 5
_fwd_bwd = jax.jit(
    lambda x, w, gs, dy: (
        gmm(x, w, gs),
        *jax.grad(lambda x, w: jnp.sum(gmm(x, w, gs) * dy), argnums=(0, 1))(x, w),
    )
)


@settings(max_examples=25, deadline=None)
@given(
    st.lists(st.integers(0, 300), min_size=_E, max_size=_E).filter(lambda s: sum(s) <= _ROWS),
    st.integers(0, 2**31 - 1),
)
def test_random_group_sizes_match_the_reference(sizes, seed):
    """Group sizes drawn at random (empty groups, groups under and over every tile
    class, rows left past the last group), as JAX's own megablox tests draw them: one
    compiled program, the sizes are data."""
    keys = jax.random.split(jax.random.key(seed), 3)
    x = jax.random.normal(keys[0], (_ROWS, 16))
    w = jax.random.normal(keys[1], (_E, 16, 24))
    dy = jax.random.normal(keys[2], (_ROWS, 24))
    y, dx, dw = _fwd_bwd(x, w, jnp.asarray(sizes, jnp.int32), dy)
    used = sum(sizes)
    assert np.all(np.asarray(y)[used:] == 0)
    rdx, rdw = reference_grads(x[:used], w, sizes, dy[:used])
    if used:
        assert_close(y[:used], reference_gmm(x[:used], w, sizes), what="y")
        assert_close(dx[:used], rdx, what="dx")
    assert np.all(np.asarray(dx)[used:] == 0)
    if np.any(rdw):
        assert_close(dw, rdw, what="dw")
    else:
        np.testing.assert_array_equal(dw, 0)


# A slot of the exchange: empty experts first, between and last, single-row experts
# beside them, one expert over a full tile, and rows past the last group.
SLOT_SIZES = [0, 1, 0, 0, 70, 1, 0, 9, 0]


@pytest.mark.parametrize("backend", ["tiled_gmm", "pallas_megablox"])
def test_weight_grad_into_adds_only_the_experts_with_rows(backend):
    """The exchange's per-slot weight gradient (layers.expert_parallel) adds x^T dy into
    the float32 accumulators in place: every expert with rows gets its own rows' product
    added to what it held (none skipped, none given a neighbour's or a stale sum), and an
    empty expert's accumulator comes back exactly as it was."""
    from layers.pallas_gmm import pallas_weight_grad_into

    rows = sum(SLOT_SIZES) + 5
    keys = jax.random.split(jax.random.key(3), 3)
    x = jax.random.normal(keys[0], (rows, 16))
    dy = jax.random.normal(keys[1], (rows, 8))
    acc = jax.random.normal(keys[2], (len(SLOT_SIZES), 16, 8))
    gs = jnp.asarray(SLOT_SIZES, jnp.int32)
    if backend == "tiled_gmm":
        got = jax.jit(lambda *a: tiled_weight_grad(*a[:3], existing_out=a[3]))(x, dy, gs, acc)
    else:
        got = jax.jit(lambda *a: pallas_weight_grad_into(*a, interpret=True, row_tile=8))(
            x, dy, gs, acc
        )
    assert got.dtype == jnp.float32
    got, expected = np.asarray(got), np.asarray(acc, np.float64).copy()
    xs, dys, start = np.asarray(x, np.float64), np.asarray(dy, np.float64), 0
    for e, n in enumerate(SLOT_SIZES):
        expected[e] += xs[start : start + n].T @ dys[start : start + n]
        start += n
        if n == 0:
            np.testing.assert_array_equal(got[e], np.asarray(acc)[e], err_msg=f"expert {e}")
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)


def test_tokamax_backend_matches_tiled_gmm_forward_and_backward():
    """gmm_backend=tokamax (tokamax's ragged_dot, an optional package: the 3.12 stack
    installs it) gives tiled_gmm's rows and gradients, empty groups and spare rows
    included."""
    pytest.importorskip("tokamax")
    sizes = [70, 0, 33, 5]
    assert_agrees_with_tiled_gmm("tokamax", sizes, rows=sum(sizes) + 12, hidden=96)
