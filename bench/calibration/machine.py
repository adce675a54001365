"""The machine constants the counted time model prices with (`selector.timing`),
measured on this machine's devices by microbenchmarks that are not MoE blocks.

Every device runs the same small program at once, inside one shard_map over all of
them, so what one device sustains while the others work is what is measured (8
simulated CPU devices share this machine's cores, as the blocks they price do). Each
program is timed ROUNDS times (after a call that compiles it) and the median kept; what
an op costs is read as the difference between a program of many such ops and one of a
single op, so the cost of calling a program drops out:

- call_us: one call of a program that adds 1 to a few floats on every device;
- launch_us: a chain of dependent 4 x 4 dots (nothing to compute, nothing to fuse
  across them), per dot;
- matmul_curve: float32 dots over a grid of shapes (rows 8 to 2,048, K x N 64 x 128 to
  640 x 1,280), each as the grouped matmul runs a tile: in a loop of 32 trips, rows
  sliced at a moving offset times one of 8 weights picked by the trip, written back in
  place; per trip. The FLOP rate a device sustains against a dot's MFLOPs and its
  matrix's K x N (the count reads each dot's rate at its rows and matrix, log-log
  between points: `selector.timing.matmul_rate`);
- gmm_curve: tiled_gmm's own tile visits (forward, input gradient and weight gradient,
  8 experts of one tile each, tiles of 16 to 512 rows (16 and 32: an array under 32 or
  64 rows, each expert's rows a masked tail tile), K x N 64 x 128 to 640 x 1,280: GMM_KN), per visit,
  credited with the FLOPs of the tiles its plan visits
  (`selector.tiles.tiled_gmm_visits`); 4, 2 or 1 experts where 8 would make a call
  too big for the cache (`gmm_experts`), so every point is a call that fits;
- cache_mib: the last-level cache a core has (Linux's /sys: its size over the CPUs
  sharing it), what a device's running program can keep its arrays in;
- gmm_streamed_gbps (`--gmm_streaming`, apart from the rest, with the curve's points
  whose experts it changes): a tile visit's time as its call holds more experts of one
  tile each (3 shapes off the picks' sets, calls of 1 to 6 MB and of 35 to 50 MB), the
  bytes a visit moves over what it adds once its call is past twice the cache;
- einsum_curve: the dense and capacity paths' batched einsum "tm,emh->teh";
- hbm_bandwidth_gbps: a chain of 8 elementwise multiply-adds over 4M floats (bytes read
  and written);
- gather_gbps: rows of (8,192, 128) float32 taken in a random order (each added to the
  rows the last op wrote, so no two gathers fold into one), and added back by a
  scatter-add, in chains of 4, the median of the two (bytes of the rows moved);
- collective_latency_us, ici_bandwidth_gbps: chains of 4 all-to-alls, all-gathers and
  psums over the 8 devices at 5 sizes (8 KB to 8 MB a device); for each kind a line
  time = latency + bytes / bandwidth through the sizes (least relative squares), the
  median of the three kinds;
- relayout_gbps, transpose_gbps: an all-gather of an (E, M, H) float32 matrix over the 8
  devices along its middle dim, and along its minor dim, each less the same gather along
  its major dim (XLA:CPU gathers in a layout with the gathered dim major and copies the
  result back, as it does the grouped matmul's weights), and the same for a
  reduce-scatter; bytes read and written by the copy (twice the matrix) per second of
  the difference, the median over 3 shapes and the two collectives. The middle dim's
  copy keeps the minor dim (the gate and up matrices'), the minor dim's changes it (the
  out matrix's);
- activation_relayout_gbps, activation_transpose_gbps (`--activation_copies`, apart
  from the rest): an elementwise pass over a (T, E, H) float32 activation written in
  another layout, keeping its minor dim ((E, T, H)) or changing it ((E, H, T)), less
  the same pass written in place; bytes read and written (twice the array) per second
  of the difference, the median over 5 shapes off the picks' sets. The dense path's
  programs on XLA:CPU write its hidden and per-expert activations so
  (`selector.traits.Traits.dense_activation_copies`);
- loop_trip_us: a fori_loop of 1,000 trips whose body is one 4 x 4 dot, per trip less
  one launch (the loop's own cost a trip; 0 when a trip costs no more than its dot);
- weight_gather_gbps, weight_scatter_gbps (`--weight_gathers`, apart from the rest): the
  three routed matrices of an (E, M, H) shape sharded along the embed dim over the 8
  devices, gathered and sliced per expert by a loop of dots (forward; and with the
  weights' gradient, reduce-scattered), less the same program on whole copies; bytes a
  device receives per second, the median over 4 shapes off the picks' sets. Beside each
  shape, what the ICI and relayout rates alone price it at.

`--write` stores them in conf/hardware/cpu.yaml, which the selector reads (the library
reads no study's output); tests/test_machine.py checks the file against this study's JSON.

    python -m bench.calibration.machine            # measure, write bench/results/machine_cpu.json and .png
    python -m bench.calibration.machine --write    # and conf/hardware/cpu.yaml
    python -m bench.calibration.machine --relayouts --write  # those two rates alone
    python -m bench.calibration.machine --weight_gathers --write  # the in-place rates alone
    python -m bench.calibration.machine --activation_copies --write  # the activation copy rates alone
    python -m bench.calibration.machine --gmm_streaming --write  # the cache, the streaming rate
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

from bench.common import use_cpu_devices

if __name__ == "__main__":
    use_cpu_devices(8)

from bench.common import arguments, load, machine, median, pyplot, save, table  # noqa: E402

ROUNDS = 15
STUDY = "machine_cpu"
HARDWARE_FILE = Path(__file__).resolve().parents[2] / "conf" / "hardware" / "cpu.yaml"
MATMUL_ROWS = (8, 32, 64, 128, 512, 2048)
MATMUL_KN = ((64, 128), (192, 384), (640, 1280))
TRIPS = 32
COLLECTIVE_ROWS = (16, 128, 1024, 4096, 16384)  # rows of 128 float32 a device
RELAYOUT_SHAPES = ((64, 192, 384), (32, 96, 192), (16, 192, 768))  # (E, M, H) gathered
ACTIVATION_COPY_SHAPES = (  # (T, E, H)
    (1536, 16, 256),
    (512, 40, 320),
    (2048, 6, 448),
    (1024, 12, 640),
    (4096, 4, 160),
)
CURVES = ("matmul_curve", "gmm_curve", "einsum_curve")
SCALARS = (
    "call_us",
    "launch_us",
    "loop_trip_us",
    "hbm_bandwidth_gbps",
    "gather_gbps",
    "ici_bandwidth_gbps",
    "collective_latency_us",
    "relayout_gbps",
    "transpose_gbps",
    "weight_gather_gbps",
    "weight_scatter_gbps",
    "activation_relayout_gbps",
    "activation_transpose_gbps",
    "cache_mib",
    "gmm_streamed_gbps",
)


def _timed(fn, *args, rounds: int = ROUNDS) -> float:
    """Median seconds of `rounds` calls (after one that compiles)."""
    import time

    import jax

    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return median(times)


def _program(body, *shapes, dtype="float32"):
    """jit(shard_map(body)) over every device, each holding `dtype` arrays of `shapes`,
    and those arrays (global: a leading dim of devices x shape[0])."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    devices = jax.devices()
    mesh = Mesh(np.asarray(devices), ("d",))
    spec = P("d")
    fn = jax.jit(
        jax.shard_map(
            body, mesh=mesh, in_specs=tuple(spec for _ in shapes), out_specs=spec, check_vma=False
        )
    )
    keys = jax.random.split(jax.random.key(0), len(shapes))
    args = [
        jax.device_put(
            (jax.random.normal(key, (len(devices) * s[0], *s[1:]), jnp.float32) * 0.1).astype(
                dtype
            ),
            NamedSharding(mesh, spec),
        )
        for key, s in zip(keys, shapes, strict=True)
    ]
    return fn, args


def _per_op(make, shapes, ops: int) -> float:
    """Seconds one op of `make(n)`'s chain adds: (chain of `ops` - chain of 1) / (ops - 1)."""
    long, short = (_timed(*_flat(_program(make(n), *shapes))) for n in (ops, 1))
    return (long - short) / (ops - 1)


def _flat(pair):
    fn, args = pair
    return (fn, *args)


def call() -> float:
    return _timed(*_flat(_program(lambda x: x + 1.0, (8,))))


def launch() -> float:
    def chain(n):
        def body(x):
            y = x
            for _ in range(n):
                y = y @ x  # each dot waits for the last; XLA fuses no dot into a dot
            return y

        return body

    return _per_op(chain, [(4, 4)], 201)


def matmul_curve(rows_list=MATMUL_ROWS, kn_list=MATMUL_KN, dtype="float32") -> list[dict]:
    """Per dot size, the FLOP rate of a dot as the grouped matmul runs its tiles: a
    fori_loop of TRIPS trips whose body slices `rows` rows of the input at a moving
    offset, multiplies them by one of E weights (indexed by the trip) and writes the
    product into the output in place; per trip, the loop of TRIPS against a loop of 1."""
    import jax.numpy as jnp
    from jax import lax

    experts = 8
    out = []
    for rows in rows_list:
        for k, n in kn_list:
            array = max(rows * 4, 256)

            def loop(trips, rows=rows, k=k, n=n, array=array):
                def body(x, w):
                    w = w.reshape(experts, k, n)

                    def trip(i, o):
                        start = (i * 8) % (array - rows + 1)
                        y = lax.dynamic_slice_in_dim(x, start, rows) @ w[i % experts]
                        return lax.dynamic_update_slice_in_dim(o, y, start, 0)

                    return lax.fori_loop(0, trips, trip, jnp.zeros((array, n), x.dtype))

                return body

            long, short = (
                _timed(*_flat(_program(loop(t), (array, k), (experts * k, n), dtype=dtype)))
                for t in (TRIPS + 1, 1)
            )
            seconds = max((long - short) / TRIPS, 1e-9)
            flops = 2 * rows * k * n
            out.append(
                {
                    "shape": f"{rows}x{k}x{n}",
                    "mflops": flops / 1e6,
                    "tflops": flops / seconds / 1e12,
                }
            )
    return sorted(out, key=lambda r: r["mflops"])


# Tiles tiled_gmm visits: its classes (selector.tiles.TILED_GMM_TILE_ROWS), and 32 and 16
# rows, the tiles of arrays under 64 and under 32 rows (an exchange's small slot buffers).
GMM_TILES = (16, 32, 64, 128, 256, 512)
# K x N of the tiles' matrices: three widths in the ratio of an expert's (M, H), and two
# between the first two (one square, as a hidden dim split over tensor leaves it), where a
# reading between 64 x 128 and 192 x 384 alone priced the dots up to 1.9 times their time.
GMM_KN = ((64, 128), (128, 256), (192, 192), (192, 384), (640, 1280))
GMM_EXPERTS = 8


def gmm_layout(tile: int, experts: int = GMM_EXPERTS) -> tuple[int, int]:
    """(rows an expert, rows of the array) of a point whose experts each take one tile
    of `tile` rows. From the smallest class up, each expert holds a full tile; below it
    (an array under 64 rows has one class, a power of two under its rows) the array is
    one tile's rows and each expert's few rows are a masked tail tile, as in an
    exchange slot of fewer than 64 rows. (Eight experts of 32 rows on a 256-row array
    would each run a 64-row tail tile instead.)"""
    from selector.tiles import TILED_GMM_TILE_ROWS

    if tile >= min(TILED_GMM_TILE_ROWS):
        return tile, tile * experts
    return max(tile // experts, 1), tile


def _gmm_passes(tile: int, e: int, k: int, n: int, reps: int = 1):
    """(body, shapes...) of tiled_gmm's three passes over `e` experts laid out by
    `gmm_layout(tile, e)`, each run `reps` times in a fori_loop, each time on the next
    slice of its rows (the same weights): the forward and the input gradient write each
    slice's product into its rows of one output in place, the weight gradient adds into
    one float32 accumulator in place (as an exchange's slots do). No call is loop
    invariant, so XLA cannot hoist it."""
    import jax.numpy as jnp
    from jax import lax

    from layers.grouped_matmul import tiled_forward, tiled_input_grad, tiled_weight_grad

    each, rows = gmm_layout(tile, e)
    sizes = jnp.full((e,), each, jnp.int32)

    def chunk(a, i):
        return lax.dynamic_slice_in_dim(a, i * rows, rows)

    def rows_out(product, a, width):
        def rep(i, out):
            return lax.dynamic_update_slice_in_dim(out, product(chunk(a, i)), i * rows, 0)

        return lax.fori_loop(0, reps, rep, jnp.zeros((reps * rows, width), a.dtype))

    def forward(x, w):
        return rows_out(lambda x: tiled_forward(x, (w.reshape(e, k, n),), sizes)[0], x, n)

    def input_grad(d, w):
        return rows_out(lambda d: tiled_input_grad((d,), (w.reshape(e, k, n),), sizes), d, k)

    def weight_grad(x, d):
        def rep(i, acc):
            return tiled_weight_grad(chunk(x, i), chunk(d, i), sizes, existing_out=acc)

        acc = lax.fori_loop(0, reps, rep, jnp.zeros((e, k, n), jnp.float32))
        return acc.reshape(e * k, n).astype(x.dtype)

    return (
        (forward, (reps * rows, k), (e * k, n)),
        (input_grad, (reps * rows, n), (e * k, n)),
        (weight_grad, (reps * rows, k), (reps * rows, n)),
    )


def cache_mib() -> float:
    """The last-level cache each core of this machine has, MiB: its size over the CPUs
    that share it (Linux's /sys; 0 where it says nothing). A device's program runs on
    one core at a time, so this is the cache its arrays can stay in."""
    base = Path("/sys/devices/system/cpu/cpu0/cache")
    levels = []
    for index in sorted(base.glob("index*")):
        try:
            kind = (index / "type").read_text().strip()
            level = int((index / "level").read_text())
            size = (index / "size").read_text().strip()
            shared = (index / "shared_cpu_list").read_text().strip()
        except (OSError, ValueError):
            continue
        scale = {"K": 1 / 1024, "M": 1.0}.get(size[-1:])
        if kind == "Instruction" or scale is None:
            continue
        cpus = sum(
            int(b) - int(a) + 1 if "-" in part else 1
            for part in shared.split(",")
            for a, _, b in [part.partition("-")]
        )
        levels.append((level, int(size[:-1]) * scale / cpus))
    return max(levels)[1] if levels else 0.0


def point_call_bytes(tile: int, experts: int, k: int, n: int) -> float:
    """The bytes of a gmm point's float32 call, laid out by `gmm_layout`
    (`selector.timing.gmm_call_bytes`)."""
    from selector.timing import gmm_call_bytes

    return gmm_call_bytes(gmm_layout(tile, experts)[1], experts, k, n, 4)


def gmm_experts(tile: int, k: int, n: int, cache: float, most: int = GMM_EXPERTS) -> int:
    """Experts of a gmm curve point: the most of `most`, `most` / 2, ... 1 whose call
    (`point_call_bytes`) fits in `cache` MiB, so the curve times visits whose arrays
    stay in the cache (`gmm_streaming` measures what a call that does not fit adds)."""
    experts = most
    while experts > 1 and point_call_bytes(tile, experts, k, n) > cache * 2**20:
        experts //= 2
    return experts


def _dims(shape: str) -> tuple[int, ...]:
    """(tile, K, N) of a gmm point's "TILExKxN"."""
    return tuple(int(d) for d in shape.split("x"))


def gmm_visits(tile: int, experts: int = GMM_EXPERTS) -> tuple[int, int]:
    """(rows of the tile tiled_gmm visits, visits) at the point `gmm_layout(tile)` lays
    out: the tile plan the count walks, so a point is credited with what the kernel ran."""
    from selector.tiles import tiled_gmm_visits

    each, rows = gmm_layout(tile, experts)
    tiles = tiled_gmm_visits([each] * experts, rows).tiles
    if len(tiles) != 1:
        raise ValueError(f"{experts} experts of {each} rows visit tiles of several sizes: {tiles}")
    return tiles[0]


# A gmm point's long program runs GMM_REPS + 1 calls in a loop, its short one 1: a
# visit's time is the difference over GMM_REPS calls' visits, as the matmul curve
# takes a trip's.
GMM_REPS = 4
GMM_PASSES = ("forward", "input_grad", "weight_grad")


def visit_seconds(tile, experts, k, n, dtype="float32", rounds=ROUNDS) -> dict[str, float]:
    """{pass: seconds a visit} of a call of `experts` experts of one tile each
    (`gmm_layout`): GMM_REPS + 1 calls in a loop less 1 call, over the visits of
    GMM_REPS calls, each program timed `rounds` times."""
    visits = gmm_visits(tile, experts)[1]
    seconds = {}
    for name, long, short in zip(
        GMM_PASSES,
        _gmm_passes(tile, experts, k, n, GMM_REPS + 1),
        _gmm_passes(tile, experts, k, n, 1),
        strict=True,
    ):
        many, one = (
            _timed(*_flat(_program(body, *shapes, dtype=dtype)), rounds=rounds)
            for body, *shapes in (long, short)
        )
        seconds[name] = max(many - one, 1e-9) / (GMM_REPS * visits)
    return seconds


def gmm_curve(tiles=GMM_TILES, kn_list=GMM_KN, dtype="float32", cache=None) -> list[dict]:
    """Per tile size, the FLOP rate of a tiled_gmm (layers.grouped_matmul) tile visit,
    for each of its three passes (forward with one weight, input gradient, weight
    gradient) over GMM_EXPERTS experts of one tile each (`gmm_layout`), fewer where
    their call would not fit in `cache` MiB (this machine's, `cache_mib`;
    `gmm_experts`): what a call
    adds inside a loop of calls (GMM_REPS + 1 calls less 1), over its visits, as an
    exchange's slots and a block's passes run. A program's first ops are not in it; a
    visit's loop-body ops are (the count leaves those to this curve:
    `selector.timing.Work.tile_visit_ops`). The point's `tflops` is the forward's,
    `passes` holds each pass's (`pass_curve` makes a curve of one): a weight
    gradient's visit runs at about half a forward's. (Until 2026-12-06 a point was one
    call less an empty program's, its rate the median of the three passes: a forward
    visit ran 1.3 to 1.5 times faster inside a loop of calls.)"""
    cache = cache_mib() if cache is None else cache
    out = []
    for tile in tiles:
        for k, n in kn_list:
            experts = gmm_experts(tile, k, n, cache) if cache else GMM_EXPERTS
            visited = gmm_visits(tile, experts)[0]
            seconds = visit_seconds(tile, experts, k, n, dtype)
            flops = 2 * visited * k * n
            out.append(
                {
                    "shape": f"{visited}x{k}x{n}",
                    "experts": experts,
                    "call_mb": point_call_bytes(tile, experts, k, n) / 1e6,
                    "mflops": flops / 1e6,
                    "tflops": flops / seconds["forward"] / 1e12,
                    "passes": {p: flops / s / 1e12 for p, s in seconds.items()},
                }
            )
    return sorted(out, key=lambda r: r["mflops"])


# (tile, K, N, experts a call): shapes off the picks' sets, each with three calls that
# fit in this machine's 16 MiB a core (1 to 6 MB) and two that do not (35 to 50 MB).
GMM_STREAM_SHAPES = (
    (256, 176, 352, (2, 4, 8, 48, 64)),
    (256, 80, 160, (4, 8, 16, 128, 160)),
    (128, 112, 224, (4, 8, 16, 128, 176)),
)
GMM_STREAM_ROUNDS = 7


def gmm_streaming(cache: float, shapes=GMM_STREAM_SHAPES) -> list[dict]:
    """Each of tiled_gmm's passes, its time a tile visit (the gmm curve's method,
    `_gmm_passes`) as a call holds more experts of one tile each: a visit's FLOPs stay
    the same and only the call's bytes (`selector.timing.gmm_call_bytes`) grow, past
    `cache` MiB. `gmm_streaming_rate` reads the rate off these rows."""
    from selector.timing import gmm_visit_bytes

    rows = []
    for tile, k, n, counts in shapes:
        for experts in counts:
            visited = gmm_visits(tile, experts)[0]
            seconds = visit_seconds(tile, experts, k, n, rounds=GMM_STREAM_ROUNDS)
            ms = {name: s * 1e3 for name, s in seconds.items()}
            rows.append(
                {
                    "shape": f"{visited}x{k}x{n}",
                    "experts": experts,
                    "call_mb": point_call_bytes(tile, experts, k, n) / 1e6,
                    "visit_mb": gmm_visit_bytes(visited, k, n, 4) / 1e6,
                    "cache_mib": cache,
                    "ms_a_visit": ms,
                }
            )
            print(rows[-1], flush=True)
    return rows


def gmm_streaming_rate(rows: list[dict]) -> float:
    """GB/s a visit streams at in a call that does not fit in the cache: per shape and
    pass, the bytes a visit moves over the difference between the median visit of the
    calls over twice the cache and of those under half of it; the median over shapes
    and passes."""
    rates = []
    for shape in dict.fromkeys(r["shape"] for r in rows):
        of = [r for r in rows if r["shape"] == shape]
        cache = of[0]["cache_mib"] * 2**20 / 1e6  # MB
        fits = [r["ms_a_visit"] for r in of if r["call_mb"] <= cache / 2]
        streams = [r["ms_a_visit"] for r in of if r["call_mb"] >= 2 * cache]
        for name in GMM_PASSES:
            more = median([m[name] for m in streams]) - median([m[name] for m in fits])
            rates.append(of[0]["visit_mb"] / max(more, 1e-9))  # MB/ms = GB/s
    return median(rates)


EINSUM_SHAPES = ((8, 256, 64, 128), (8, 1024, 192, 384), (8, 2048, 640, 1280), (32, 512, 192, 384))


def einsum_curve(shapes=EINSUM_SHAPES, dtype="float32") -> list[dict]:
    """The FLOP rate of the dense and capacity paths' batched einsums: every token through
    every expert, "tm,emh->teh" over (experts, tokens, K, N) shapes; per einsum less a call."""
    import jax.numpy as jnp

    called = call()
    out = []
    for e, t, k, n in shapes:

        def body(x, w, e=e, t=t, k=k, n=n):
            return jnp.einsum("tm,emh->teh", x, w.reshape(e, k, n)).reshape(t, -1)

        fn, args = _program(body, (t, k), (e * k, n), dtype=dtype)
        seconds = max(_timed(fn, *args) - called, 1e-9)
        flops = 2 * e * t * k * n
        out.append(
            {"shape": f"{e}x{t}x{k}x{n}", "mflops": flops / 1e6, "tflops": flops / seconds / 1e12}
        )
    return sorted(out, key=lambda r: r["mflops"])


def memory() -> float:
    size = 1 << 22

    def chain(n):
        def body(x):
            for _ in range(n):
                x = x * 1.0001 + 0.5
            return x

        return body

    # Each op of the chain is its own pass only if XLA does not fuse them: it does, so
    # the chain is one fused loop reading and writing once; time one such op.
    fn, args = _program(chain(1), (size,))
    return 2 * 4 * size / max(_timed(fn, *args) - call(), 1e-9) / 1e9


def gather(rows: int = 8192) -> tuple[float, dict]:
    """(GB/s, {kind: GB/s}) of a row gather and a row scatter-add over `rows` x 128 float32."""
    import jax.numpy as jnp

    width = 128

    # Each op reads the rows the last one wrote, so XLA cannot fold two gathers into one.
    def takes(n):
        def body(x, key):
            order = jnp.argsort(key[:, 0])
            for _ in range(n):
                x = x + jnp.take(x, order, axis=0)
            return x

        return body

    def scatters(n):
        def body(x, key):
            order = jnp.argsort(key[:, 0])
            for _ in range(n):
                x = x + jnp.zeros_like(x).at[order].add(x)
            return x

        return body

    got = {}
    for name, make in (("gather", takes), ("scatter_add", scatters)):
        seconds = _per_op(make, [(rows, width), (rows, 1)], 5)
        got[name] = rows * width * 4 / max(seconds, 1e-9) / 1e9
    return median(list(got.values())), got


def collectives() -> tuple[float, float, list[dict]]:
    """(latency s, bandwidth bytes/s, rows): a line per collective kind through its sizes."""
    import jax
    import numpy as np
    from jax import lax

    n = len(jax.devices())

    def all_to_all(x):
        return lax.all_to_all(x.reshape(n, -1, 128), "d", 0, 0, tiled=True).reshape(-1, 128)

    kinds = {  # (one op, bytes a device sends for `rows` rows of its array)
        "all_to_all": (all_to_all, lambda rows: rows * 128 * 4 * (1 - 1 / n)),
        "all_gather": (
            lambda x: lax.all_gather(x, "d", tiled=True)[: x.shape[0]] * 0.5,
            lambda rows: rows * 128 * 4 * (n - 1),
        ),
        "psum": (lambda x: lax.psum(x, "d") * 0.125, lambda rows: 2 * rows * 128 * 4 * (1 - 1 / n)),
    }
    fits, out = [], []
    for name, (op, sent) in kinds.items():
        xs, ys = [], []
        for rows in COLLECTIVE_ROWS:
            rows = rows // n * n if name == "all_to_all" else rows

            def chain(length, op=op):
                def body(x):
                    for _ in range(length):
                        x = op(x)
                    return x

                return body

            seconds = _per_op(chain, [(rows, 128)], 5)
            xs.append(sent(rows))
            ys.append(seconds)
            out.append({"collective": name, "bytes": sent(rows), "ms": seconds * 1e3})
        # time = a + bytes / bw, least squares relative to each time
        design = np.array([[1.0, x] for x in xs]) / np.array(ys)[:, None]
        (latency, per_byte), *_ = np.linalg.lstsq(design, np.ones(len(xs)), rcond=None)
        fits.append((max(latency, 0.0), 1 / per_byte))
        out.append(
            {
                "collective": f"{name} (line)",
                "latency_us": latency * 1e6,
                "gbps": 1 / per_byte / 1e9,
            }
        )
    return median([f[0] for f in fits]), median([f[1] for f in fits]), out


def relayouts() -> tuple[float, float, list[dict]]:
    """(relayout GB/s, transpose GB/s, rows): what gathering a matrix along its middle or
    minor dim costs beyond gathering it along its major dim, and the same for a
    reduce-scatter, as bytes the copy reads and writes per second."""
    import jax
    from jax import lax

    n = len(jax.devices())
    rows, rates = [], {1: [], 2: []}
    for full in RELAYOUT_SHAPES:
        for kind in ("all_gather", "reduce_scatter"):
            seconds = {}
            for dim in (0, 1, 2):
                if kind == "all_gather":
                    shape = tuple(s // n if d == dim else s for d, s in enumerate(full))

                    def body(x, dim=dim):
                        return lax.all_gather(x, "d", axis=dim, tiled=True) * 0.5

                else:
                    shape = full

                    def body(x, dim=dim):
                        return lax.psum_scatter(x, "d", scatter_dimension=dim, tiled=True) * 0.5

                seconds[dim] = _timed(*_flat(_program(body, shape)))
            moved = 2 * 4 * full[0] * full[1] * full[2]
            for dim in (1, 2):
                rate = moved / max(seconds[dim] - seconds[0], 1e-9) / 1e9
                rates[dim].append(rate)
                rows.append(
                    {
                        "collective": kind,
                        "shape": "x".join(map(str, full)),
                        "dim": dim,
                        "ms_more": (seconds[dim] - seconds[0]) * 1e3,
                        "gbps": rate,
                    }
                )
    return median(rates[1]), median(rates[2]), rows


def activation_copies(shapes=ACTIVATION_COPY_SHAPES) -> tuple[float, float, list[dict]]:
    """(relayout GB/s, transpose GB/s, rows): what writing a (T, E, H) activation in
    another layout costs beyond writing it in place, for an elementwise pass that keeps
    the minor dim ((E, T, H)) and one that changes it ((E, H, T)), as bytes the copy
    reads and writes per second."""
    import jax.numpy as jnp

    rows, rates = [], {"keep": [], "change": []}
    for t, e, h in shapes:
        order = {"in place": (0, 1, 2), "keep": (1, 0, 2), "change": (1, 2, 0)}
        seconds = {}
        for name, axes in order.items():

            def body(x, t=t, e=e, h=h, axes=axes):
                y = jnp.transpose(x.reshape(t, e, h), axes) * 1.0001 + 0.5
                return y.reshape(t, e * h)

            seconds[name] = _timed(*_flat(_program(body, (t, e * h))))
        moved = 2 * 4 * t * e * h
        for name in ("keep", "change"):
            rate = moved / max(seconds[name] - seconds["in place"], 1e-9) / 1e9
            rates[name].append(rate)
            rows.append(
                {
                    "shape": f"{t}x{e}x{h}",
                    "minor_dim": name,
                    "ms_more": (seconds[name] - seconds["in place"]) * 1e3,
                    "gbps": rate,
                }
            )
    return median(rates["keep"]), median(rates["change"]), rows


# (E, M, H, rows an expert) of the weight-gather study: off the picks' judge and dev sets.
WEIGHT_GATHER_SHAPES = (
    (32, 128, 256, 16),
    (96, 128, 256, 4),
    (48, 160, 320, 8),
    (16, 256, 512, 32),
)


def weight_gathers(constants: dict) -> list[dict]:
    """What gathering the three routed matrices costs where a per-expert loop of dots
    consumes them, as the gathered block does: (E, M, H) gate and up matrices sharded
    over the 8 devices along M, the (E, H, M) out matrix along its minor dim, each
    gathered whole and sliced per expert by the loop; less the same program with every
    device holding its own whole copy (no collective). Forward alone, and with the
    weights' gradient (gathers in, reduce-scatters out). Beside it, what the time
    counted without the in-place rates prices the same gathers at: the bytes received
    over ICI plus the relayout and transpose copies (`selector.timing`), at
    `constants`."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax import lax
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    n = len(jax.devices())
    mesh = Mesh(np.asarray(jax.devices()), ("d",))

    def seconds(E, M, H, rows, sharded, train):
        def body(w1, w2, w3, x):
            if sharded:
                w1 = lax.all_gather(w1, "d", axis=1, tiled=True)
                w2 = lax.all_gather(w2, "d", axis=1, tiled=True)
                w3 = lax.all_gather(w3, "d", axis=2, tiled=True)
            x_ERM = x.reshape(E, rows, M)

            def expert(e, out):
                h = jax.nn.silu(x_ERM[e] @ w1[e]) * (x_ERM[e] @ w2[e])
                return out.at[e].set(h @ w3[e])

            return lax.fori_loop(0, E, expert, jnp.zeros_like(x_ERM)).reshape(x.shape)

        specs = (P(None, "d"), P(None, "d"), P(None, None, "d")) if sharded else (P("d"),) * 3
        block = jax.shard_map(body, mesh=mesh, in_specs=(*specs, P("d")), out_specs=P("d"))
        if train:
            loss = lambda *a: jnp.sum(block(*a) ** 2)  # noqa: E731
            fn = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
        else:
            fn = jax.jit(block)
        key = jax.random.key(0)
        copies = 1 if sharded else n  # whole: each device its own copy
        shapes = ((E * copies, M, H), (E * copies, M, H), (E * copies, H, M))
        weights = [
            jax.device_put(jax.random.normal(key, s) * 0.1, NamedSharding(mesh, spec))
            for s, spec in zip(shapes, specs, strict=True)
        ]
        x = jax.device_put(jax.random.normal(key, (n * E * rows, M)), NamedSharding(mesh, P("d")))
        return _timed(fn, *weights, x)

    from selector.config import Hardware
    from selector.timing import Work, price

    rates = Hardware(
        ici_bandwidth_gbps=constants["ici_bandwidth_gbps"],
        relayout_gbps=constants["relayout_gbps"],
        transpose_gbps=constants["transpose_gbps"],
    )
    out = []
    for E, M, H, rows in WEIGHT_GATHER_SHAPES:
        matrix = E * M * H * 4
        received = 3 * matrix * (1 - 1 / n)
        for train in (False, True):
            more = seconds(E, M, H, rows, True, train) - seconds(E, M, H, rows, False, train)
            trips = 2 if train else 1  # gathered in; the gradient reduce-scattered out
            # The gate and up matrices relaid, the out matrix transposed, each read and
            # written once a trip (as `selector.timing.count_work` counts them).
            gathers = Work(
                dots=(),
                memory_bytes=0.0,
                gather_bytes=0.0,
                collectives=0,
                ici_bytes=trips * received,
                dcn_bytes=0.0,
                ops=0,
                loop_trips=0,
                relayout_bytes=trips * 2 * 2 * matrix,
                transpose_bytes=trips * 2 * matrix,
            )
            counted = price(gathers, rates).total
            out.append(
                {
                    "shape": f"{E}x{M}x{H}",
                    "rows_an_expert": rows,
                    "mode": "train" if train else "forward",
                    "matrix_mb": matrix / 1e6,
                    "received_mb": received / 1e6,
                    "ms_more": more * 1e3,
                    "counted_ms": counted * 1e3,
                    "measured_over_counted": more / counted,
                }
            )
            print(out[-1], flush=True)
    return out


def weight_gather_rates(rows: list[dict]) -> dict:
    """The in-place rates from `weight_gathers`' rows, bytes a device receives per
    second: the forward's gathers (its time more), the backward's reduce-scatters (the
    training time more less the forward's); the median over the shapes."""
    gather, scatter = [], []
    for forward, train in zip(rows[::2], rows[1::2], strict=True):
        received = forward["received_mb"] * 1e6
        gather.append(received / (forward["ms_more"] * 1e-3) / 1e9)
        scatter.append(received / max((train["ms_more"] - forward["ms_more"]) * 1e-3, 1e-9) / 1e9)
    return {"weight_gather_gbps": median(gather), "weight_scatter_gbps": median(scatter)}


def loop_trip(launch_s: float) -> float:
    from jax import lax

    def loop(trips):
        def body(x):
            return lax.fori_loop(0, trips, lambda i, y: y @ x, x)

        return body

    long, short = (_timed(*_flat(_program(loop(t), (4, 4)))) for t in (1001, 1))
    return max((long - short) / 1000 - launch_s, 0.0)


def measure() -> dict:
    launch_s = launch()
    latency, bandwidth, collective_rows = collectives()
    gbps_gather, gathers = gather()
    relayout, transpose, relayout_rows = relayouts()
    constants = {
        "call_us": call() * 1e6,
        "launch_us": launch_s * 1e6,
        "loop_trip_us": loop_trip(launch_s) * 1e6,
        "hbm_bandwidth_gbps": memory(),
        "gather_gbps": gbps_gather,
        "ici_bandwidth_gbps": bandwidth / 1e9,
        "collective_latency_us": latency * 1e6,
        "relayout_gbps": relayout,
        "transpose_gbps": transpose,
    }
    gathered = weight_gathers(constants)
    constants.update(weight_gather_rates(gathered))
    keep, change, copy_rows = activation_copies()
    constants.update(activation_relayout_gbps=keep, activation_transpose_gbps=change)
    cache = cache_mib()
    streaming = gmm_streaming(cache)
    constants.update(cache_mib=cache, gmm_streamed_gbps=gmm_streaming_rate(streaming))
    curve = matmul_curve()
    return {
        "machine": machine(),
        "rounds": ROUNDS,
        "constants": constants,
        "matmul_curve": curve,
        "gmm_curve": gmm_curve(cache=cache),
        "gmm_streaming": streaming,
        "einsum_curve": einsum_curve(),
        "gathers": gathers,
        "collectives": collective_rows,
        "relayouts": relayout_rows,
        "weight_gathers": gathered,
        "activation_copies": copy_rows,
    }


# The gradient passes' curves conf/hardware holds beside the forward's `gmm_curve`.
GMM_PASS_CURVES = {"gmm_input_grad_curve": "input_grad", "gmm_weight_grad_curve": "weight_grad"}


def pass_curve(curve: list[dict], name: str) -> list[dict]:
    """The gmm curve of one of tiled_gmm's passes (GMM_PASSES), from its points'
    `passes`; a point measured before the passes were kept apart has none."""
    return [
        {"shape": p["shape"], "mflops": p["mflops"], "tflops": p["passes"][name]}
        for p in curve
        if "passes" in p
    ]


def curve_point(row: dict) -> list[float]:
    """A curve row as conf/hardware's point: [MFLOPs a dot, TFLOP/s], and the K x N
    elements of its matrix where its shape names one ("ROWSxKxN")."""
    dims = _dims(row["shape"]) if row["shape"].count("x") == 2 else ()
    return [row["mflops"], row["tflops"], *([dims[1] * dims[2]] if dims else [])]


def curve_yaml(name: str, curve: list[dict]) -> str:
    """A curve as conf/hardware's `{name}:` list of points (`curve_point`)."""

    def num(x: float) -> str:  # a float OmegaConf reads as one (3355.0, not 3355)
        return repr(float(f"{x:.4g}"))

    def point(p: dict) -> str:  # the matrix's elements exact
        mflops, tflops, *matrix = curve_point(p)
        return f"[{', '.join([num(mflops), num(tflops), *(repr(float(m)) for m in matrix)])}]"

    points = ", ".join(point(p) for p in curve)
    return f"{name}: [{points}]"


def write_hardware(payload: dict) -> None:
    """Set the measured constants in conf/hardware/cpu.yaml, keeping its other lines."""
    text = HARDWARE_FILE.read_text()
    lines = [f"{k}: {float(f'{v:.4g}')!r}" for k, v in payload["constants"].items()]
    lines += [curve_yaml(name, payload[name]) for name in CURVES]
    lines += [
        curve_yaml(name, pass_curve(payload["gmm_curve"], grad))
        for name, grad in GMM_PASS_CURVES.items()
    ]
    for line in lines:
        name = line.split(":", 1)[0]
        text, found = re.subn(rf"^{name}: .*$", line, text, flags=re.M)
        if not found:
            text += line + "\n"
    HARDWARE_FILE.write_text(text)
    print("wrote", HARDWARE_FILE)


def merge_gmm_points(payload: dict, fresh: list[dict]) -> None:
    """Put `fresh` gmm curve points in the stored study, each in place of the stored
    point of its shape."""
    named = {p["shape"] for p in fresh}
    kept = [p for p in payload["gmm_curve"] if p["shape"] not in named]
    payload["gmm_curve"] = sorted(kept + fresh, key=lambda r: r["mflops"])


def plot(payload: dict):
    plt = pyplot()
    gathers = payload.get("weight_gathers", [])
    streaming = payload.get("gmm_streaming", [])
    panels = 2 + bool(gathers) + bool(streaming)
    fig, axes = plt.subplots(1, panels, figsize=(5 * panels, 4))
    left, right = axes[0], axes[1]
    if streaming:
        ax = axes[-1]
        for shape in dict.fromkeys(r["shape"] for r in streaming):
            pts = [r for r in streaming if r["shape"] == shape]
            ax.plot(
                [r["call_mb"] for r in pts],
                [r["ms_a_visit"]["forward"] / pts[0]["ms_a_visit"]["forward"] for r in pts],
                "o-",
                label=shape,
            )
        ax.axvline(streaming[0]["cache_mib"] * 2**20 / 1e6, color="grey", lw=0.8)
        ax.set(
            xscale="log",
            xlabel="MB a tiled_gmm call works over",
            ylabel="forward visit / the fewest experts'",
            title="a visit past the cache (grey)",
        )
        ax.legend(fontsize=7)
    curves = {name: payload[name] for name in CURVES}
    curves |= {n: pass_curve(payload["gmm_curve"], g) for n, g in GMM_PASS_CURVES.items()}
    for name, curve in curves.items():
        left.plot(
            [p["mflops"] for p in curve], [p["tflops"] * 1e3 for p in curve], "o-", label=name
        )
    left.set(
        xscale="log",
        xlabel="MFLOPs a dot",
        ylabel="GFLOP/s a device (8 at once)",
        title="float32 dots: in a tile loop, tiled_gmm's passes, batched einsums",
    )
    left.legend(fontsize=7)
    for name in ("all_to_all", "all_gather", "psum"):
        pts = [r for r in payload["collectives"] if r["collective"] == name]
        right.plot([p["bytes"] / 1e6 for p in pts], [p["ms"] for p in pts], "o-", label=name)
    right.set(
        xscale="log",
        yscale="log",
        xlabel="MB a device sends",
        ylabel="ms a collective",
        title="collectives over 8 devices",
    )
    right.legend()
    if gathers:
        for mode, marker in (("forward", "o"), ("train", "s")):
            pts = [r for r in gathers if r["mode"] == mode]
            axes[2].plot(
                [r["matrix_mb"] for r in pts],
                [r["measured_over_counted"] for r in pts],
                marker,
                label=mode,
            )
        axes[2].axhline(1.0, color="grey", lw=0.8)
        axes[2].set(
            xlabel="MB a routed matrix (float32)",
            ylabel="in place / ICI + relayout rates",
            title="the routed weights' gathers, measured in place",
        )
        axes[2].legend()
    fig.tight_layout()
    return fig


def main() -> int:
    args = arguments(
        STUDY,
        __doc__,
        plot,
        write={"action": "store_true", "help": "store the constants in conf/hardware/cpu.yaml"},
        relayouts={
            "action": "store_true",
            "help": "measure only the relayout and transpose rates, into the stored study",
        },
        gmm={
            "action": "store_true",
            "help": "measure only the gmm curve, into the stored study",
        },
        weight_gathers={
            "action": "store_true",
            "help": "measure only the routed weights' gathers in place, into the stored study",
        },
        gmm_streaming={
            "action": "store_true",
            "help": "measure only what a tile visit streams past the cache, and the gmm"
            " curve's points whose call would not fit in it, into the stored study",
        },
        activation_copies={
            "action": "store_true",
            "help": "measure only the activation relayout and transpose rates, into the stored study",
        },
        gmm_tiles={
            "type": lambda text: tuple(int(t) for t in text.split(",")),
            "default": GMM_TILES,
            "help": "with --gmm: only these tiles (e.g. 32), their points replacing the stored ones",
        },
    )
    if args is None:
        return 0
    if args.relayouts:
        payload = load(STUDY)
        relayout, transpose, payload["relayouts"] = relayouts()
        payload["constants"].update(relayout_gbps=relayout, transpose_gbps=transpose)
        payload["relayouts_machine"] = machine()
    elif args.activation_copies:
        payload = load(STUDY)
        keep, change, payload["activation_copies"] = activation_copies()
        payload["constants"].update(activation_relayout_gbps=keep, activation_transpose_gbps=change)
        payload["activation_copies_machine"] = machine()
    elif args.gmm_streaming:
        payload = load(STUDY)
        cache = cache_mib()
        payload["gmm_streaming"] = gmm_streaming(cache)
        payload["constants"].update(
            cache_mib=cache, gmm_streamed_gbps=gmm_streaming_rate(payload["gmm_streaming"])
        )
        payload["gmm_streaming_machine"] = machine()
        # The curve's points measured at more experts than now fit, measured again.
        stale = [
            p
            for p in payload["gmm_curve"]
            if p.get("experts", GMM_EXPERTS) != gmm_experts(*_dims(p["shape"]), cache)
        ]
        kn = sorted({_dims(p["shape"])[1:] for p in stale})
        merge_gmm_points(payload, gmm_curve(GMM_TILES, kn, cache=cache))
        payload.setdefault("gmm_runs", []).append(
            {"kn": [list(x) for x in kn], "cache_mib": cache, "machine": machine()}
        )
    elif args.weight_gathers:
        payload = load(STUDY)
        rows = weight_gathers(payload["constants"])
        payload["weight_gathers"] = rows
        payload["weight_gathers_machine"] = machine()
        payload["constants"].update(weight_gather_rates(rows))
    elif args.gmm:
        payload = load(STUDY)
        merge_gmm_points(payload, gmm_curve(args.gmm_tiles))
        if set(args.gmm_tiles) >= set(GMM_TILES):
            payload["gmm_machine"] = machine()
        else:  # the points measured apart from the rest of the curve
            payload.setdefault("gmm_runs", []).append(
                {"tiles": list(args.gmm_tiles), "machine": machine()}
            )
    else:
        payload = measure()
    print(
        table([{k: f"{v:.4g}" for k, v in payload["constants"].items()}], [(k, k) for k in SCALARS])
    )
    for name in CURVES:
        print(name)
        print(table(payload[name], [("shape", "dot"), ("mflops", "MFLOP"), ("tflops", "TFLOP/s")]))
    print("wrote", *save(STUDY, payload, plot(payload)))
    if args.write:
        write_hardware(payload)
    return 0


if __name__ == "__main__":
    sys.exit(main())
