"""What context parallelism saves in a whole training step, and what the inflation trap
hides: the example model's compiled train step (model, optimizer, attention and MoE),
per-device bytes, at cp = 1, 2, 4 on a (data=2, context=cp) mesh.

- fixed global batch: 2 sequences (per_device_batch_size = 1 / cp), so a device holds
  S / cp tokens: memory falls with cp;
- the trap: per_device_batch_size held at 1 while cp grows, so the global batch grows
  with the devices and every device still holds S tokens (what the bug reports warn
  about: raising cp then "saves no memory").

    python -m bench.train_memory
    python -m bench.train_memory --check   # the trap at cp 2 again, compared to the JSON
"""

from __future__ import annotations

from bench.common import use_cpu_devices

use_cpu_devices(8)

import jax  # noqa: E402

import layers  # noqa: E402
import selector  # noqa: E402
from bench.common import (  # noqa: E402
    TRAIN_COLUMNS,
    arguments,
    check_stored,
    log_x_axis,
    machine,
    pyplot,
    save,
    table,
)
from examples.train import TrainSettings, setup  # noqa: E402

SEQ = 2048
CPS = (1, 2, 4)
SETTINGS = TrainSettings(vocab=64, layers=2, heads=4)


def compiled_step_bytes(cp: int, per_device_batch_size: float) -> dict:
    mesh = layers.make_mesh({"data": 2, "context": cp})
    config = selector.to_config(
        selector.compose(
            [
                "model=tiny",
                "mesh=cpu_8",
                f"per_device_batch_size={per_device_batch_size}",
                f"max_target_length={SEQ}",
                "allow_local_batch_inflation=true",  # the trap is measured on purpose
            ]
        )
    )
    trainer = setup(config, SETTINGS, mesh)
    tokens = jax.ShapeDtypeStruct((trainer.batch, SEQ), "int32", sharding=trainer.token_sharding)
    lowered = trainer.step_fn.lower(trainer.params, trainer.opt_state, trainer.rest, tokens, tokens)
    m = lowered.compile().memory_analysis()
    plan = trainer.model.blocks[0].moe.plan  # the plan setup resolved on this mesh
    return {
        "cp": cp,
        "global_batch": trainer.batch,
        "tokens_per_device": plan.per_device.tokens_per_device,
        "arguments_mib": m.argument_size_in_bytes / 2**20,
        "temp_mib": m.temp_size_in_bytes / 2**20,
        "total_mib": (m.argument_size_in_bytes + m.temp_size_in_bytes) / 2**20,
    }


def plot(payload: dict):
    rows = payload["rows"]
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for setting, style in (("fixed global batch", "o-"), ("per_device_batch_size=1", "s--")):
        pts = [r for r in rows if r["setting"] == setting]
        ax.plot([r["cp"] for r in pts], [r["total_mib"] for r in pts], style, label=setting)
    ax.set(
        xlabel="context parallelism cp on (data=2, context=cp)",
        ylabel="train step args + temp MiB per device",
        title=f"example MoE LM train step, seq {SEQ}",
        ylim=(0, None),
    )
    log_x_axis(ax, CPS)
    ax.legend()
    return fig


def main() -> None:
    check = {"action": "store_true", "help": "one point again, compared to the JSON"}
    args = arguments("train_memory", __doc__, plot, check=check)
    if args is None:
        return
    if args.check:
        row = {"setting": "per_device_batch_size=1", **compiled_step_bytes(2, 1.0)}
        counted = ("global_batch", "tokens_per_device")
        compiled = ("arguments_mib", "temp_mib")
        raise SystemExit(check_stored("train_memory", [row], ("setting", "cp"), counted, compiled))
    rows = []
    for setting, pdbs in (
        ("fixed global batch", lambda cp: 1 / cp),
        ("per_device_batch_size=1", lambda cp: 1.0),
    ):
        first = None
        for cp in CPS:
            row = {"setting": setting, **compiled_step_bytes(cp, pdbs(cp))}
            first = first or row["total_mib"]
            row["vs_cp1"] = row["total_mib"] / first
            rows.append(row)
            print(f"  {setting:<26} cp={cp}: {row['total_mib']:.1f} MiB", flush=True)
    print(table(rows, TRAIN_COLUMNS))
    payload = {"machine": machine(), "seq": SEQ, "settings": vars(SETTINGS), "rows": rows}
    print("wrote", *save("train_memory", payload, plot(payload)))


if __name__ == "__main__":
    main()
