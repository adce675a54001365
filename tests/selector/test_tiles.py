"""selector.tiles counts the rows the grouped-matmul kernels compute from the kernels' own
tile plans: Pallas megablox's `make_group_metadata` (run here on CPU) and tiled_gmm's
`tile_plan`, on the slot layout the layers' exchange builds, and at the Qwen3-Next
preset the CLI's `rows` is within 5% of what the kernel computes under uniform routing."""

import functools
import importlib
import json
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from subproc import ROOT

from layers import expert_parallel as ep
from layers.grouped_matmul import TILE_ROWS, tile_classes, tile_plan
from layers.pallas_gmm import ROW_TILE
from selector import tiles
from selector.plan_sizes import exchange_buffer_rows

megablox = importlib.import_module("jax.experimental.pallas.ops.tpu.megablox.gmm")

CASES = [
    [40] * 16,  # even, groups sharing tiles
    [128, 128, 256],  # every group tile-aligned
    [0, 0, 5, 0, 300, 0, 0],  # empty experts first, between and last
    [3, 0, 1],  # fewer rows than a tile
    [0, 0, 0, 0],  # nothing routed
    [1000],  # one expert
    [127, 1, 129, 255, 0, 64, 64, 513],  # around the tile edges
    [17, 250, 3, 90, 44, 0, 611, 5],  # uneven
    [4096, 4096],  # the whole array: the empty groups after it start past its last tile
    [128, 1],  # a lone row on a tile of its own
]


GROUPS = 40  # every case is padded to this many groups with empty trailing ones
ROWS = 8192  # and run on an array of this many rows: one compile for all of them


def _random_cases(n: int, seed: int):
    rng = np.random.default_rng(seed)
    for _ in range(n):
        experts = int(rng.integers(1, GROUPS))
        sizes = rng.poisson(rng.uniform(0, 200), experts)
        sizes[rng.random(experts) < 0.2] = 0
        yield [int(s) for s in sizes]


ALL_CASES = [c + [0] * (GROUPS - len(c)) for c in CASES + list(_random_cases(24, 0))]
assert all(sum(c) <= ROWS for c in ALL_CASES)
CASE_IDS = [f"case{i}" for i in range(len(ALL_CASES))]


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _jitted_metadata(sizes, m: int, tm: int, visit_empty: bool):
    # Jitted: eager, each of its ops compiles anew for every shape (minutes per test).
    return megablox.make_group_metadata(
        group_sizes=sizes,
        m=m,
        tm=tm,
        start_group=jnp.asarray(0, jnp.int32),
        num_nonzero_groups=sizes.shape[0],
        visit_empty_groups=visit_empty,
    )


def _kernel_m_tiles(m_tile_ids, num_tiles: int) -> int:
    """Distinct m tiles among the schedule's first `num_tiles` visits."""
    return len(set(m_tile_ids[:num_tiles].tolist()))


def _metadata(sizes, m: int, tm: int, visit_empty: bool):
    """The Pallas kernel's own schedule: (group_ids, m_tile_ids, num_tiles)."""
    padded = -(-max(m, 1) // tm) * tm  # as layers/pallas_gmm.py pads the rows
    group_sizes = jnp.asarray(sizes, jnp.int32)
    (_, group_ids, m_tile_ids), num_tiles = _jitted_metadata(group_sizes, padded, tm, visit_empty)
    return np.asarray(group_ids), np.asarray(m_tile_ids), int(num_tiles)


def kernel_pallas_rows(sizes, m: int, tm: int = ROW_TILE) -> int:
    """Rows the Pallas gmm computes: its scheduled tiles times tm."""
    return _metadata(sizes, m, tm, visit_empty=False)[2] * tm


def kernel_tiled_rows(sizes, array_rows: int) -> int:
    """Rows tiled_gmm computes, read off its own tile plan: full tiles and masked tails."""
    full, (tail, tail_E, _), _ = tile_plan(jnp.asarray(sizes, jnp.int32), tile_classes(array_rows))
    rows = sum(tile * int(count_E.sum()) for tile, count_E, _ in full)
    return rows + tail * int(tail_E.sum())


def test_the_selectors_constants_are_the_kernels():
    assert tiles.PALLAS_ROW_TILE == ROW_TILE
    assert tiles.TILED_GMM_TILE_ROWS == TILE_ROWS
    for rows in (1, 2, 3, 40, 63, 64, 65, 200, 511, 512, 4096):
        assert tiles.tiled_gmm_classes(rows) == tile_classes(rows), rows


@pytest.mark.parametrize("tm", [128, 64, 32, 16])
@pytest.mark.parametrize("sizes", ALL_CASES, ids=CASE_IDS)
def test_pallas_tiles_are_make_group_metadatas(sizes, tm):
    """gmm's schedule (no visits to empty groups) and tgmm's (one visit each), tile for
    tile; a tile two groups share counts once for each. Also the distinct m tiles the
    schedule visits (what the grid's row blocks move with)."""
    for visit_empty in (False, True):
        _, m_tile_ids, expected = _metadata(sizes, ROWS, tm, visit_empty)
        assert tiles.pallas_tiles(sizes, tm, visit_empty=visit_empty) == expected
        distinct = _kernel_m_tiles(m_tile_ids, expected)
        assert tiles.pallas_m_tiles(sizes, tm, ROWS, visit_empty=visit_empty) == distinct


@pytest.mark.parametrize("tm", [128, 16])
@pytest.mark.parametrize("fill", ["whole", "halves", "few"])
def test_distinct_m_tiles_on_an_array_of_one_tile(fill, tm):
    """An array no longer than a tile: every visit, an empty group's past the array
    included, lands on its one tile."""
    sizes = {"whole": [tm, 0, 0], "halves": [tm // 2, tm // 2, 0], "few": [0, 3, 0]}[fill]
    for visit_empty in (False, True):
        _, m_tile_ids, expected = _metadata(sizes, tm, tm, visit_empty)
        distinct = _kernel_m_tiles(m_tile_ids, expected)
        assert tiles.pallas_m_tiles(sizes, tm, tm, visit_empty=visit_empty) == distinct


def test_distinct_m_tiles_are_counted_per_group_not_per_row():
    """A device's rows can number billions (a typo's batch): the count holds one span a
    group, not a tile a row block. Measured with tracemalloc at 2**24 rows (a set of
    the 2**17 tiles would take megabytes); 2**40 rows then run in no more."""
    import tracemalloc

    tracemalloc.start()
    try:
        assert tiles.pallas_m_tiles([0, 2**24, 0], 128, 2**24 + 1, visit_empty=True) == 2**17 + 1
        assert tracemalloc.get_traced_memory()[1] < 64 * 1024
    finally:
        tracemalloc.stop()
    count = tiles.pallas_m_tiles([2**40], 128, 2**40)
    assert count == 2**33 and type(count) is int  # exact: a float has 53 bits


def _moves(indices) -> int:
    """Block transfers of a grid walk: one for every step whose block index differs from
    the previous step's (Pallas's TPU pipeline fetches, or writes back, only then)."""
    return sum(1 for i, index in enumerate(indices) if i == 0 or index != indices[i - 1])


def _walked_bytes(sizes, tm: int, k: int, n: int, train: bool) -> int:
    """HBM elements the kernels' grids move, walked step by step over the kernel's own
    schedule with the BlockSpec index maps of jax's megablox gmm.py: gmm's grid is
    (n tiles, visits, k tiles), tgmm's (n tiles, k tiles, visits with empty groups)."""
    tk, tn = (128 if d % 128 == 0 else d for d in (k, n))

    def gmm(contract, out, tc, to):
        group_ids, m_ids, visits = _metadata(sizes, ROWS, tm, False)
        steps = [
            (j, t, c)
            for j in range(-(-out // to))
            for t in range(visits)
            for c in range(-(-contract // tc))
        ]
        lhs = _moves([(m_ids[t], c) for j, t, c in steps])
        rhs = _moves([(group_ids[t], c, j) for j, t, c in steps])
        res = _moves([(m_ids[t], j) for j, t, c in steps])
        return lhs * tm * tc + rhs * tc * to + res * tm * to

    total = gmm(k, n, tk, tn)
    if train:
        total += gmm(n, k, tn, tk)  # the input gradient: the weight transposed
        group_ids, m_ids, visits = _metadata(sizes, ROWS, tm, True)
        steps = [
            (j, c, t) for j in range(-(-n // tn)) for c in range(-(-k // tk)) for t in range(visits)
        ]
        lhs = _moves([(m_ids[t], c) for j, c, t in steps])
        rhs = _moves([(m_ids[t], j) for j, c, t in steps])
        res = _moves([(group_ids[t], c, j) for j, c, t in steps])
        total += lhs * tm * tk + rhs * tm * tn + res * tk * tn
    return total


WEIGHTS = [(256, 128), (128, 384), (128, 128), (384, 256)]  # one or several k and n tiles


@pytest.mark.parametrize("tm", [128, 32])
@pytest.mark.parametrize("sizes", ALL_CASES[:8] + ALL_CASES[-4:], ids=CASE_IDS[:8] + CASE_IDS[-4:])
def test_pallas_hbm_bytes_are_the_grids_block_moves(sizes, tm):
    """The bytes the tile choice is priced with are the blocks the kernels' grids move,
    walked step by step over make_group_metadata's schedule (forward, and training's
    input and weight gradients), for weights of one and of several k and n tiles."""
    for train in (False, True):
        walked = sum(_walked_bytes(sizes, tm, k, n, train) for k, n in WEIGHTS)
        assert tiles.pallas_hbm_bytes([(sizes, ROWS)], tm, WEIGHTS, 1, train) == walked


@pytest.mark.parametrize("sizes", ALL_CASES, ids=CASE_IDS)
def test_tgmm_computes_the_tiles_gmm_computes(sizes):
    """tgmm visits empty groups but does its dot only where the group has rows (its
    kernel's `dont_skip`), so the weight gradient computes the forward's tiles."""
    group_ids, _, num_tiles = _metadata(sizes, ROWS, ROW_TILE, visit_empty=True)
    computing = sum(1 for g in group_ids[:num_tiles] if sizes[g] > 0)
    assert computing * ROW_TILE == tiles.pallas_rows(sizes)


@pytest.mark.parametrize("sizes", ALL_CASES, ids=CASE_IDS)
def test_tiled_gmm_rows_are_its_tile_plans(sizes):
    """The forward's and input gradient's walk, on arrays of several sizes (a slot
    longer than its rows; fewer rows than the smallest class)."""
    total = sum(sizes)
    for array_rows in {max(total, 1), total + 300, 40}:
        if array_rows < total:
            continue
        assert tiles.tiled_gmm_rows(sizes, array_rows) == kernel_tiled_rows(sizes, array_rows)


@pytest.mark.parametrize("sizes", ALL_CASES, ids=CASE_IDS)
def test_tiled_weight_gradient_walks_the_same_tiles(sizes):
    """tiled_weight_grad loops over the largest class and takes each smaller class and
    the tail once under a cond: the same tiles as the forward, since a smaller class is
    used at most once per expert."""
    array_rows = max(sum(sizes), 1)
    group = jnp.asarray(sizes, jnp.int32)
    (big, big_E, _), *once = tile_plan(group, tile_classes(array_rows))[0]
    tail, tail_E, _ = tile_plan(group, tile_classes(array_rows))[1]
    walked = big * int(big_E.sum()) + tail * int((tail_E > 0).sum())
    walked += sum(tile * int((count_E > 0).sum()) for tile, count_E, _ in once)
    assert walked == tiles.tiled_gmm_rows(sizes, array_rows)


def test_uniform_split_is_as_even_as_integers_allow():
    assert tiles.uniform_group_sizes(10, 4) == (3, 3, 2, 2)
    assert tiles.uniform_group_sizes(3, 5) == (1, 1, 1, 0, 0)
    assert tiles.uniform_group_sizes(20480, 512) == (40,) * 512


def _sender_slots(ids_R, experts: int, group: int, buffer: int, rounds: int):
    """The slots one sender fills, built by the layers' own exchange pieces: for each
    round, owner g's slot's group sizes over its local experts."""
    local = experts // group
    ex = ep.ExchangeGroup(("g",), group, (), 0.5625, "all_to_all", "tiled_gmm", jnp.float32)
    ids_R = jnp.sort(jnp.asarray(ids_R, jnp.int32))
    sizes_E = jnp.zeros((experts,), jnp.int32).at[ids_R].add(1)
    starts_G, counts_G = ep._routing(sizes_E, ex, local)
    token_R = jnp.arange(ids_R.shape[0])
    for r in range(rounds):
        rnd = ep._Round.of(r, starts_G, counts_G, token_R, buffer)
        ids_GB = rnd.pack_rows(ids_R % local, local)
        for g in range(group):
            yield [int(s) for s in ep._slot_group_sizes(ids_GB[g], local)]


def _rounds(senders, experts: int, group: int, buffer: int) -> int:
    """As the layers agree on them: the largest send of any device to any owner, in B."""
    most = max(
        int(np.bincount(np.asarray(ids) // (experts // group), minlength=group).max())
        for ids in senders
    )
    return -(-most // buffer)


def _exchanged_kernel_rows(senders, experts, group, buffer, kernel, tm=ROW_TILE) -> float:
    """What a device computes on average, every sender's slots run by their owners."""
    rounds = _rounds(senders, experts, group, buffer)
    total = 0
    for ids in senders:
        for sizes in _sender_slots(ids, experts, group, buffer, rounds):
            if kernel == "pallas_megablox":
                total += kernel_pallas_rows(sizes, buffer, tm)
            else:
                total += kernel_tiled_rows(sizes, buffer)
    return total / len(senders)


def _even_ids(rows: int, experts: int):
    return np.repeat(np.arange(experts), tiles.uniform_group_sizes(rows, experts))


@pytest.mark.parametrize("kernel", ["pallas_megablox", "tiled_gmm"])
@pytest.mark.parametrize("rows,experts,group", [(600, 16, 4), (2000, 32, 2), (90, 8, 4)])
def test_exchanged_layout_is_the_layers_slots(kernel, rows, experts, group):
    """Under an even split every sender fills the same slots; the selector's count over
    its slot layout is the kernel's count over the slots the layers pack."""
    buffer = exchange_buffer_rows(rows, group, 0.5625)
    senders = [_even_ids(rows, experts)] * group
    expected = _exchanged_kernel_rows(senders, experts, group, buffer, kernel)
    calls = tiles.exchanged_calls(rows, experts, group, buffer)
    assert tiles.kernel_rows(kernel, calls) == expected


def _cli_json(*overrides: str) -> dict:
    out = subprocess.run(
        [sys.executable, "-m", "selector", "output=json", *overrides],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert out.returncode in (0, 1), out.stderr
    return json.loads(out.stdout)


def _sampled_ids(rng, tokens: int, k: int, experts: int):
    """Uniform routing as a router gives it: each token's k distinct experts at random."""
    return np.argsort(rng.random((tokens, experts)), axis=1)[:, :k].reshape(-1)


@pytest.mark.parametrize("kernel", ["pallas_megablox", "tiled_gmm"])
def test_cli_rows_at_the_qwen3_next_preset_are_the_kernels(kernel):
    """Qwen3-Next with cp=4 on v5p (2,048 tokens a device, k=10, E=512): each megablox
    candidate's `rows` (the Pallas kernels' at the plan's row tile) is within 5% of the
    kernel's count under sampled uniform routing, and tiled_gmm's is its count under
    the even split exactly (sampled groups start anywhere in a tile, as the Pallas
    count assumes: `pallas_expected_tiles`)."""
    report = _cli_json(
        "model=qwen3_next_80b_a3b",
        "ici_context_parallelism=4",
        f"gmm_backend={kernel}",
        "expert_group=expert_and_sequence",
    )
    by_name = {c["name"]: c for c in report["plan"]["candidates"]}
    tokens = report["plan"]["per_device"]["tokens_per_device"]
    k, experts = 10, 512
    rows = int(tokens * k)
    gather, exchange = by_name["megablox/gather"], by_name["megablox/all_to_all"]
    tm = gather["tiling"]["tm"]  # the Pallas kernels' row tile, as the plan chose it
    assert exchange["tiling"]["tm"] == tm
    group = experts // exchange["placement"]["experts_per_device"]
    assert group == 4  # the context axis
    buffer = exchange_buffer_rows(rows, group, 0.5625)
    rng = np.random.default_rng(0)
    sampled = [_sampled_ids(rng, int(tokens), k, experts) for _ in range(group)]

    def gathered_kernel(ids):
        sizes = np.bincount(ids, minlength=experts).tolist()
        if kernel == "pallas_megablox":
            return kernel_pallas_rows(sizes, len(ids), tm)
        return kernel_tiled_rows(sizes, len(ids))

    even = [_even_ids(rows, experts)] * group
    if kernel == "tiled_gmm":  # its walk does not depend on where in a tile groups start
        assert gather["rows"] == gathered_kernel(even[0])
        assert exchange["rows"] == _exchanged_kernel_rows(even, experts, group, buffer, kernel)
    assert gather["rows"] == pytest.approx(gathered_kernel(sampled[0]), rel=0.05)
    measured = _exchanged_kernel_rows(sampled, experts, group, buffer, kernel, tm)
    assert exchange["rows"] == pytest.approx(measured, rel=0.05)


QWEN3_NEXT_CP4 = (
    "model=qwen3_next_80b_a3b",
    "ici_context_parallelism=4",
    "per_device_batch_size=0.25",
    "max_target_length=8192",
)


def test_qwen3_next_cp4_row_tile_is_the_cheapest_priced():
    """Qwen3-Next with cp=4 on v5p (40 routed rows an expert): each Pallas candidate's
    row tile is the cheapest of the tiles priced, each tile's price is its rows' FLOPs
    at peak plus the grids' HBM bytes at the chip's bandwidth (recounted here from
    selector.tiles at that tile), and its `rows` is the rows at that tile. The rows come
    within 1.5x of the routed rows only at a tile the priced time calls slower: every
    tile that close costs more than the chosen one (the numbers the README quotes)."""
    report = _cli_json(*QWEN3_NEXT_CP4)
    plan = report["plan"]
    routed = int(plan["per_device"]["gmm_rows"])
    assert plan["gmm_backend"] == "pallas_megablox"
    chosen = next(c for c in plan["candidates"] if c["chosen"])
    for c in plan["candidates"]:
        if c["tiling"] is None:
            assert c["strategy"] != "megablox" and c["tile_options"] == []
            continue
        options = {o["tm"]: o for o in c["tile_options"]}
        assert sorted(options) == [16, 32, 64, 128, 256, 512]  # bfloat16: whole sublanes
        experts = 512
        if c["exchange"] == "all_to_all":
            group = experts // c["placement"]["experts_per_device"]
            buffer = exchange_buffer_rows(routed, group, 0.5625)
            calls = tiles.exchanged_calls(routed, experts, group, buffer)
        else:
            calls = tiles.gathered_calls(routed, experts)
        for tm, o in options.items():
            rows = tiles.kernel_rows("pallas_megablox", calls, tm, expected=True)
            weights = [(2048, 512)] * 2 + [(512, 2048)]
            hbm = tiles.pallas_hbm_bytes(calls, tm, weights, 2, True, expected=True)
            assert o["rows"] == rows
            assert o["compute_s"] == pytest.approx(2 * rows * 3 * 2048 * 512 * 3 / 459e12)
            assert o["hbm_s"] == pytest.approx(hbm / 2765e9)
        best = min(options.values(), key=lambda o: o["time_s"])
        assert c["tiling"] == {"kernel": "pallas_megablox", "tm": best["tm"], "source": "priced"}
        assert c["rows"] == best["rows"]
        close = [o for o in options.values() if o["rows"] <= 1.5 * routed]
        assert close, "some tile computes within 1.5x of the routed rows"
        if c["rows"] > 1.5 * routed:
            assert all(o["time_s"] > best["time_s"] for o in close)
    by_tm = {o["tm"]: o for o in chosen["tile_options"]}
    old, mine = by_tm[128], by_tm[chosen["tiling"]["tm"]]  # 128: the former constant
    assert mine["rows"] < old["rows"] and mine["time_s"] < old["time_s"]


def test_gmm_row_tile_forces_the_tile_and_is_counted_at_it():
    """gmm_row_tile=128 takes the kernel's old tile back: rows 4x the routed ones."""
    report = _cli_json(*QWEN3_NEXT_CP4, "gmm_row_tile=128", "expert_exchange=gather")
    chosen = next(c for c in report["plan"]["candidates"] if c["chosen"])
    assert chosen["tiling"] == {"kernel": "pallas_megablox", "tm": 128, "source": "gmm_row_tile"}
    routed = tiles.gathered_calls(20480, 512)
    counted = tiles.kernel_rows("pallas_megablox", routed, 128, expected=True)
    assert chosen["rows"] == counted == 20480 + 512 * 127  # each group: 1 + 39/128 tiles
