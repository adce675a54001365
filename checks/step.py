"""The whole training step of the config's decoder (`checks.decoder`) compiled for its
chips, ahead of time from abstract inputs, and what XLA says a device holds for it.

The step is what a trainer jits: the loss and its gradient through every layer (the
layers scanned, each rematerialised as remat_policy says), then AdamW (optax; first
moment in float32, second in the parameters' dtype) updating the parameters, with the
parameters and the optimizer state donated and returned in their at-rest shardings.
Nothing is allocated: the decoder is built with `nnx.eval_shape` and the program lowered
from ShapeDtypeStructs with NamedShardings, so the real models' sizes need no memory.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import selector
from layers.sharding import mesh_for_plan
from selector import targets

from .compiled import candidate_plan, cost_analysis, target_of
from .decoder import Decoder
from .targets import devices


@dataclass(frozen=True)
class CompiledStep:
    """XLA's numbers for one compiled training step, per device."""

    name: str  # the MoE layers' candidate: dispatch (and megablox's exchange)
    target: str
    arguments: int  # bytes, XLA's memory analysis
    outputs: int
    temp: int
    alias: int  # outputs that reuse a donated argument's buffer
    params: int  # of the arguments, the parameters (counted from their shardings)
    optimizer: int  # of the arguments, the optimizer state
    flops: float
    bytes_accessed: float
    seconds: float  # lowering and compiling on this machine
    # The grouped matmul the step was compiled with, when it is not the plan's (see
    # `compile_candidate_step`); "" when it is the plan's.
    gmm_substituted: str = ""

    @property
    def peak(self) -> int:
        return self.arguments + self.outputs + self.temp - self.alias

    def as_dict(self) -> dict:
        return {**dataclasses.asdict(self), "peak": self.peak}


def optimizer(config: selector.Config) -> optax.GradientTransformation:
    return optax.adamw(1e-4, weight_decay=0.1, mu_dtype=jnp.float32)


def shard_bytes(tree) -> int:
    """Bytes one device holds of a tree of ShapeDtypeStructs with shardings (the
    largest shard where shards differ)."""
    total = 0
    for a in jax.tree.leaves(tree):
        shape = a.sharding.shard_shape(a.shape)
        total += int(jnp.dtype(a.dtype).itemsize * max(1, _prod(shape)))
    return total


def _prod(shape) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def abstract_step(cfg: Any, plan: selector.DispatchPlan, mesh):
    """(jitted step, its abstract arguments, the abstract decoder) for `plan` on
    `mesh`: step(params, opt_state, tokens, targets) -> (params, opt_state, loss)."""
    config = selector.to_config(cfg)
    model = nnx.eval_shape(lambda: Decoder(config, mesh=mesh, plan=plan, rngs=nnx.Rngs(0)))
    shardings = model.shardings()
    params = {
        n: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=shardings[n])
        for n, a in model.weights().items()
    }
    tx = optimizer(config)
    replicated = NamedSharding(mesh, P())
    opt = jax.eval_shape(tx.init, params)
    opt_shardings = optax.tree_map_params(
        tx,
        lambda _, s: s,
        opt,
        shardings,
        transform_non_params=lambda _: replicated,
        is_leaf=lambda x: isinstance(x, NamedSharding),
    )
    opt = jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), opt, opt_shardings
    )
    dev = plan.per_device
    batch, seq = round(dev.global_batch), dev.seq_len
    tokens = jax.ShapeDtypeStruct(
        (batch, seq), jnp.int32, sharding=model.layout.named(model.layout.tokens)
    )

    def step(params, opt_state, tokens, targets):
        loss, grads = jax.value_and_grad(model.loss)(params, tokens, targets)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    jitted = jax.jit(
        step, donate_argnums=(0, 1), out_shardings=(shardings, opt_shardings, replicated)
    )
    return jitted, (params, opt, tokens, tokens), model


def compile_step(
    cfg: Any,
    plan: selector.DispatchPlan,
    target: targets.Target | None = None,
    *,
    progress: Callable[[str], None] | None = None,
):
    """(compiled program, CompiledStep) of the whole training step of `plan`'s decoder
    on `target` (default: the chips the config names). `progress` hears every 30 s
    while XLA compiles."""
    config = selector.to_config(cfg)
    if config.mode is not selector.Mode.train:
        raise ValueError("the whole-step compile builds a training step (mode=train)")
    target = target or target_of(config, plan.mesh.num_devices)
    mesh = mesh_for_plan(plan, devices(target))
    start = time.perf_counter()
    jitted, args, _ = abstract_step(config, plan, mesh)
    lowered = jitted.lower(*args)
    program = _with_ticks(lambda: lowered.compile(target.compile_options()), progress, start)
    seconds = time.perf_counter() - start
    m = program.memory_analysis()
    cost = cost_analysis(program)
    numbers = CompiledStep(
        name=plan.chosen_estimate.name,
        target=target.describe(),
        arguments=m.argument_size_in_bytes,
        outputs=m.output_size_in_bytes,
        temp=m.temp_size_in_bytes,
        alias=m.alias_size_in_bytes,
        params=shard_bytes(args[0]),
        optimizer=shard_bytes(args[1]),
        flops=float(cost.get("flops", 0.0)),
        bytes_accessed=float(cost.get("bytes accessed", 0.0)),
        seconds=seconds,
    )
    return program, numbers


def _with_ticks(fn, progress, start: float, every: float = 30.0):
    """fn(), saying every `every` seconds that it still runs."""
    if progress is None:
        return fn()
    done = threading.Event()

    def tick():
        while not done.wait(every):
            progress(f"  still compiling ({time.perf_counter() - start:.0f} s)")

    thread = threading.Thread(target=tick, daemon=True)
    thread.start()
    try:
        return fn()
    finally:
        done.set()
        thread.join()


def compile_candidate_step(
    cfg: Any,
    strategy: selector.Dispatch,
    exchange: selector.Exchange,
    target: targets.Target | None = None,
    *,
    plan: selector.DispatchPlan,
    progress: Callable[[str], None] | None = None,
) -> CompiledStep:
    """The whole step with the MoE layers of candidate (strategy, exchange) of `plan`.

    JAX's Pallas megablox kernels do not lower inside the scanned, checkpointed layers
    (jax 0.10.2: the rematerialised kernel call fails the shard_map's varying-axes check
    on a concatenate inside the kernel's group metadata, outside the scope in which
    `layers.pallas_gmm` turns the check off). The step is then compiled with tiled_gmm
    and says so (`gmm_substituted`), which compile mode reports as a finding; the block
    alone still compiles with the Pallas kernels."""
    chosen = candidate_plan(plan, strategy, exchange)
    substituted = ""
    if chosen.strategy is selector.Dispatch.megablox and chosen.gmm_backend == "pallas_megablox":
        substituted = "tiled_gmm"
        chosen = dataclasses.replace(chosen, gmm_backend=substituted)
    step = compile_step(cfg, chosen, target, progress=progress)[1]
    return dataclasses.replace(step, gmm_substituted=substituted)
