"""MoEBlock: router -> dispatch -> expert compute -> combine, with the dispatch the
selector's plan names, run per device inside one shard_map over the whole mesh.

Parameters use MaxText's names and shapes so weights port both ways:
gate.kernel (M, E), wi_0 (E, M, H), wi_1 (E, M, H), wo (E, H, M).
Legend: B batch, S sequence, M embedding, H hidden, E experts.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

import selector
from selector import Dispatch

from . import dense, megablox, subgroup_capacity
from .ffn import ExpertWeights, dense_ffn
from .router import finish_stats, partial_stats, route, split_global
from .params import create_sharded, param
from .sharding import Layout, gather
from .spec import MoESpec


def _mlp_local(x_BSM, w: ExpertWeights, spec: MoESpec):
    """One expert: a plain SwiGLU MLP; the router is trivially 1 for expert 0."""
    batch, seq, emb = x_BSM.shape
    x_TM = x_BSM.reshape(-1, emb)
    _, ids_TK, probs_TE = route(x_TM, w.gate_ME, spec.top_k, spec.norm_topk_prob)
    dt = spec.compute_dtype
    y_TM = dense_ffn(
        x_TM.astype(dt), w.wi_0_EMH[0].astype(dt), w.wi_1_EMH[0].astype(dt), w.wo_EHM[0].astype(dt)
    )
    return y_TM.reshape(batch, seq, emb).astype(x_BSM.dtype), partial_stats(probs_TE, ids_TK, 0)


# One local forward per strategy: (x_BSM, weights, spec) -> (y_BSM, partial stats).
STRATEGIES: dict[Dispatch, Callable] = {
    Dispatch.dense: dense.local_forward,
    Dispatch.subgroup_capacity: subgroup_capacity.local_forward,
    Dispatch.megablox: megablox.local_forward,
    Dispatch.mlp: _mlp_local,
}


def weights_for_compute(w: ExpertWeights, layout: Layout, dtype) -> ExpertWeights:
    """Inside shard_map: the at-rest shards as the strategies compute with them.

    Expert weights are cast to the compute dtype first (half the bytes to move in
    bfloat16), then all-gathered over the embed axes and, unless rows are exchanged,
    the expert axes; the hidden axes stay split. The router kernel keeps its dtype
    (the router computes in float32).
    """
    experts, embed = layout.gathered_experts, layout.embed
    return ExpertWeights(
        gate_ME=gather(w.gate_ME, embed, 0),
        wi_0_EMH=gather(gather(w.wi_0_EMH.astype(dtype), embed, 1), experts, 0),
        wi_1_EMH=gather(gather(w.wi_1_EMH.astype(dtype), embed, 1), experts, 0),
        wo_EHM=gather(gather(w.wo_EHM.astype(dtype), embed, 2), experts, 0),
    )


def weight_specs(layout: Layout) -> ExpertWeights:
    """The at-rest PartitionSpec of each weight, as the shard_map's in_specs."""
    return ExpertWeights(layout.gate_ME, layout.w_EMH, layout.w_EMH, layout.w_EHM)


def sharded_forward(strategy: Dispatch, layout: Layout, spec: MoESpec, x_BSM, w: ExpertWeights):
    """Run one strategy per device; statistics are summed over every token axis.

    Weights enter at their at-rest sharding and are gathered inside (so their gradients
    leave reduce-scattered); the hidden axes split every expert matmul and the partial
    outputs are summed over them once, after the combine.
    """
    layout.check_input(x_BSM.shape)
    local = STRATEGIES[strategy]
    if layout.mesh.size == 1:  # one device: nothing to shard or reduce, no shard_map needed
        y, sums = local(x_BSM, weights_for_compute(w, layout, spec.compute_dtype), spec)
        sums, done = split_global(sums)
        return y, {**finish_stats(sums, spec.top_k), **done}

    def body(x, w_rest):
        y, sums = local(x, weights_for_compute(w_rest, layout, spec.compute_dtype), spec)
        if layout.hidden:
            y = jax.lax.psum(y, layout.hidden)
        sums, done = split_global(sums)
        sums = jax.lax.psum(sums, layout.token_axes) if layout.token_axes else sums
        return y, {**finish_stats(sums, spec.top_k), **done}

    fn = jax.shard_map(
        body,
        mesh=layout.mesh,
        in_specs=(layout.x_BSM, weight_specs(layout)),
        out_specs=(layout.x_BSM, layout.replicated),
        check_vma=True,
    )
    return fn(x_BSM, w)


class GateLogit(nnx.Module):
    """The router's kernel (M, E), named as MaxText's `gate.kernel`."""

    def __init__(self, kernel: nnx.Param):
        self.kernel = kernel


class MoEBlock(nnx.Module):
    """A routed SwiGLU MoE block that keeps the sequence sharded.

    cfg: what `selector.compose` returns, or a `selector.Config`. mesh: a
    `jax.sharding.Mesh` with auto axis types whose axes use the selector's names (a
    missing axis counts as size 1). plan: the selector's plan; built with
    `selector.resolve(cfg, mesh)` when omitted (raises ConfigError on bad settings).

    Parameters are created in `param_dtype`, already sharded as they rest (see
    `layers.params`); `dtype` is the compute dtype.

    __call__(x_BSM) -> (y_BSM, stats) with stats: load_balance_loss, dropped_fraction,
    dropped_tokens, tokens_per_expert (E,), all over the global batch.
    """

    def __init__(
        self, cfg: Any, *, mesh: Mesh, plan: selector.DispatchPlan | None = None, rngs: nnx.Rngs
    ):
        config = selector.to_config(cfg)
        self.plan = plan if plan is not None else selector.resolve(config, mesh)
        self.layout = Layout.from_plan(self.plan, mesh)
        self.spec = MoESpec.from_config(config, self.plan, self.layout)
        self.param_dtype = jnp.dtype(config.param_dtype)
        shapes, shardings = self.param_layout()
        keys = [rngs.params() for _ in shapes]
        values = create_sharded(keys, shapes, self.param_dtype, shardings)
        gate, wi_0, wi_1, wo = (param(v, s) for v, s in zip(values, shardings, strict=True))
        self.gate = GateLogit(gate)
        self.wi_0, self.wi_1, self.wo = wi_0, wi_1, wo

    PARAM_NAMES = ("gate.kernel", "wi_0", "wi_1", "wo")

    def param_layout(self) -> tuple[tuple[tuple[int, ...], ...], list]:
        """(shapes, at-rest NamedShardings) of the parameters, in PARAM_NAMES order."""
        emb, hidden, experts = self.spec.emb, self.spec.hidden, self.spec.num_experts
        shapes = (
            (emb, experts),
            (experts, emb, hidden),
            (experts, emb, hidden),
            (experts, hidden, emb),
        )
        specs = self.layout.param_specs()
        return shapes, [self.layout.named(specs[n]) for n in self.PARAM_NAMES]

    def weights(self) -> ExpertWeights:
        return ExpertWeights(self.gate.kernel[...], self.wi_0[...], self.wi_1[...], self.wo[...])

    def __call__(self, x_BSM):
        return sharded_forward(self.plan.strategy, self.layout, self.spec, x_BSM, self.weights())


class MlpBlock(nnx.Module):
    """A dense SwiGLU block: what the bug reports fell back to, and the speed baseline."""

    def __init__(self, emb: int, hidden: int, *, dtype: str = "float32", rngs: nnx.Rngs):
        init = nnx.initializers.lecun_normal()
        self.wi_0 = nnx.Param(init(rngs.params(), (emb, hidden), jnp.float32))
        self.wi_1 = nnx.Param(init(rngs.params(), (emb, hidden), jnp.float32))
        self.wo = nnx.Param(init(rngs.params(), (hidden, emb), jnp.float32))
        self.dtype = dtype

    def __call__(self, x_BSM):
        dt = jnp.dtype(self.dtype)
        y = dense_ffn(
            x_BSM.astype(dt),
            self.wi_0[...].astype(dt),
            self.wi_1[...].astype(dt),
            self.wo[...].astype(dt),
        )
        return y.astype(x_BSM.dtype)
