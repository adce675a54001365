"""The temp XLA:TPU's memory analysis reports beyond what its buffer assignment allocates.

The whole step's estimate counts the buffers a program holds; on XLA:TPU the compiled
step's `temp_size_in_bytes` is larger than the heap its buffer assignment lays out
(`--xla_dump_to`), by an amount no buffer in the dump names (docs/results/whole-step.md).
This study isolates what that amount follows, with small programs compiled ahead of time
for 64 abstract v5p chips (fsdp=64; nothing runs on a TPU), and with this project's own
Mixtral step at two layer counts:

- `gather[:E]`: one expert matrix (bf16 [E, 4096, 14336], E=8 unless given, fsdp-sharded)
  gathered and used in a matmul; `swiglu`: three of them, as an MoE layer's forward does;
- `split:D[:N[:G]]`: a bf16 [64, 512, 14336] matrix (896 MiB) split over fsdp along dim D
  (0, 1 or 2), gathered whole into a matmul, on N chips (64 unless given) of which G
  (all unless given) form the fsdp axis, the rest a data axis; `shmap:D[:N[:G]]`
  the same gathered by `jax.lax.all_gather` inside a shard_map, as the layers do;
  `both:D:N:G` split over both axes of that mesh at once (all N chips);
  `vocab:D`: a bf16 [151936, 2048] table (594 MiB,
  Qwen3's embedding) split along dim D (0 vocabulary, 1 embedding), gathered whole into
  the logits' matmul: which split XLA:TPU gathers by an all-reduce;
- `scan:L:MODE`: L such layers scanned, each rematerialised, fwd+bwd over 1,024 tokens;
  MODE `grad` returns the gradients, `sgd` and `adamw` update the float32 weights (and
  AdamW's moments) with the arguments donated, `adamw_kept` the same without donation;
  `scan:L:MODE:E[:N]` with E experts a layer (8 unless given), on N chips (64 unless
  given);
- `step:MODEL:CP[:L]`: `checks.step`'s whole step of a preset (bench.calibration.step_compile's point
  MODEL:CP on 64 v5p), at L layers when given.

Each point compiles in its own process with `XLA_FLAGS=--xla_dump_to`; `unnamed` is the
memory analysis' temp less the buffer assignment's temp allocations (outputs that do not
alias an argument are allocated there but are not temp).

    python -m bench.calibration.libtpu_temp
    python -m bench.calibration.libtpu_temp --points gather,scan:2:adamw
    python -m bench.calibration.libtpu_temp --replot
    python -m bench.calibration.libtpu_temp --into libtpu_temp_jax012   # another stack's rows apart
"""

from __future__ import annotations

import json
import os
import re
import sys
import tempfile
from pathlib import Path

from bench.calibration.dump_peak import allocations
from bench.common import RESULTS, arguments, paired_bars, pyplot, save, stack, table, worker_row

STUDY = "libtpu_temp"
MIB = 2**20
EXPERTS, EMB, HIDDEN, CHIPS, TOKENS = 8, 4096, 14336, 64, 1024
VOCAB = 151936  # Qwen3's
DEFAULT_POINTS = (
    "gather,gather:4,gather:2,swiglu,scan:2:grad,scan:8:grad,scan:2:sgd,scan:8:sgd,"
    "scan:2:adamw,scan:8:adamw,scan:2:adamw_kept,scan:8:adamw_kept,"
    "step:mixtral_8x7b:1:8,step:mixtral_8x7b:1,step:qwen3_30b_a3b:1"
)
COLUMNS = [
    ("point", "point"),
    ("largest_all_reduce_mib", "largest all-reduce MiB"),
    ("largest_all_gather_mib", "largest all-gather MiB"),
    ("layer_params_mib", "f32 weights a layer MiB"),
    ("temp_mib", "temp MiB (memory analysis)"),
    ("heap_mib", "temp the buffer assignment allocates"),
    ("unnamed_mib", "unnamed MiB"),
    ("alias_mib", "donated MiB"),
]


def _scan_size(point: str) -> tuple[int, int]:
    """(experts a layer, chips) of a `scan:L:MODE[:E[:N]]` point."""
    rest = point.split(":")[3:]
    return (int(rest[0]) if rest else EXPERTS), (int(rest[1]) if len(rest) > 1 else CHIPS)


def _toy(point: str):
    """(jitted function, abstract arguments) of a toy point, on 64 abstract v5p chips."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from checks.targets import devices
    from selector.targets import Target

    kind, *rest = point.split(":")
    meshed = kind in ("split", "shmap", "both")
    chips = int(rest[1]) if meshed and len(rest) > 1 else CHIPS
    if kind == "scan":
        chips = _scan_size(point)[1]
    group = int(rest[2]) if meshed and len(rest) > 2 else chips
    chip_list = np.array(devices(Target.from_hardware("v5p", chips, 1)))
    mesh = Mesh(chip_list.reshape(chips // group, group), ("data", "fsdp"))

    def spec(*s):
        return NamedSharding(mesh, P(*s))

    def whole(a):  # gathered over fsdp, in the compute dtype
        return jax.lax.with_sharding_constraint(a.astype(jnp.bfloat16), spec())

    def swiglu(h, w):
        wi_0, wi_1, wo = (whole(a) for a in w)
        a, b = (jnp.einsum("tm,emh->teh", h, wi) for wi in (wi_0, wi_1))
        return jnp.einsum("teh,ehm->tm", jax.nn.silu(a) * b, wo).astype(h.dtype) / EXPERTS

    x = jax.ShapeDtypeStruct((TOKENS, EMB), jnp.bfloat16, sharding=spec("fsdp", None))
    if meshed:  # a (64, 512, 14336) matrix, 896 MiB, split along a dim
        dim, shape = int(rest[0]), (64, 512, HIDDEN)
        where = [None, None, None]
        where[dim] = ("data", "fsdp") if kind == "both" else "fsdp"
        w = jax.ShapeDtypeStruct(shape, jnp.bfloat16, sharding=spec(*where))
        rows = P(("data", "fsdp"), None)  # the tokens over every chip
        xs = jax.ShapeDtypeStruct((TOKENS, 512), jnp.bfloat16, sharding=NamedSharding(mesh, rows))
        if kind in ("split", "both"):
            return jax.jit(lambda w, x: jnp.einsum("tm,emh->teh", x, whole(w)).sum(1)), (w, xs)

        def local(w, x):  # the layers' way: jax.lax.all_gather inside shard_map
            full = jax.lax.all_gather(w, "fsdp", axis=dim, tiled=True)
            return jnp.einsum("tm,emh->teh", x, full).sum(1)

        body = jax.shard_map(local, mesh=mesh, in_specs=(P(*where), rows), out_specs=rows)
        return jax.jit(body), (w, xs)
    if kind == "vocab":  # a (vocab, emb) table of 594 MiB split along one dim: logits
        dim = int(rest[0])
        where = [None, None]
        where[dim] = "fsdp"
        table = jax.ShapeDtypeStruct((VOCAB, 2048), jnp.bfloat16, sharding=spec(*where))
        xs = jax.ShapeDtypeStruct((TOKENS, 2048), jnp.bfloat16, sharding=spec("fsdp", None))
        return jax.jit(lambda e, x: jnp.einsum("tm,vm->tv", x, whole(e)).max(1)), (table, xs)
    if kind in ("gather", "swiglu"):
        shape = (int(rest[0]) if rest else EXPERTS, EMB, HIDDEN)
        w = jax.ShapeDtypeStruct(shape, jnp.bfloat16, sharding=spec(None, "fsdp", None))
        if kind == "gather":
            return jax.jit(lambda w, x: jnp.einsum("tm,emh->teh", x, whole(w)).sum(1)), (w, x)
        wo = jax.ShapeDtypeStruct(
            (EXPERTS, HIDDEN, EMB), jnp.bfloat16, sharding=spec(None, None, "fsdp")
        )
        return jax.jit(lambda w0, w1, wo, x: swiglu(x, (w0, w1, wo))), (w, w, wo, x)
    layers, mode = int(rest[0]), rest[1]
    experts = _scan_size(point)[0]
    in_spec, out_spec = spec(None, None, "fsdp", None), spec(None, None, None, "fsdp")
    w_in = jax.ShapeDtypeStruct((layers, experts, EMB, HIDDEN), jnp.float32, sharding=in_spec)
    w_out = jax.ShapeDtypeStruct((layers, experts, HIDDEN, EMB), jnp.float32, sharding=out_spec)
    ws = (w_in, w_in, w_out)
    w_shardings = tuple(a.sharding for a in ws)
    layer = jax.checkpoint(lambda h, w: (h + swiglu(h, w), None))

    def loss(ws, x):
        return jax.lax.scan(layer, x, ws)[0].astype(jnp.float32).sum()

    if mode == "grad":
        return jax.jit(jax.grad(loss), out_shardings=w_shardings), (ws, x)
    if mode == "sgd":

        def sgd(ws, x):
            return jax.tree.map(lambda w, g: w - 1e-4 * g, ws, jax.grad(loss)(ws, x))

        return jax.jit(sgd, out_shardings=w_shardings, donate_argnums=(0,)), (ws, x)
    opt = optax.adamw(1e-4, weight_decay=0.1, mu_dtype=jnp.float32)
    state = jax.eval_shape(opt.init, ws)
    state_shardings = jax.tree.map(
        lambda a: spec() if a.ndim == 0 else (in_spec if a.shape[-1] == HIDDEN else out_spec), state
    )
    state = jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), state, state_shardings
    )

    def step(ws, state, x):
        updates, state = opt.update(jax.grad(loss)(ws, x), state, ws)
        return optax.apply_updates(ws, updates), state

    donate = (0, 1) if mode == "adamw" else ()
    fn = jax.jit(step, out_shardings=(w_shardings, state_shardings), donate_argnums=donate)
    return fn, (ws, state, x)


def _step(model: str, cp: int, layers: int | None) -> tuple[dict, float]:
    """Compile this project's step of `model` at `cp` (bench.calibration.step_compile's point), at
    `layers` layers when given; its CompiledStep as a dict and its f32 weights a layer."""
    import selector
    from bench.calibration.step_compile import overrides
    from checks.step import compile_step

    extra = [f"base_num_decoder_layers={layers}"] if layers else []
    cfg = selector.compose([*overrides(model, cp, "tpu"), *extra])
    config = selector.to_config(cfg)
    plan, _ = selector.api.analyse_any(config)
    _, compiled = compile_step(cfg, plan, progress=lambda s: print(s, file=sys.stderr, flush=True))
    return compiled.as_dict(), compiled.params / config.base_num_decoder_layers


def largest_collective(hlo: str, op: str) -> int:
    """Bytes of the largest `op` result (all-reduce, all-gather) in an optimized HLO text."""
    sizes = {"f32": 4, "bf16": 2, "s32": 4, "u32": 4, "pred": 1}
    best = 0
    for m in re.finditer(rf"= (\w+)\[([\d,]*)\]\{{[^}}]*\}} {op}(?:-start)?\(", hlo):
        n = 1
        for d in filter(None, m.group(2).split(",")):
            n *= int(d)
        best = max(best, n * sizes.get(m.group(1), 4))
    return best


def worker(point: str, dump: Path) -> dict:
    from checks.jax_start import prepare_process

    prepare_process("tpu", CHIPS)
    if point.startswith("step:"):
        _, model, cp, *layers = point.split(":")
        compiled, layer_params = _step(model, int(cp), int(layers[0]) if layers else None)
        temp, outputs, alias = compiled["temp"], compiled["outputs"], compiled["alias"]
        module = "jit_step"
    else:
        fn, args = _toy(point)
        stats = fn.lower(*args).compile().memory_analysis()
        temp, outputs = stats.temp_size_in_bytes, stats.output_size_in_bytes
        alias = stats.alias_size_in_bytes
        layer_params = 0
        if point.startswith("scan"):  # a layer's float32 weights a device
            experts, chips = _scan_size(point)
            layer_params = 3 * experts * EMB * HIDDEN * 4 / chips
        module = ""
    files = [p for p in dump.glob("*after_optimizations-buffer-assignment.txt") if module in p.name]
    files = [p for p in files if "convert_element_type" not in p.name]
    biggest = max(files, key=lambda p: p.stat().st_size)
    heap = allocations(biggest.read_text())["temp"] - (outputs - alias)
    hlo = biggest.with_name(biggest.name.replace("-buffer-assignment", "")).read_text()
    return {
        "point": point,
        "largest_all_reduce_mib": largest_collective(hlo, "all-reduce") / MIB,
        "largest_all_gather_mib": largest_collective(hlo, "all-gather") / MIB,
        "layer_params_mib": layer_params / MIB,
        "temp_mib": temp / MIB,
        "heap_mib": heap / MIB,
        "unnamed_mib": (temp - heap) / MIB,
        "alias_mib": alias / MIB,
    }


def run_point(point: str) -> dict:
    with tempfile.TemporaryDirectory() as dump:
        env = {**os.environ, "XLA_FLAGS": f"--xla_dump_to={dump}", "JAX_PLATFORMS": "cpu"}
        cmd = [
            sys.executable,
            "-m",
            "bench.calibration.libtpu_temp",
            "--worker",
            point,
            "--dump",
            dump,
        ]
        return worker_row(point, cmd, timeout=1800, env=env)


def plot(payload: dict):
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(9, 4.5))
    rows = [r for r in payload["rows"] if "unnamed_mib" in r]
    paired_bars(
        ax,
        [r["point"] for r in rows],
        ([r["heap_mib"] for r in rows], "buffer assignment's temp"),
        ([r["unnamed_mib"] for r in rows], "temp no buffer names"),
        "MiB a device",
    )
    ax.set_title(
        "XLA:TPU temp beyond the buffer assignment (64 v5p, compiled ahead of time)\n"
        + payload.get("stack", f"jax {payload['jax']}")
    )
    ax.legend()
    return fig


def main() -> None:
    args = arguments(
        STUDY,
        __doc__,
        plot,
        points={"default": DEFAULT_POINTS},
        worker={"default": None, "help": "(internal) compile one point in this process"},
        dump={"default": None, "help": "(internal) the worker's dump folder"},
        into={"default": None, "help": f"the study's name to write (default: {STUDY})"},
    )
    if args is None:
        return
    if args.worker:
        print(json.dumps(worker(args.worker, Path(args.dump))))
        return
    # The stored rows are kept; each point compiled replaces its own row.
    name = args.into or STUDY
    stored = RESULTS / f"{name}.json"
    rows = json.loads(stored.read_text())["rows"] if stored.exists() else []
    order = DEFAULT_POINTS.split(",")
    for point in args.points.split(","):
        print(f"compiling {point} ...", flush=True)
        row = run_point(point)
        rows = [r for r in rows if r["point"] != point] + [row]
        print(table([row], COLUMNS), flush=True)
    rows.sort(key=lambda r: order.index(r["point"]) if r["point"] in order else len(order))
    import jax

    payload = {"jax": jax.__version__, "stack": stack(), "rows": rows}
    print(table(rows, COLUMNS))
    print("wrote", *save(name, payload, plot(payload)))


if __name__ == "__main__":
    main()
