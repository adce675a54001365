"""Sharding rules as data: every PartitionSpec the layers use comes from `Layout`,
built once from the plan's axis-roles table and the live mesh.

Meshes must use auto axis types (`jax.sharding.Mesh(..., axis_types=(Auto,)*n)` or
`make_mesh` below): `jax.make_mesh` defaults to explicit axes in current jax, under
which sharding propagation is not what the layers rely on.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from .weights import WEIGHTS, Weight


def make_mesh(sizes: Mapping[str, int], devices=None) -> Mesh:
    """A mesh with auto axis types (what the MoE block places its arrays with).

    Args:
      sizes: axis names (selector spelling) to sizes, in the mesh's order.
      devices: the devices to lay out (default: `jax.devices()`); the first
        prod(sizes) of them are used.

    Returns:
      The `jax.sharding.Mesh`. Raises ValueError when there are too few devices.

    Examples:
      >>> import layers
      >>> mesh = layers.make_mesh({"data": 2, "context": 4})  # 8 simulated CPU devices
      >>> dict(mesh.shape)
      {'data': 2, 'context': 4}
    """
    names = tuple(sizes)
    shape = tuple(int(sizes[n]) for n in names)
    devices = jax.devices() if devices is None else devices
    n = int(np.prod(shape))
    if n > len(devices):
        raise ValueError(f"mesh {dict(sizes)} needs {n} devices; only {len(devices)} exist")
    grid = np.asarray(devices[:n], dtype=object).reshape(shape)
    return Mesh(grid, names, axis_types=(AxisType.Auto,) * len(names))


def mesh_for_plan(plan, devices=None) -> Mesh:
    """The mesh a plan resolved from config describes (every selector axis, auto types).

    Args:
      plan: a DispatchPlan (`selector.resolve` of a config, no live mesh).
      devices: as for `make_mesh`.

    Returns:
      The `jax.sharding.Mesh` with every selector axis, sized as the plan says.

    Examples:
      >>> import layers, selector
      >>> plan = selector.resolve(selector.compose(["model=tiny", "mesh=cpu_8",
      ...     "ici_context_parallelism=4", "per_device_batch_size=0.25"]))
      >>> {k: v for k, v in layers.mesh_for_plan(plan).shape.items() if v > 1}
      {'fsdp': 2, 'context': 4}
    """
    return make_mesh(dict(plan.mesh.sizes), devices)


def check_mesh(mesh: Mesh, plan=None) -> None:
    """Refuse a mesh the block cannot honour, and a plan resolved for another mesh: a
    plan's axes and placement describe the mesh it was resolved for, so on any other
    its exchange or sequence split would silently not happen."""
    types = getattr(mesh, "axis_types", ())
    explicit = [n for n, t in zip(mesh.axis_names, types, strict=False) if t != AxisType.Auto]
    if explicit:
        raise ValueError(
            f"The mesh's axes {explicit} are not of auto type (jax.make_mesh makes explicit "
            "axes by default); the MoE block places its arrays with auto axes and its own "
            "shard_map. Build the mesh with layers.make_mesh(sizes), or jax.make_mesh(shape, "
            "names, axis_types=(jax.sharding.AxisType.Auto,) * len(names))."
        )
    if plan is None:
        return
    planned = {a: s for a, s in plan.mesh.sizes if s > 1}
    live = {a: int(s) for a, s in mesh.shape.items() if s > 1}
    if planned != live:
        raise ValueError(
            f"The plan was resolved for a mesh of {planned or 'one device'} but the block "
            f"is built on a mesh of {live or 'one device'}; its axis roles and weight "
            "placement describe the first. Resolve the plan on this mesh: "
            "selector.resolve(cfg, mesh)."
        )


def spec_entry(axes: tuple[str, ...]):
    """One PartitionSpec entry for a dim split over `axes`: None, one name, or a tuple."""
    return None if not axes else axes[0] if len(axes) == 1 else axes


@dataclass(frozen=True)
class Layout:
    """The plan's axis roles and weight placement on a live mesh: every PartitionSpec
    the layers use, and the collectives that move weights into the block.

    Only axes of size > 1 on this mesh appear (a size-1 axis splits nothing).

    Built by `Layout.from_plan(plan, mesh)`; `MoEBlock` holds one as `.layout`.

    Args:
      plan: the selector's DispatchPlan (axis roles and the weight placement).
      mesh: the live mesh it runs on.

    Returns:
      Its members: `x_BSM` (the tokens' spec), `weight_specs()` (each weight at rest),
      `batch`, `sequence`, `experts`, `embed`, `hidden`, `group` (mesh axes per role).

    Examples:
      On 8 simulated CPU devices (tests/conftest.py sets them up):
      >>> import jax, selector, layers
      >>> cfg = selector.compose(["model=tiny", "mesh=cpu_8", "ici_context_parallelism=4",
      ...                         "ici_fsdp_parallelism=2", "per_device_batch_size=0.25",
      ...                         "expert_exchange=all_to_all"])
      >>> plan = selector.resolve(cfg)
      >>> layout = layers.Layout.from_plan(plan, layers.mesh_for_plan(plan, jax.devices()[:8]))
      >>> layout.x_BSM  # tokens: batch over fsdp, sequence over context
      P('fsdp', 'context', None)
      >>> layout.weight_specs()["wi_0_EMH"]  # experts over the context group, embed over fsdp
      P('context', 'fsdp', None)
    """

    mesh: Mesh
    batch: tuple[str, ...]
    sequence: tuple[str, ...]
    experts: tuple[str, ...]  # expert dim at rest
    embed: tuple[str, ...]  # embedding dim at rest (gathered in the block)
    hidden: tuple[str, ...]  # hidden dim at rest and in the matmuls (summed over after)
    group: tuple[str, ...]  # expert group exchanging rows by all-to-all; () when gathered
    # The router's and shared experts' embedding dim at rest (embed, plus fsdp axes the
    # group folds in: they split the experts by expert, these weights by embedding).
    shared_embed: tuple[str, ...] = ()

    @classmethod
    def from_plan(cls, plan, mesh: Mesh) -> Layout:
        def keep(axes):
            return tuple(a for a in axes if mesh.shape.get(a, 1) > 1)

        view, placed = plan.mesh, plan.placement
        # At decode the sequence is one new token: the sequence axes (the decode axis
        # context_autoregressive, the only one allowed there) hold it repeated.
        splits_sequence = plan.per_device.seq_len > 1
        return cls(
            mesh,
            keep(view.batch_axes),
            keep(view.sequence_axes) if splits_sequence else (),
            keep(placed.experts_axes),
            keep(placed.embed_axes),
            keep(placed.hidden_axes),
            keep(placed.group_axes),
            keep(placed.shared_embed_axes),
        )

    @property
    def platform(self) -> str:
        """The platform of the mesh's devices ("tpu", "gpu", "cpu"; abstract devices of
        a compile target included), which chooses how kernels are built."""
        return self.mesh.devices.flat[0].platform

    @property
    def token_axes(self) -> tuple[str, ...]:
        """Axes that split the tokens: statistics are summed over exactly these."""
        return self.batch + self.sequence

    @property
    def repeated_axes(self) -> tuple[str, ...]:
        """Axes the weights rest on whose devices hold the same tokens (at decode, the
        sequence axes: the one new token is not split)."""
        tokens = set(self.token_axes)
        rest = dict.fromkeys((*self.experts, *self.embed, *self.shared_embed))
        return tuple(a for a in rest if a not in tokens)

    @property
    def gathered_experts(self) -> tuple[str, ...]:
        """Expert-dim axes the block all-gathers (none when the rows are exchanged)."""
        return tuple(a for a in self.experts if a not in self.group)

    def size(self, axes: tuple[str, ...]) -> int:
        return int(np.prod([self.mesh.shape[a] for a in axes], dtype=np.int64))

    # Activations.
    @property
    def x_BSM(self) -> P:
        return P(spec_entry(self.batch), spec_entry(self.sequence), None)

    @property
    def replicated(self) -> P:
        return P()

    def weight_spec(self, weight: Weight) -> P:
        """A weight's at-rest spec, from its roles in `layers.weights` (the axes this
        layout gives embed, experts and hidden); a weight whole everywhere is P()."""
        if not any(weight.at_rest):
            return P()
        return P(
            *(None if role is None else spec_entry(getattr(self, role)) for role in weight.at_rest)
        )

    def weight_specs(self) -> dict[str, P]:
        """At-rest spec per ExpertWeights field."""
        return {w.field: self.weight_spec(w) for w in WEIGHTS}

    def named(self, spec: P) -> NamedSharding:
        return NamedSharding(self.mesh, spec)

    def check_input(self, shape) -> None:
        """Clear errors for inputs the mesh cannot split evenly."""
        batch, seq = shape[0], shape[1]
        b, s = self.size(self.batch), self.size(self.sequence)
        if batch % b:
            raise ValueError(
                f"batch {batch} is not divisible by the {b} batch shards ({', '.join(self.batch)})"
            )
        if seq % s:
            raise ValueError(
                f"sequence {seq} is not divisible by cp={s} ({', '.join(self.sequence)})"
            )


def gather(x, axes: tuple[str, ...], dim: int, repeated: tuple[str, ...] = ()):
    """Inside shard_map: all-gather the `dim` of a shard over `axes` (in the order the
    PartitionSpec names them). Its transpose is a reduce-scatter, so a gradient comes
    back split exactly as the weight rests.

    `repeated` names axes whose devices hold the same tokens (the decode axis at
    decode): over those the gathered copy is typed invariant, so what is computed from
    it is too, and its transpose takes a slice instead of summing equal gradients. The
    axes are then gathered in runs from the minor end, which concatenates the shards in
    the same order as one gather over all of them."""
    if not axes:
        return x
    if not set(axes) & set(repeated):
        return jax.lax.all_gather(x, axes, axis=dim, tiled=True)
    runs: list[list[str]] = []
    for a in axes:
        if runs and (a in repeated) == (runs[-1][0] in repeated):
            runs[-1].append(a)
        else:
            runs.append([a])
    for run in reversed(runs):
        to = "invarying" if run[0] in repeated else "varying"
        x = jax.lax.all_gather(x, tuple(run), axis=dim, tiled=True, to=to)
    return x
