"""Read collectives out of compiled HLO text."""

from __future__ import annotations

import math
import re

COLLECTIVES = ("all-gather", "all-reduce", "all-to-all", "collective-permute", "reduce-scatter")
_OP = re.compile(r"=\s*(?P<shapes>\(.*?\)|\S+)\s+(?P<op>" + "|".join(COLLECTIVES) + r")(-start)?\(")
_SHAPE = re.compile(r"[a-z]+\d*\[([\d,]*)\]")


def collectives(hlo_text: str) -> list[tuple[str, list[tuple[int, ...]]]]:
    """(op, result shapes) for every collective in the program."""
    found = []
    for line in hlo_text.splitlines():
        m = _OP.search(line)
        if m:
            shapes = [
                tuple(int(d) for d in dims.split(",") if d)
                for dims in _SHAPE.findall(m.group("shapes"))
            ]
            found.append((m.group("op"), shapes))
    return found


def activation_sized(
    hlo_text: str, local_elems: int, global_tokens: int, param_shapes: set[tuple[int, ...]]
) -> list[str]:
    """Collectives moving activation-sized data, other than parameter-gradient reductions.

    Activation-sized: at least `local_elems` elements (local tokens x emb), or a dimension
    spanning the global token count.
    """
    bad = []
    for op, shapes in collectives(hlo_text):
        for shape in shapes:
            big = math.prod(shape) >= local_elems or global_tokens in shape
            if big and not (op == "all-reduce" and shape in param_shapes):
                bad.append(f"{op} {list(shape)}")
    return bad
