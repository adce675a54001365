"""Whether MaxText can lay its mesh on a TPU slice's torus.

MaxText 0.2.5's `create_device_mesh` (utils/maxtext_utils.py) builds a single slice's mesh
with `jax.experimental.mesh_utils.create_device_mesh`, which on TPU maps each logical mesh
axis onto whole physical axes of the slice's torus, from the last of MaxText's
`mesh_axes` to the first, each to the most physical axes whose sizes multiply to it
(JAX's `_create_device_mesh_for_nd_torus`, read in jax 0.10.2). Unless
`allow_split_physical_axes` is true, an axis that finds no such subset stops the run at
start-up with NotImplementedError: on 64 v5p chips (4x4x4) a context axis of 2 beside
fsdp 32 (MaxText's own train_compile stopped there for DeepSeek-V3, ahead of time on a
CPU machine), where context 4 beside fsdp 16 lays out. v5p's 2x2x2 slice has an
ordering of its own that takes any shape, and v5e/v6e slices have their own orderings:
only v5p slices of more than 8 chips are checked.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

from ..config import Config
from ..findings import Finding, error, fix
from ..mesh import MeshView
from ..targets import torus
from .files import coerce

# MaxText 0.2.5's base.yml mesh_axes, used when a config does not list its own.
MAXTEXT_MESH_AXES = (
    "diloco",
    "data",
    "stage",
    "fsdp",
    "fsdp_transpose",
    "context",
    "context_usp_ulysses",
    "context_autoregressive",
    "tensor",
    "tensor_sequence",
    "expert",
    "autoregressive",
)


def unassigned_axis(logical: Sequence[int], physical: Sequence[int]) -> int | None:
    """The index of the first logical axis (in JAX's order, last axis first) that no
    subset of the physical axes left can give, or None when every one is given. Each
    axis takes, of the subsets whose sizes multiply to it, the first with the most axes,
    as JAX's `_create_device_mesh_for_nd_torus` picks them."""
    left = list(physical)
    for index in reversed(range(len(logical))):
        size = logical[index]
        for count in range(len(left), 0, -1):
            subset = next(
                (
                    picked
                    for picked in itertools.combinations(range(len(left)), count)
                    if math.prod(left[i] for i in picked) == size
                ),
                None,
            )
            if subset is not None:
                left = [0 if i in subset else s for i, s in enumerate(left)]
                break
        else:
            if size > 1:
                return index
    return None


def _ici_sizes(raw: dict, mesh: MeshView, axes) -> tuple[list[str], list[int]]:
    """MaxText's mesh axes and each one's size within a slice, as the check resolved
    them. An axis it does not model counts as 1 (MAXTEXT_AXIS_NOT_MODELLED names one set
    above 1, and the sizes then fall short of the slice, which is not checked here)."""
    names = [str(a) for a in axes or raw.get("mesh_axes") or MAXTEXT_MESH_AXES]
    modelled, dcn = dict(mesh.sizes), dict(mesh.dcn_sizes)
    return names, [modelled.get(n, 1) // dcn.get(n, 1) for n in names]


def mesh_not_on_torus(raw: dict, cfg: Config, mesh: MeshView | None, axes=None) -> list[Finding]:
    """MAXTEXT_MESH_NOT_ON_TORUS when MaxText could not lay the mesh on a v5p slice.
    `axes`: the mesh_axes a custom_mesh_and_rule file gives, which replace the config's."""
    split = coerce("allow_split_physical_axes", raw.get("allow_split_physical_axes", False), bool)
    if mesh is None or cfg.hardware.name != "v5p" or split:
        return []  # a mesh that does not resolve is reported by the mesh's own finding
    chips = mesh.num_devices // max(cfg.num_slices, 1)
    if chips <= 8 or chips & (chips - 1):
        return []
    physical = torus("v5p", chips)
    names, sizes = _ici_sizes(raw, mesh, axes)
    if math.prod(sizes) != chips:
        return []  # a mesh that does not fill the slice is an error of its own
    index = unassigned_axis(sizes, physical)
    if index is None:
        return []
    shape = "x".join(map(str, physical))
    placed = ", ".join(f"{n}={s}" for n, s in zip(names, sizes, strict=True) if s > 1)
    return [
        error(
            "MAXTEXT_MESH_NOT_ON_TORUS",
            f"ici_{names[index]}_parallelism",
            f"MaxText cannot lay this mesh on a {chips}-chip v5p slice ({shape}): "
            f"{names[index]}={sizes[index]} is not the product of whole physical axes left "
            f"once the axes after it in mesh_axes are placed ({placed}), so its "
            "create_device_mesh stops at start-up with NotImplementedError (MaxText 0.2.5's "
            "train_compile did, for v5p-128 with context 2 beside fsdp 32). Let it split a "
            "physical axis (fewer links for that axis), or choose sizes that are products "
            "of the slice's axes.",
            [fix("MaxText splits a physical axis", allow_split_physical_axes=True)],
        )
    ]
