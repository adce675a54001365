"""Candidates of a plan timed on this process's devices, for measure mode
(`checks.measure_mode`): each is built, compiled once, then run one step per round,
interleaved with the others, so a noisy machine slows them alike."""

from __future__ import annotations

import time

import jax
from flax import nnx

import selector
from layers import MoEBlock
from layers.programs import block_forward, fwd_bwd_loss
from layers.sharding import mesh_for_plan


def _step(config: selector.Config, strategy, exchange):
    """(the jitted step, its arguments) of one candidate at the configured shape:
    fwd+bwd when training, the forward otherwise."""
    forced = config.replace(dispatch=strategy, expert_exchange=exchange)
    plan = selector.resolve(forced)
    devices = jax.devices()[: plan.mesh.num_devices]
    block = MoEBlock(forced, mesh=mesh_for_plan(plan, devices), plan=plan, rngs=nnx.Rngs(0))
    dev = plan.per_device
    shape = (round(dev.global_batch), dev.seq_len, forced.base_emb_dim)
    layout = block.layout
    x = jax.device_put(
        jax.random.normal(jax.random.key(1), shape, block.spec.compute_dtype),
        layout.named(layout.x_BSM),
    )
    forward = block_forward(block)
    if forced.mode is selector.Mode.train:
        fn = jax.jit(jax.grad(fwd_bwd_loss(forward), argnums=(0, 1)))
    else:
        fn = jax.jit(forward)
    return fn, (block.weights(), x)


def interleaved(fns: dict, runs: int = 5, settle: int = 0) -> dict:
    """Wall times of several jitted calls measured in alternation: each is warmed up
    (compiled) once, then every round times each of them once, in a rotating order, so
    a slow spell of a shared machine hits them alike. With `settle`, each timed run
    follows that many untimed runs of the same call, so it is timed as a training
    loop's next step is: after a step of the same program, not of another. (On 8
    simulated CPU devices a gathered MoE block ran 37% slower right after a dense block
    than after another gathered block; an exchanged one did not move.)
    {name: [seconds per timed run]}."""
    for fn, args in fns.values():
        jax.block_until_ready(fn(*args))
    times: dict = {name: [] for name in fns}
    names = list(fns)
    for r in range(runs):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            fn, args = fns[name]
            for _ in range(settle):
                jax.block_until_ready(fn(*args))
            start = time.perf_counter()
            jax.block_until_ready(fn(*args))
            times[name].append(time.perf_counter() - start)
    return times


def time_candidates(config: selector.Config, keys, rounds: int) -> dict:
    """{(strategy, exchange): [seconds per step, one per round]} for each candidate,
    each timed step after an untimed step of the same candidate (`interleaved`)."""
    fns = {key: _step(config, *key) for key in keys}
    return interleaved(fns, max(rounds, 1), settle=1)


__all__ = ["interleaved", "time_candidates"]
