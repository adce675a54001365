"""MaxText's ahead-of-time target (`compile_topology`, `compile_topology_num_slices`)
as the chip and device count the check prices.

TPU topology names count TensorCores: a v4 or v5p chip has two (v5p-16 is 8 chips),
a v5e or v6e chip one (MaxText 0.2.5's accelerator_to_spec_map, read, not run)."""

from __future__ import annotations

import re

from .files import MaxTextError

# family in the name -> (our hardware preset, TensorCores a chip)
FAMILIES = {"v5p": ("v5p", 2), "v5e": ("v5e", 1), "v5litepod": ("v5e", 1), "v6e": ("v6e", 1)}


def topology_target(raw: dict) -> tuple[str, int, int] | None:
    """(chip preset, chips a slice, slices) named by compile_topology, or None when it
    is unset (MaxText's default '')."""
    name = str(raw.get("compile_topology", "") or "").strip()
    if not name:
        return None
    match = re.fullmatch(r"([a-z0-9]+)-(\d+)", name)
    if match is None or match.group(1) not in FAMILIES:
        raise MaxTextError(
            f"compile_topology={name!r} is not a TPU slice this check prices; name one as "
            f"MaxText does, e.g. v5p-128 (64 chips), v5e-256 or v6e-256 "
            f"({', '.join(FAMILIES)}), or drop it and set num_devices= and chip=."
        )
    chip, cores = FAMILIES[match.group(1)]
    count = int(match.group(2))
    if count % cores:
        raise MaxTextError(
            f"compile_topology={name!r}: {match.group(1)} names count TensorCores, {cores} a "
            f"chip, so the count must be a multiple of {cores} (v5p-16 is 8 chips)."
        )
    slices = int(raw.get("compile_topology_num_slices", -1) or -1)
    return chip, count // cores, max(slices, 1)
