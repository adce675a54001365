"""Probe: the block's fwd+bwd on a (data=2, context=4) mesh, in one process of 8 CPU
devices or as one of two processes of 4 devices joined by jax.distributed (gloo CPU
collectives over loopback). Writes the global output, statistics and gradients to an
.npz (process 0 only) and prints a JSON line (with the processes each context group
spans).

STRATEGIES is a comma-separated list; each is a dispatch with its weights gathered, or
`megablox_exchanged`: expert parallelism over the context axis, on a mesh laid out
(context=4, data=2) so that every context group holds devices of both processes and the
rows cross the process boundary. One process start serves them all (a start with jax,
flax and the distributed runtime costs more than a strategy's step); each writes
OUT.<strategy>.npz.

    probe.py OUT STRATEGIES [PROCESS_ID NUM_PROCESSES PORT]
"""

import json
import sys

import jax
import numpy as np


def main() -> None:
    out_prefix, strategies = sys.argv[1], sys.argv[2].split(",")
    if len(sys.argv) > 3:
        process_id, processes, port = (int(a) for a in sys.argv[3:6])
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(
            f"127.0.0.1:{port}", num_processes=processes, process_id=process_id
        )
    else:
        process_id, processes = 0, 1

    spans = {s: run_strategy(s, f"{out_prefix}.{s}.npz", process_id) for s in strategies}
    print(
        json.dumps(
            {
                "process": process_id,
                "processes": processes,
                "devices": jax.device_count(),
                "processes_per_context_group": spans,
            }
        )
    )


def run_strategy(strategy: str, out_path: str, process_id: int) -> list[int]:
    """One strategy's fwd+bwd; writes its arrays (process 0) and returns how many
    processes each context group spans."""
    import jax.numpy as jnp
    from flax import nnx
    from jax.experimental import multihost_utils

    import layers
    import selector
    from layers.programs import block_forward

    batch, seq, emb = 4, 64, 64
    exchanged = strategy == "megablox_exchanged"
    sizes = {"context": 4, "data": 2} if exchanged else {"data": 2, "context": 4}
    mesh = layers.make_mesh(sizes)
    groups = np.moveaxis(mesh.devices, list(mesh.axis_names).index("context"), -1).reshape(-1, 4)
    spans = sorted({len({d.process_index for d in group}) for group in groups})
    cfg = selector.compose(
        [
            "model=tiny",
            "mesh=cpu_8",
            f"dispatch={'megablox' if exchanged else strategy}",
            f"expert_exchange={'all_to_all' if exchanged else 'gather'}",
            f"capacity_factor={2.0 if strategy == 'subgroup_capacity' else -1}",
            f"per_device_batch_size={batch / 8}",
            f"max_target_length={seq}",
            "allow_local_batch_inflation=true",
        ]
    )
    model = layers.MoEBlock(selector.resolve(cfg, mesh), mesh=mesh, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(7)
    x_global = rng.standard_normal((batch, seq, emb)).astype(np.float32)
    cot_global = rng.standard_normal((batch, seq, emb)).astype(np.float32)
    sharding = model.layout.named(model.layout.x_BSM)

    def place(a):
        return jax.make_array_from_callback(a.shape, sharding, lambda idx: a[idx])

    x, cot = place(x_global), place(cot_global)
    forward = block_forward(model)

    def loss(w, x, cot):
        y, stats = forward(w, x)
        return jnp.sum(y * cot), (y, stats)

    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))
    (_, (y, stats)), (gw, gx) = step(model.weights(), x, cot)

    def collect(a):
        return np.asarray(multihost_utils.process_allgather(a, tiled=True))

    arrays = {"y": collect(y), "dx": collect(gx)}
    for name in ("gate_ME", "wi_0_EMH", "wi_1_EMH", "wo_EHM"):
        arrays[f"d{name}"] = collect(getattr(gw, name))
    for key in ("load_balance_loss", "tokens_per_expert", "dropped_tokens"):
        arrays[f"stats_{key}"] = collect(stats[key])
    assert ("exchange_rounds" in stats) == exchanged
    if process_id == 0:
        np.savez(out_path, **arrays)
    return spans


if __name__ == "__main__":
    main()
