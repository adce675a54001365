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


def make_mesh(sizes: Mapping[str, int], devices=None) -> Mesh:
    """A mesh with auto axis types; `sizes` maps axis names (selector spelling) to sizes."""
    names = tuple(sizes)
    shape = tuple(int(sizes[n]) for n in names)
    devices = jax.devices() if devices is None else devices
    n = int(np.prod(shape))
    if n > len(devices):
        raise ValueError(f"mesh {dict(sizes)} needs {n} devices; only {len(devices)} exist")
    grid = np.asarray(devices[:n], dtype=object).reshape(shape)
    return Mesh(grid, names, axis_types=(AxisType.Auto,) * len(names))


def mesh_for_plan(plan, devices=None) -> Mesh:
    """The mesh a plan resolved from config describes (every selector axis, auto types)."""
    return make_mesh(dict(plan.mesh.sizes), devices)


def _entry(axes: tuple[str, ...]):
    return None if not axes else axes[0] if len(axes) == 1 else axes


@dataclass(frozen=True)
class Layout:
    """Axis roles restricted to the axes the mesh has (a missing axis counts as size 1)."""

    mesh: Mesh
    batch: tuple[str, ...]
    sequence: tuple[str, ...]
    experts: tuple[str, ...]
    hidden: tuple[str, ...]
    embed: tuple[str, ...]

    @classmethod
    def from_plan(cls, plan, mesh: Mesh) -> Layout:
        present = set(mesh.axis_names)

        def keep(axes):
            return tuple(a for a in axes if a in present)

        view = plan.mesh
        return cls(
            mesh,
            keep(view.batch_axes),
            keep(view.sequence_axes),
            keep(view.expert_axes),
            keep(view.hidden_axes),
            keep(view.embed_axes),
        )

    @property
    def token_axes(self) -> tuple[str, ...]:
        """Axes that split the tokens: statistics are summed over exactly these."""
        return self.batch + self.sequence

    def size(self, axes: tuple[str, ...]) -> int:
        return int(np.prod([self.mesh.shape[a] for a in axes], dtype=np.int64))

    # Activations.
    @property
    def x_BSM(self) -> P:
        return P(_entry(self.batch), _entry(self.sequence), None)

    @property
    def replicated(self) -> P:
        return P()

    # Weights at rest (MaxText: gate (embed, None); wi (exp, embed, mlp); wo (exp, mlp, embed)).
    @property
    def gate_ME(self) -> P:
        return P(_entry(self.embed), None)

    @property
    def w_EMH(self) -> P:
        return P(_entry(self.experts), _entry(self.embed), _entry(self.hidden))

    @property
    def w_EHM(self) -> P:
        return P(_entry(self.experts), _entry(self.hidden), _entry(self.embed))

    def param_specs(self) -> dict[str, P]:
        return {
            "gate.kernel": self.gate_ME,
            "wi_0": self.w_EMH,
            "wi_1": self.w_EMH,
            "wo": self.w_EHM,
        }

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
