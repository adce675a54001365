"""MoEBlock: router -> dispatch -> expert compute -> combine, with the dispatch the
selector's plan names, run per device inside one shard_map over the whole mesh.

Parameters use MaxText's names and shapes so weights port both ways:
gate.kernel (M, E), wi_0 (E, M, H), wi_1 (E, M, H), wo (E, H, M).
Legend: B batch, S sequence, M embedding, H hidden, E experts.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from selector.config import Config, Dispatch
from selector.findings import ConfigError, Finding, Fix, Severity

if TYPE_CHECKING:  # the layers take a plan and call its methods; they import no analysis
    from selector.plan import DispatchPlan

from . import dense, megablox, subgroup_capacity
from .ffn import WEIGHT_FIELDS, ExpertWeights, dense_ffn, shared_swiglu
from .params import create_sharded, param
from .router import finish_stats, partial_stats, route, split_global
from .sharding import Layout, check_mesh, gather
from .spec import MoESpec
from .vma import varying_like
from .weights import WEIGHTS


def _mlp_local(x_BSM, w: ExpertWeights, spec: MoESpec):
    """One expert: a plain SwiGLU MLP times the router's weight for expert 0 (1 after a
    softmax; the routed scaling factor still applies)."""
    batch, seq, emb = x_BSM.shape
    x_TM = x_BSM.reshape(-1, emb)
    weights_TK, ids_TK, probs_TE = route(x_TM, w, spec)
    dt = spec.compute_dtype
    y_TM = dense_ffn(
        x_TM.astype(dt), w.wi_0_EMH[0].astype(dt), w.wi_1_EMH[0].astype(dt), w.wo_EHM[0].astype(dt)
    )
    y_TM = y_TM * weights_TK[:, :1].astype(dt)
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
    (the router computes in float32), and so do the small bias and shared gate.
    """
    experts, embed, shared = layout.gathered_experts, layout.embed, layout.shared_embed
    repeated = layout.repeated_axes

    def cast(a):
        return None if a is None else a.astype(dtype)

    def g(a, axes, dim):
        return None if a is None else gather(a, axes, dim, repeated)

    return ExpertWeights(
        gate_ME=g(w.gate_ME, shared, 0),
        wi_0_EMH=g(g(cast(w.wi_0_EMH), embed, 1), experts, 0),
        wi_1_EMH=g(g(cast(w.wi_1_EMH), embed, 1), experts, 0),
        wo_EHM=g(g(cast(w.wo_EHM), embed, 2), experts, 0),
        bias_E=w.bias_E,
        shared_wi_0_MS=g(cast(w.shared_wi_0_MS), shared, 0),
        shared_wi_1_MS=g(cast(w.shared_wi_1_MS), shared, 0),
        shared_wo_SM=g(cast(w.shared_wo_SM), shared, 1),
        shared_gate_M1=g(w.shared_gate_M1, shared, 0),
    )


def weight_specs(layout: Layout, w: ExpertWeights) -> ExpertWeights:
    """The at-rest PartitionSpec of each weight (None where the model has none), as the
    shard_map's in_specs."""
    specs = layout.weight_specs()
    return ExpertWeights(
        **{name: (None if getattr(w, name) is None else specs[name]) for name in WEIGHT_FIELDS}
    )


def _local_with_shared(local, x_BSM, w_rest, layout: Layout, spec: MoESpec):
    """One device's routed output plus the shared experts' (partial over the hidden
    axes, like the routed one)."""
    # The at-rest shards are marked varying over the token axes before they are
    # gathered: the sum of the weight gradients over devices holding the same shard
    # (the transpose of that mark) then runs on the shard, after the gather's
    # reduce-scatter, not on the whole gathered gradient before it (4x the bytes on
    # (data=2, expert=4), seen in the compiled program).
    w_rest = ExpertWeights(
        **{
            name: None
            if getattr(w_rest, name) is None
            else varying_like(getattr(w_rest, name), x_BSM)
            for name in WEIGHT_FIELDS
        }
    )
    w = weights_for_compute(w_rest, layout, spec.compute_dtype)
    y_BSM, sums = local(x_BSM, w, spec)
    batch, seq, emb = x_BSM.shape
    with jax.named_scope("shared_experts"):
        shared = shared_swiglu(x_BSM.reshape(-1, emb), w, spec.compute_dtype)
    if shared is not None:
        y_BSM = y_BSM + shared.reshape(batch, seq, emb).astype(y_BSM.dtype)
    return y_BSM, sums


def sharded_forward(strategy: Dispatch, layout: Layout, spec: MoESpec, x_BSM, w: ExpertWeights):
    """Run one strategy per device; statistics are summed over every token axis.

    Weights enter at their at-rest sharding and are gathered inside (so their gradients
    leave reduce-scattered); the hidden axes split every expert matmul and the partial
    outputs are summed over them once, after the combine.
    """
    layout.check_input(x_BSM.shape)
    local = STRATEGIES[strategy]
    if layout.mesh.size == 1:  # one device: nothing to shard or reduce, no shard_map needed
        y, sums = _local_with_shared(local, x_BSM, w, layout, spec)
        sums, done = split_global(sums)
        return y, {**finish_stats(sums, spec.top_k), **done}

    def body(x, w_rest):
        y, sums = _local_with_shared(local, x, w_rest, layout, spec)
        if layout.hidden:  # every expert's hidden slice (routed and shared) summed once
            y = jax.lax.psum(y, layout.hidden)
        sums, done = split_global(sums)
        sums = jax.lax.psum(sums, layout.token_axes) if layout.token_axes else sums
        return y, {**finish_stats(sums, spec.top_k), **done}

    fn = jax.shard_map(
        body,
        mesh=layout.mesh,
        in_specs=(layout.x_BSM, weight_specs(layout, w)),
        out_specs=(layout.x_BSM, layout.replicated),
        check_vma=True,
    )
    return fn(x_BSM, w)


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def _compiled_forward(strategy: Dispatch, layout: Layout, spec: MoESpec, x_BSM, w):
    """`sharded_forward` compiled once per (strategy, layout, spec) and input shapes. A
    block called outside any trace would otherwise run its shard_map body op by op
    (the tiny model on 8 CPU devices: 13.6 s every call; compiled, 1.8 s the first)."""
    return sharded_forward(strategy, layout, spec, x_BSM, w)


class HeldPlan:
    """The plan a block was built from, kept to re-plan it at other input shapes.

    NNX keeps a module's plain attributes in its graph definition, which `nnx.jit`
    hashes: the plan is compared by its (frozen) config, the live mesh's shape, and the
    built strategy and exchange."""

    __slots__ = ("plan", "_key")

    def __init__(self, plan: DispatchPlan):
        self.plan = plan
        shape = tuple(sorted(plan.live_shape.items())) if plan.live_shape else None
        self._key = (plan.config, shape, plan.strategy, plan.placement.exchange)

    @property
    def config(self) -> Config:
        return self.plan.config

    def __hash__(self) -> int:
        return hash(self._key)

    def __eq__(self, other) -> bool:
        return isinstance(other, HeldPlan) and other._key == self._key


class InputShapeError(ConfigError):
    """An input no plan of the block can serve: the selector's findings at that shape
    (each with its fixes, in settings), introduced by what the input reads as."""

    def __init__(self, shape: tuple[int, ...], findings, reading: str):
        super().__init__(findings)
        self.shape = shape
        self.args = (f"MoEBlock input {shape}: {reading}\n{self.args[0]}",)


@functools.lru_cache(maxsize=64)
def plan_at_shape(held: HeldPlan, batch: int, seq: int) -> DispatchPlan:
    """The built plan re-planned for a global (batch, seq) input (`DispatchPlan.at_shape`:
    same strategy and exchange, the per-device numbers and findings at that shape).
    Raises InputShapeError when no plan serves the shape."""
    built = held.plan
    config = held.config
    devices = built.mesh.num_devices
    shaped = built.shaped_config(batch, seq)
    found, findings = built.at_shape(batch, seq)
    reading = (
        f"{batch} sequences over {devices} devices (per_device_batch_size="
        f"{shaped.per_device_batch_size:g}) of {seq} tokens (max_target_length="
        f"{shaped.max_target_length}, mode={config.mode.value}), which the selector refuses for the block's "
        f"{built.strategy.value} dispatch on this mesh. Give an input the findings allow: "
        f"a batch of per_device_batch_size x {devices} sequences of max_target_length tokens."
    )
    shape = (batch, seq, config.base_emb_dim)
    if found is None or found.errors:
        raise InputShapeError(shape, findings, reading)
    if found.per_device.seq_len != seq:  # decode: one new token a sequence, whatever is given
        raise InputShapeError(
            shape, [_mode_finding(config.mode.value, found.per_device.seq_len, seq)], reading
        )
    return found


def _mode_finding(mode: str, planned: int, seq: int) -> Finding:
    found = Finding(
        "INPUT_SEQUENCE_FOR_MODE",
        Severity.error,
        "mode",
        f"The block was built with mode={mode}, whose steps take {planned} token(s) a "
        f"sequence, but the input has {seq}. Give it (batch, {planned}, emb) inputs, or build "
        f"a block for prompts of {seq} tokens.",
    )
    return found.with_fixes((Fix((("mode", "prefill"),), f"a block for {seq}-token inputs"),))


def _emb_finding(shape: tuple[int, ...], emb: int) -> Finding:
    found = Finding(
        "INPUT_EMB_MISMATCH",
        Severity.error,
        "base_emb_dim",
        f"MoEBlock input {shape} is not (batch, sequence, {emb}): the block's parameters "
        f"were created for base_emb_dim={emb} and do not change with the input. Give it "
        f"inputs of emb {emb}, or build a block for the input's.",
    )
    return found.with_fixes((Fix((("base_emb_dim", shape[-1]),), "a new block, new parameters"),))


# What a block's config and its plan must agree on: the settings that shape the
# parameters and the compute, read from a Config, a DictConfig or a mapping.
AGREED_SETTINGS = (
    "base_emb_dim",
    "num_experts",
    "num_experts_per_tok",
    "base_moe_mlp_dim",
    "dtype",
    "param_dtype",
    "mode",
)


def _the_plan(cfg: Any, plan: DispatchPlan | None) -> DispatchPlan:
    """The plan a block builds from: `plan`, or `cfg` when it is one. A config given
    beside a plan must agree with the one the plan was resolved from."""
    if _is_plan(cfg):
        if plan is not None and plan is not cfg:
            raise ValueError("MoEBlock was given two plans (cfg and plan=); give one.")
        plan = cfg
    if plan is None:
        raise TypeError(
            "MoEBlock builds what the selector's plan says and takes it as its config: "
            "layers.MoEBlock(selector.resolve(cfg, mesh), mesh=mesh, rngs=rngs), or "
            "layers.MoEBlock(cfg, mesh=mesh, plan=selector.resolve(cfg, mesh), rngs=rngs)."
        )
    if plan.config is None:
        raise ValueError(
            "MoEBlock's plan carries no config (it was not built by selector.resolve); "
            "build it with selector.resolve(cfg, mesh)."
        )
    if cfg is not plan:
        for name in AGREED_SETTINGS:
            given = _setting(cfg, name)
            held = getattr(plan.config, name)
            held = getattr(held, "value", held)
            if given is not None and str(getattr(given, "value", given)) != str(held):
                raise ValueError(
                    f"MoEBlock's config has {name}={given} but its plan was resolved for "
                    f"{name}={held}. Resolve the plan from this config "
                    f"(plan=selector.resolve(cfg, mesh)) or pass the plan alone."
                )
    return plan


def _is_plan(value: Any) -> bool:
    # Without importing the selector's analysis: a DispatchPlan exists only once
    # selector.plan has been imported (by whoever resolved it).
    plan = sys.modules.get("selector.plan")
    return plan is not None and isinstance(value, plan.DispatchPlan)


def _setting(cfg: Any, name: str):
    if isinstance(cfg, Config):
        return getattr(cfg, name)
    try:
        return cfg.get(name)
    except AttributeError:
        return None


class RoutedBias(nnx.Variable):
    """The router's selection bias (aux-loss-free balancing): state updated by
    `layers.update_routed_bias` from the load statistics, never by gradients."""


class Dense(nnx.Module):
    """A kernel, named as MaxText's DenseGeneral names it."""

    def __init__(self, kernel: nnx.Param):
        self.kernel = kernel


class GateLogit(nnx.Module):
    """The router: kernel (M, E) and, for DeepSeek-V3-style routing, a bias (E,);
    named as MaxText's `gate`."""

    def __init__(self, kernel: nnx.Param, bias: RoutedBias | None = None):
        self.kernel = kernel
        self.bias = nnx.data(bias)  # None for softmax-only routers


class SharedExperts(nnx.Module):
    """The shared experts' SwiGLU (MaxText's MlpBlock names: wi_0, wi_1, wo)."""

    def __init__(self, wi_0: nnx.Param, wi_1: nnx.Param, wo: nnx.Param):
        self.wi_0, self.wi_1, self.wo = Dense(wi_0), Dense(wi_1), Dense(wo)


class MoEBlock(nnx.Module):
    """A routed SwiGLU MoE block that keeps the sequence sharded.

    The block builds what the selector's plan says, from the config the plan was
    resolved from (`plan.config`): give it `selector.resolve(cfg, mesh)` in cfg's place,
    or cfg (what `selector.compose` returns, a `selector.Config` or a mapping) with the
    plan as `plan=`; a cfg that disagrees with the plan on the model's shape or dtypes
    is refused. The layers never call the selector: a plan re-plans itself for other
    input shapes (`DispatchPlan.at_shape`). mesh: a `jax.sharding.Mesh` with auto axis
    types whose axes use the selector's names (a missing axis counts as size 1).

    Parameters are created in `param_dtype`, already sharded as they rest (see
    `layers.params`); `dtype` is the compute dtype. Parameter names follow MaxText:
    gate/kernel, gate/bias, wi_0, wi_1, wo, shared_experts/{wi_0,wi_1,wo}/kernel and
    shared_expert_gate/kernel (`layers.maxtext_params` converts both ways).

    __call__(x_BSM) -> (y_BSM, stats) with stats: load_balance_loss, dropped_fraction,
    dropped_tokens, tokens_per_expert (E,), nonfinite_tokens, and exchange_rounds when
    rows are exchanged, all over the global batch.

    The block takes any (batch, sequence) the mesh divides, not only the shape its plan
    was resolved for: the strategy and the parameters stay as built, and the per-device
    numbers (tokens a device, capacity per subgroup) are the selector's for the input's
    shape, re-planned once per shape (`at_shape`). An input the selector refuses (a batch
    the batch axes do not divide, a sequence cp does not divide, a decode step of more
    than one token, another emb) raises ConfigError with the finding and its fix.

    Args:
      cfg: the plan, or the config beside `plan=` (see above).
      mesh: the live mesh (keyword).
      plan: the selector's plan (keyword), when cfg is the config.
      rngs: `nnx.Rngs` for the parameters (keyword).

    Returns (calling it):
      (y_BSM, stats): the block's output, sharded as its input, and the statistics.

    Examples:
      On 8 simulated CPU devices (tests/conftest.py sets them up):
      >>> import jax, jax.numpy as jnp, selector, layers
      >>> from flax import nnx
      >>> cfg = selector.compose(["model=tiny", "mesh=cpu_8", "ici_context_parallelism=4",
      ...                         "ici_fsdp_parallelism=2", "per_device_batch_size=0.25",
      ...                         "max_target_length=64", "dtype=float32"])
      >>> plan = selector.resolve(cfg)
      >>> block = layers.MoEBlock(cfg, mesh=layers.mesh_for_plan(plan, jax.devices()[:8]),
      ...                         plan=plan, rngs=nnx.Rngs(0))
      >>> x = jnp.ones((2, 64, cfg.base_emb_dim))
      >>> y, stats = block(x)
      >>> y.shape, int(stats["dropped_tokens"]), int(stats["tokens_per_expert"].sum())
      ((2, 64, 64), 0, 256)
      >>> block.at_shape((4, 32, 64))[0].per_device.tokens_per_device  # 4 x 32 over 8
      16.0
    """

    def __init__(self, cfg: Any, *, mesh: Mesh, plan: DispatchPlan | None = None, rngs: nnx.Rngs):
        plan = _the_plan(cfg, plan)
        config = plan.config
        check_mesh(mesh, plan)
        self.plan = plan
        self.layout = Layout.from_plan(self.plan, mesh)
        self.spec = MoESpec.from_config(config, self.plan, self.layout)
        self.settings = HeldPlan(plan)  # to re-plan it at other input shapes
        self.param_dtype = jnp.dtype(config.param_dtype)
        names, shapes, shardings = self.param_layout()
        keys = [rngs.params() for _ in names]
        values = dict(
            zip(names, create_sharded(keys, shapes, self.param_dtype, shardings), strict=True)
        )
        p = {n: param(values[n], s) for n, s in zip(names, shardings, strict=True)}
        bias = None
        if self.spec.routed_bias:
            spec = self.layout.weight_specs()["bias_E"]
            zeros = jax.device_put(
                jnp.zeros((self.spec.num_experts,), jnp.float32), self.layout.named(spec)
            )
            bias = RoutedBias(zeros, out_sharding=spec, mesh=mesh)
        self.gate = GateLogit(p["gate_ME"], bias)
        self.wi_0, self.wi_1, self.wo = p["wi_0_EMH"], p["wi_1_EMH"], p["wo_EHM"]
        shared = None
        if "shared_wi_0_MS" in p:
            shared = SharedExperts(p["shared_wi_0_MS"], p["shared_wi_1_MS"], p["shared_wo_SM"])
        self.shared_experts = nnx.data(shared)
        gate = Dense(p["shared_gate_M1"]) if "shared_gate_M1" in p else None
        self.shared_expert_gate = nnx.data(gate)

    def param_layout(self) -> tuple[list[str], list[tuple[int, ...]], list]:
        """(names, shapes, at-rest NamedShardings) of the parameters created at init, by
        their ExpertWeights field names (`layers.weights`; the router's bias is created
        apart, as zeros)."""
        s = self.spec
        sizes = {"M": s.emb, "E": s.num_experts, "H": s.hidden, "S": s.shared_hidden, "1": 1}
        held = {
            "routed": True,
            "shared": bool(s.shared_hidden),
            "shared_gate": s.shared_expert_gate,
        }
        created = [w for w in WEIGHTS if held[w.part] and w.field != "bias_E"]
        specs = self.layout.weight_specs()
        return (
            [w.field for w in created],
            [tuple(sizes[letter] for letter in w.letters) for w in created],
            [self.layout.named(specs[w.field]) for w in created],
        )

    def variables(self) -> dict[str, nnx.Variable | None]:
        """The nnx variable behind each ExpertWeights field (None where the model has
        none), found at its module path in `layers.weights`."""
        out = {}
        for w in WEIGHTS:
            node = self
            for name in w.module:
                node = None if node is None else getattr(node, name)
            out[w.field] = node
        return out

    def weights(self) -> ExpertWeights:
        """The parameters as a pytree (abstract ShapeDtypeStructs under nnx.eval_shape)."""
        return ExpertWeights(
            **{n: None if v is None else v.get_value() for n, v in self.variables().items()}
        )

    def __call__(self, x_BSM):
        plan, layout, spec = self.at_shape(x_BSM.shape)
        w = self.weights()
        # Inside the caller's jit or grad the block is part of their program; called on
        # concrete arrays it is compiled on its own, once per shape.
        traced = any(isinstance(a, jax.core.Tracer) for a in jax.tree.leaves((x_BSM, w)))
        forward = sharded_forward if traced else _compiled_forward
        return forward(plan.strategy, layout, spec, x_BSM, w)

    def at_shape(self, shape) -> tuple[DispatchPlan, Layout, MoESpec]:
        """(plan, layout, spec) for a global (batch, sequence, emb) input: the built ones
        at the shape the plan was resolved for; at any other, the built strategy and
        placement with the per-device numbers the selector derives for that shape
        (cached per shape). Raises ConfigError, with the selector's findings and their
        fixes, for an input no plan of this block can serve."""
        shape = tuple(int(d) for d in shape)
        if len(shape) != 3:
            raise ValueError(
                f"MoEBlock takes a (batch, sequence, emb) input; got shape {shape}. Reshape "
                f"it to three dims, e.g. (batch, sequence, {self.spec.emb})."
            )
        if shape[-1] != self.spec.emb:
            raise ConfigError([_emb_finding(shape, self.spec.emb)])
        batch, seq, _ = shape
        dev = self.plan.per_device
        if (batch, seq) == (round(dev.global_batch), dev.seq_len):
            return self.plan, self.layout, self.spec
        mesh = self.layout.mesh
        found = plan_at_shape(self.settings, batch, seq)
        plan = dataclasses.replace(
            self.plan,
            per_device=found.per_device,
            candidates=found.candidates,
            findings=found.findings,
        )
        layout = Layout.from_plan(plan, mesh)
        return plan, layout, MoESpec.from_config(self.settings.config, plan, layout)


class MlpBlock(nnx.Module):
    """A dense SwiGLU block: what the bug reports fell back to, and the speed baseline.

    Args:
      emb: the embedding width.
      hidden: the hidden width.
      dtype: the compute dtype (the weights are stored in float32).
      rngs: the initialisers' keys.

    Examples:
      >>> import jax.numpy as jnp, layers
      >>> from flax import nnx
      >>> mlp = layers.MlpBlock(64, 128, rngs=nnx.Rngs(0))
      >>> mlp(jnp.ones((2, 16, 64))).shape  # (batch, sequence, emb) in and out
      (2, 16, 64)
    """

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
