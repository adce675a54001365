"""Read collectives out of compiled HLO text, and tell weight traffic from activations."""

from __future__ import annotations

import math
import re
from collections.abc import Iterable

COLLECTIVES = (
    "all-gather",
    "all-reduce",
    "all-to-all",
    "collective-permute",
    "reduce-scatter",
    "ragged-all-to-all",
)
_OP = re.compile(
    r"=\s*(?P<shapes>\(.*?\)|\S+)\s+(?P<op>"
    + "|".join(COLLECTIVES)
    + r")(-start)?\((?P<args>[^)]*)"
)
_SHAPE = re.compile(r"(?P<dtype>[a-z]+\d*)\[(?P<dims>[\d,]*)\]")


def collectives(hlo_text: str) -> list[tuple[str, list[tuple[int, ...]]]]:
    """(op, result shapes) for every collective in the program."""
    found = []
    for line in hlo_text.splitlines():
        m = _OP.search(line)
        if m:
            shapes = [
                tuple(int(d) for d in s.group("dims").split(",") if d)
                for s in _SHAPE.finditer(m.group("shapes"))
            ]
            found.append((m.group("op"), shapes))
    return found


def weight_stage_shapes(
    full: tuple[int, ...], shards_by_stage: Iterable[tuple[int, ...]]
) -> set[tuple[int, ...]]:
    """The shapes a weight takes on its way into the block: `full` divided elementwise
    by each stage's per-dimension shard counts (at rest, part gathered, in compute)."""
    return {tuple(d // s for d, s in zip(full, stage, strict=True)) for stage in shards_by_stage}


def classify(
    hlo_text: str,
    weight_shapes: set[tuple[int, ...]],
    local_elems: int,
    global_tokens: int,
) -> dict[str, list[str]]:
    """Sort every collective into `weights` (each of its shapes is one a weight takes: a
    gather into the block, a gradient reduce-scatter or all-reduce), `activations` (big:
    at least `local_elems` elements over all its results, since XLA may split one
    collective into a tuple of pieces, or a dimension spanning the global token count)
    and `small` (statistics, counts, scalars)."""
    out: dict[str, list[str]] = {"weights": [], "activations": [], "small": []}
    for op, shapes in collectives(hlo_text):
        if not shapes:
            continue
        label = f"{op} {' '.join(str(list(s)) for s in shapes)}"
        if all(shape in weight_shapes for shape in shapes):
            out["weights"].append(label)
        elif sum(math.prod(s) for s in shapes) >= local_elems or any(
            global_tokens in s for s in shapes
        ):
            out["activations"].append(label)
        else:
            out["small"].append(label)
    return out


_DEF = re.compile(
    r"^\s*(ROOT\s+)?%(?P<name>[\w.\-]+)\s*=\s*(?P<dtype>[a-z]+\d*)\[(?P<dims>[\d,]*)\]"
)
_DOT = re.compile(r"\bdot\(%(?P<lhs>[\w.\-]+),")
_CONTRACT = re.compile(r"lhs_contracting_dims=\{(?P<dims>[\d,]*)\}")


def value_shapes(hlo_text: str) -> dict[str, tuple[int, ...]]:
    """The shape of every value the program defines, by name."""
    shapes = {}
    for line in hlo_text.splitlines():
        m = _DEF.match(line)
        if m:
            shapes[m.group("name")] = tuple(int(d) for d in m.group("dims").split(",") if d)
    return shapes


def dot_flops(hlo_text: str, scope: str) -> float:
    """2 x output elements x contracted size, summed over the `dot` instructions whose
    op_name carries the named scope `scope` (e.g. "expert_compute")."""
    shapes = value_shapes(hlo_text)
    total = 0.0
    for line in hlo_text.splitlines():
        dot, out, contract = _DOT.search(line), _DEF.match(line), _CONTRACT.search(line)
        if not (dot and out and contract) or f"/{scope}/" not in line:
            continue
        lhs = shapes[dot.group("lhs")]
        contracted = math.prod(lhs[int(d)] for d in contract.group("dims").split(",") if d)
        total += 2 * math.prod(shapes[out.group("name")]) * contracted
    return total


_GATHER = re.compile(
    r"%(?P<name>[\w.\-]+) = [a-z]+\d*\[(?P<dims>[\d,]+)\]\{(?P<layout>[\d,]+)[^}]*\} "
    r"all-gather(?:-done)?\((?P<args>[^)]*)\)(?P<rest>.*)$"
)
_VALUE = re.compile(
    r"%(?P<name>[\w.\-]+) = [a-z]+\d*\[(?P<dims>[\d,]*)\]\{(?P<layout>[\d,]+)[^}]*\} "
)


def relaid_gathers(hlo_text: str) -> set[int]:
    """The dims along which the program all-gathers a 3-D array and then copies the
    result into another layout (a value of the same shape whose minor-to-major order
    differs from the gather's): what a compiler does to gather a non-major dim of a
    weight."""
    lines = hlo_text.splitlines()
    starts = {}  # an all-gather-start's name -> its gathered dim (read off its line)
    for line in lines:
        m = re.search(r"%([\w.\-]+) = \(.*\) all-gather-start\(.*dimensions=\{(\d+)\}", line)
        if m:
            starts[m.group(1)] = int(m.group(2))
    found = set()
    for line in lines:
        m = _GATHER.search(line.strip())
        if not m or m.group("dims").count(",") != 2:
            continue
        dim = re.search(r"dimensions=\{(\d+)\}", line)
        if dim:
            gathered = int(dim.group(1))
        else:  # an all-gather-done names its start, which names the dim
            gathered = starts.get(m.group("args").strip().lstrip("%"))
        if gathered is None:
            continue
        use = re.compile(r"[(,]\s*%" + re.escape(m.group("name")) + r"[),]")
        for other in lines:
            user = _VALUE.search(other.strip())
            if (
                user
                and use.search(other)
                and user.group("dims") == m.group("dims")
                and user.group("layout") != m.group("layout")
            ):
                found.add(gathered)
    return found


# An instruction with one array result: `_VALUE`'s name, dims and layout, and its opcode.
_ARRAY = re.compile(r"^\s*(?:ROOT )?" + _VALUE.pattern + r"(?P<op>[\w\-]+)\(")


def _computations(hlo_text: str) -> dict[str, list[str]]:
    """{computation name: its instruction lines}; the entry computation as "ENTRY"."""
    out: dict[str, list[str]] = {}
    name = None
    for line in hlo_text.splitlines():
        if line and not line[0].isspace() and line.rstrip().endswith("{"):
            name = "ENTRY" if line.startswith("ENTRY") else line.split()[0].lstrip("%")
            out[name] = []
        elif name and line.startswith("  "):
            out[name].append(line)
    return out


def _physical(value: re.Match) -> list[int]:
    """An array's dim sizes in memory order, minor first."""
    sizes = [int(d) for d in value.group("dims").split(",") if d]
    return [sizes[int(d)] for d in value.group("layout").split(",") if d]


def activation_copies(hlo_text: str, elements: dict[int, str]) -> dict[tuple[str, str], int]:
    """The copies into another layout that the entry computation makes of arrays of the
    sizes in `elements` ({element count: what it is}), itself or inside the fusions it
    calls (a fusion may compute a value and write it transposed): each `copy` whose
    result is laid out otherwise than its source (its operand, or the operand of the
    `transpose` it copies) in another order in memory. {(what, "keep" or "change"): how
    many}, "change" where the copy's physically minor dim is not its source's. Dims are
    told apart by size, so the shapes read should have distinct dims."""
    comps = _computations(hlo_text)
    entry = comps.get("ENTRY", [])
    called = {c for line in entry for c in re.findall(r"calls=%([\w.\-]+)", line)}
    found: dict[tuple[str, str], int] = {}
    for name in ["ENTRY", *sorted(called)]:
        values = {m.group("name"): m for m in map(_ARRAY.match, comps.get(name, [])) if m}
        for line in comps.get(name, []):
            m = _ARRAY.match(line)
            if not m or m.group("op") != "copy":
                continue
            n = math.prod(int(d) for d in m.group("dims").split(",") if d)
            arg = re.search(r"copy\(%([\w.\-]+)\)", line)
            src = values.get(arg.group(1)) if arg else None
            if n not in elements or src is None:
                continue
            if src.group("op") == "transpose":
                inner = re.search(r"transpose\(%([\w.\-]+)\)", src.string)
                src = values.get(inner.group(1)) if inner else None
                if src is None:
                    continue
            if _physical(src) == _physical(m):
                continue  # the same order in memory: nothing moves
            same = _physical(src)[:1] == _physical(m)[:1]
            key = (elements[n], "keep" if same else "change")
            found[key] = found.get(key, 0) + 1
    return found
