"""Composing a config: Hydra's whole compose against `selector.compose`, which keeps
Hydra's compose of the presets chosen and applies every other override to a copy with
Hydra's own function.

The configs are the README's and guides' launches, each at cp 1, 2, 4 and 8: the same
presets with other keys, as a script, a search or a test suite composes them. Each is
composed once by each path before timing (the first `selector.compose` of a preset set
is Hydra's whole compose, kept); then every round composes each config by both paths
in alternation, so a slow spell of the machine hits both alike. Times are medians over
the rounds; the ratio is of the medians of one run.

    python -m bench.compose
    python -m bench.compose --check   # both paths compose the stored configs alike

`--check` composes the stored configs again by both paths and compares the typed
configs; it does not time them (a time stored on one machine is not reproduced on
another).
"""

from __future__ import annotations

import time
from importlib import metadata

from bench.common import arguments, load, machine, median, pyplot, save, table, use_cpu_devices

LAUNCHES = (
    ("model=tiny", "mesh=cpu_8"),
    ("model=qwen3_next_80b_a3b", "hardware=v5p", "num_devices=64", "max_target_length=8192"),
    ("model=deepseek_v3", "mesh=v5p_128", "hardware=v5p", "per_device_batch_size=0.5"),
    ("model=mixtral_8x7b", "mesh=h200_8", "hardware=h200", "ici_fsdp_parallelism=-1"),
)
CONFIGS = tuple(
    (*launch, f"ici_context_parallelism={cp}") for launch in LAUNCHES for cp in (1, 2, 4, 8)
)
COLUMNS = [
    ("config", "config"),
    ("hydra_ms", "Hydra's whole compose, ms"),
    ("kept_ms", "selector.compose, ms"),
    ("ratio", "Hydra / kept"),
]


def _paths():
    import selector
    from selector.compose import _hydra_compose

    return {"hydra": lambda o: _hydra_compose(tuple(o)), "kept": selector.compose}


def timed(rounds: int) -> list[dict]:
    """Each config's median seconds by each path over `rounds` alternating rounds."""
    paths = _paths()
    for overrides in CONFIGS:  # the kept path's first compose of a preset set is Hydra's
        for compose in paths.values():
            compose(overrides)
    times = {(c, p): [] for c in CONFIGS for p in paths}
    for r in range(rounds):
        order = list(paths) if r % 2 == 0 else list(paths)[::-1]
        for overrides in CONFIGS:
            for path in order:
                start = time.perf_counter()
                paths[path](overrides)
                times[(overrides, path)].append(time.perf_counter() - start)
    rows = []
    for overrides in CONFIGS:
        hydra, kept = (median(times[(overrides, p)]) for p in ("hydra", "kept"))
        rows.append(
            {
                "config": " ".join(overrides),
                "hydra_ms": hydra * 1e3,
                "kept_ms": kept * 1e3,
                "ratio": hydra / kept,
            }
        )
    return rows


def check() -> int:
    """0 when the stored configs are today's and both paths compose each alike."""
    import selector

    stored = [r["config"] for r in load("compose")["rows"]]
    today = [" ".join(c) for c in CONFIGS]
    if stored != today:
        print(
            "bench.compose --check: compose.json holds other configs; run python -m bench.compose"
        )
        return 1
    paths = _paths()
    differ = [
        " ".join(c)
        for c in CONFIGS
        if selector.to_config(paths["hydra"](c)) != selector.to_config(paths["kept"](c))
    ]
    if differ:
        print("bench.compose --check: the paths compose differently: " + "; ".join(differ))
        return 1
    print(f"bench.compose --check: {len(today)} config(s) agree with compose.json (composed alike)")
    return 0


def plot(payload: dict):
    rows = payload["rows"]
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(10, 4))
    xs = range(len(rows))
    ax.bar([x - 0.2 for x in xs], [r["hydra_ms"] for r in rows], 0.4, label="Hydra's whole compose")
    ax.bar([x + 0.2 for x in xs], [r["kept_ms"] for r in rows], 0.4, label="selector.compose")
    ax.set_xticks(
        list(xs),
        [
            r["config"].split()[0].removeprefix("model=") + " " + r["config"].split("=")[-1]
            for r in rows
        ],
        rotation=70,
        fontsize=7,
    )
    ax.set_ylabel("ms a compose (median)")
    ax.set_title(f"Composing a config, {payload['rounds']} rounds; x: model, cp")
    ax.legend()
    fig.tight_layout()
    return fig


def main() -> None:
    check_flag = {"action": "store_true", "help": "compose the stored configs by both paths"}
    args = arguments("compose", __doc__, plot, rounds={"type": int, "default": 9}, check=check_flag)
    if args is None:
        return
    if args.check:
        raise SystemExit(check())
    use_cpu_devices(1)  # the machine's record only: nothing here runs on a device
    rows = timed(args.rounds)
    print(table(rows, COLUMNS))
    payload = {
        "machine": machine(),
        "hydra_core": metadata.version("hydra-core"),
        "rounds": args.rounds,
        "rows": rows,
        "summary": {
            "hydra_ms_median": median([r["hydra_ms"] for r in rows]),
            "kept_ms_median": median([r["kept_ms"] for r in rows]),
            "ratio_median": median([r["ratio"] for r in rows]),
        },
    }
    print(payload["summary"])
    print("wrote", *save("compose", payload, plot(payload)))


if __name__ == "__main__":
    main()
