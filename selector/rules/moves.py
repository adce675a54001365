"""Fixes that move devices between mesh axes and keep the device count.

A fix that shrinks one axis must give its devices to another (or the mesh no longer
covers the machine): they go to `data`, and every ici knob is written explicitly so no
`-1` fill has to be recomputed. Only the ici tier is changed; a mesh read from a live
jax mesh cannot be changed by a setting, so no move is proposed there.
"""

from __future__ import annotations

from fractions import Fraction

from ..config import MESH_AXES, Config
from ..mesh import MeshView


def ici_sizes(mesh: MeshView) -> dict[str, int] | None:
    """Each axis's resolved ici size (the mesh size over its dcn size); None for a live
    mesh, which no setting changes."""
    if mesh.source != "config":
        return None
    return {a: mesh.size(a) // mesh.dcn_product((a,)) for a in MESH_AXES}


def move(cfg: Config, mesh: MeshView, new: dict[str, int], to: str = "data"):
    """Overrides setting ici sizes `new` (axis -> size) with the devices freed or needed
    taken up by `to`; None when that cannot be done in whole devices."""
    ici = ici_sizes(mesh)
    if ici is None:
        return None
    ratio = Fraction(1)
    for axis, size in new.items():
        if size < 1:
            return None
        ratio *= Fraction(ici[axis], size)
    target = dict(ici, **new)
    if to not in new:
        grown = ici[to] * ratio
        if grown.denominator != 1 or grown < 1:
            return None
        target[to] = int(grown)
    overrides = []
    for axis in MESH_AXES:
        knob = f"ici_{axis}_parallelism"
        if getattr(cfg, knob) != target[axis]:
            overrides.append((knob, target[axis]))
    return tuple(overrides)
