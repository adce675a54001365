"""Rules on the mesh and the per-device numbers derived from it."""

from __future__ import annotations

import math

from ..config import MESH_AXES, Config, Mode
from ..findings import Finding, error, fix, render_value, warning
from ..mesh import MeshView
from ..per_device import PerDevice, is_whole
from ..traits import traits
from .moves import ici_sizes, move


def fmt(x: float) -> str:
    """A count as the report prints it: whole numbers with separators, else exact."""
    return f"{round(x):,}" if is_whole(x) else f"{x:,.6g}"


def shown_axes(mesh: MeshView, axes) -> str:
    """`a=2 x b=4` for the axes of size > 1 (how findings name a set of axes)."""
    return " x ".join(f"{a}={mesh.size(a)}" for a in axes if mesh.size(a) > 1)


def _one_per_shard(cfg: Config, dev: PerDevice, note: str):
    """The per_device_batch_size that puts one sequence on each batch shard."""
    pdbs = dev.batch_shards / dev.num_devices
    return fix(note, per_device_batch_size=pdbs)


def global_batch_whole(cfg: Config, mesh: MeshView, dev: PerDevice) -> list[Finding]:
    if round(dev.global_batch) < 1:  # 1e-12 x 8 devices is "whole" to within rounding
        return [
            error(
                "GLOBAL_BATCH_EMPTY",
                "per_device_batch_size",
                f"per_device_batch_size={cfg.per_device_batch_size:g} x {dev.num_devices} "
                f"devices = {dev.global_batch:.3g} sequences: less than one sequence a step, "
                "so there is nothing to check. Give at least one sequence in all "
                f"(per_device_batch_size >= 1/{dev.num_devices}).",
                [_one_per_shard(cfg, dev, f"global batch {dev.batch_shards}, one per batch shard")],
            )
        ]
    if is_whole(dev.global_batch):
        return []
    whole = max(1, round(dev.global_batch)) / dev.num_devices
    return [
        error(
            "GLOBAL_BATCH_FRACTIONAL",
            "per_device_batch_size",
            # Exact where :g would round a near-whole product to a whole number.
            f"per_device_batch_size={render_value(cfg.per_device_batch_size)} x "
            f"{dev.num_devices} devices = {render_value(dev.global_batch)} sequences, not a "
            "whole number; per_device_batch_size "
            f"must be a multiple of 1/{dev.num_devices}.",
            [
                _one_per_shard(cfg, dev, f"global batch {dev.batch_shards}, one per batch shard"),
                fix(per_device_batch_size=whole),
            ],
        )
    ]


def batch_divides_shards(cfg: Config, mesh: MeshView, dev: PerDevice) -> list[Finding]:
    if not is_whole(dev.global_batch) or is_whole(dev.local_batch):
        return []
    gb, shards = round(dev.global_batch), dev.batch_shards
    per_shard = 1 if dev.cp * dev.replication > 1 else max(1, math.ceil(dev.local_batch))
    return [
        error(
            "BATCH_NOT_DIVISIBLE",
            "per_device_batch_size",
            f"The global batch of {gb} sequences does not divide over the {shards} batch "
            f"shards ({shown_axes(mesh, mesh.batch_axes) or '1'}): {dev.local_batch:g} sequences "
            "each, so XLA would pad or replicate without a word.",
            [
                fix(
                    f"global batch {per_shard * shards}",
                    per_device_batch_size=per_shard * shards / dev.num_devices,
                )
            ],
        )
    ]


def _sharing_axes(mesh: MeshView) -> list[str]:
    """Axes whose devices share one batch shard's sequences: the sequence axes split
    them, the others (tensor, ...) hold the same tokens."""
    return [a for a, s in mesh.sizes if s > 1 and a not in mesh.batch_axes]


def _remaps(cfg: Config, mesh: MeshView, dev: PerDevice) -> list:
    """Move `local batch` devices' worth from the sharing axes to a batch axis: the same
    global batch, one sequence per batch shard. To fsdp (the weights stay split over
    those devices) and to data (they are replicated there); ranked later by what a
    device then holds."""
    remaining = round(dev.local_batch)
    new = {}
    for axis in sorted(_sharing_axes(mesh), key=mesh.size, reverse=True):
        g = math.gcd(remaining, mesh.size(axis))
        if g > 1:
            new[axis] = mesh.size(axis) // g
            remaining //= g
    if remaining != 1:
        return []
    fixes = []
    for to in (a for a in ("fsdp", "data") if a in mesh.batch_axes):
        overrides = move(cfg, mesh, new, to=to)
        if overrides:
            fixes.append(
                fix(
                    f"the same global batch of {fmt(dev.global_batch)}, one sequence per "
                    f"batch shard, the devices moved to {to}",
                    **dict(overrides),
                )
            )
    return fixes


def local_batch_inflation(cfg: Config, mesh: MeshView, dev: PerDevice) -> list[Finding]:
    sharing = dev.cp * dev.replication
    if cfg.mode is Mode.decode or sharing <= 1 or dev.local_batch <= 1 + 1e-9:
        return []
    if not is_whole(dev.local_batch):
        return []  # reported by batch_divides_shards
    cp_axes = shown_axes(mesh, mesh.sequence_axes)
    others = shown_axes(mesh, [a for a in _sharing_axes(mesh) if a not in mesh.sequence_axes])
    why = []
    if cp_axes:
        why.append(f"context parallelism cp={dev.cp} ({cp_axes}) splits each sequence")
    if others:
        why.append(f"{others} keeps the same tokens on its devices")
    fixes = _remaps(cfg, mesh, dev)
    new_gb = dev.global_batch / dev.local_batch
    fixes.append(
        fix(
            f"changes the global batch from {fmt(dev.global_batch)} to {fmt(new_gb)} sequences",
            per_device_batch_size=cfg.per_device_batch_size / dev.local_batch,
        )
    )
    severity = warning if cfg.allow_local_batch_inflation else error
    text = " and ".join(why)
    return [
        severity(
            "LOCAL_BATCH_INFLATION",
            "per_device_batch_size",
            f"{text[0].upper()}{text[1:]}, but with per_device_batch_size="
            f"{cfg.per_device_batch_size:g} the global batch of {fmt(dev.global_batch)} "
            f"sequences over {dev.batch_shards} batch shards puts {fmt(dev.local_batch)} "
            f"sequences on each shard: every device holds {fmt(dev.tokens_per_device)} "
            f"tokens, {fmt(dev.local_batch)}x what one sequence per batch shard gives. Raising "
            "those axes at a fixed per_device_batch_size grew the local batch instead of "
            "shrinking what a device holds.",
            fixes,
            "Or accept it knowingly with allow_local_batch_inflation=true.",
        )
    ]


def sequence_divides_cp(cfg: Config, mesh: MeshView, dev: PerDevice) -> list[Finding]:
    if cfg.mode is Mode.decode or dev.cp <= 1:
        return []
    seq = cfg.max_target_length
    balance = cfg.context_parallel_load_balance
    unit = 2 * dev.cp if balance else dev.cp
    if seq % unit == 0:
        return []
    down = seq - seq % unit
    lengths = [fix(max_target_length=n) for n in (down, down + unit) if n > 0]
    if seq % dev.cp:
        return [
            error(
                "SEQUENCE_NOT_DIVISIBLE",
                "max_target_length",
                f"max_target_length={seq} is not divisible by cp={dev.cp}, so the sequence "
                "cannot be split evenly over the sequence shards"
                + (
                    f" (and context_parallel_load_balance=true needs a multiple of {unit})"
                    if balance
                    else ""
                )
                + ".",
                lengths,
            )
        ]
    return [
        error(
            "SEQUENCE_NOT_DIVISIBLE_LOAD_BALANCE",
            "max_target_length",
            f"context_parallel_load_balance=true splits each sequence into 2 x cp = "
            f"{unit} chunks, but max_target_length={seq} is not divisible by {unit}.",
            [*lengths, fix(context_parallel_load_balance=False)],
        )
    ]


# (finding code, dimension setting, axis-rules role, mesh-view attribute)
WEIGHT_DIVISIBILITY = (
    ("EXPERTS_NOT_DIVISIBLE", "num_experts", "experts", "expert_axes"),
    ("HIDDEN_NOT_DIVISIBLE", "base_moe_mlp_dim", "hidden", "hidden_axes"),
    ("EMBED_NOT_DIVISIBLE", "base_emb_dim", "embed", "embed_axes"),
)


def weights_divide_axes(cfg: Config, mesh: MeshView, dev: PerDevice) -> list[Finding]:
    """Each weight dimension must split evenly over the axes it rests sharded on."""
    findings = []
    for code, dim, role, attr in WEIGHT_DIVISIBILITY:
        axes = [a for a in getattr(mesh, attr) if mesh.size(a) > 1]
        shards, size = mesh.product(axes), getattr(cfg, dim)
        if size % shards == 0:
            continue
        keep, product = [], 1
        for a in axes:
            if size % (product * mesh.size(a)) == 0:
                keep.append(a)
                product *= mesh.size(a)
        fixes = [fix("weights rest unsplit over the others", **{f"axis_rules__{role}": keep})]
        if len(axes) == 1:
            # The axis shrinks to the largest size both it and the dimension divide; its
            # freed devices go where the weights stay split (fsdp shards their embed dim),
            # or to data, which replicates them (the fixes are ranked by what a device
            # then holds).
            axis = axes[0]
            smaller = math.gcd(size, mesh.size(axis))
            for to in ("fsdp", "data") if role != "embed" else ("data",):
                moved = move(cfg, mesh, {axis: smaller}, to=to) if to != axis else None
                if moved:
                    fixes.append(fix(f"{axis}={smaller}, its other devices to {to}", **dict(moved)))
        findings.append(
            error(
                code,
                f"axis_rules.{role}",
                f"{dim}={size} is not divisible by the {shards} shards "
                f"({shown_axes(mesh, axes)}) the weights rest on.",
                fixes,
            )
        )
    return findings


def tokens_replicated(cfg: Config, mesh: MeshView, dev: PerDevice) -> list[Finding]:
    """Axes that split neither the tokens nor the expert hidden dim: pure repetition.
    (A hidden axis such as tensor splits every expert matmul; only the router repeats.)"""
    axes = [a for a in mesh.replicating_axes if a not in mesh.hidden_axes]
    if not axes or cfg.mode is Mode.decode:
        return []
    # Either fix makes those axes batch axes; a global batch the new shards do not
    # divide gets its batch from the fix search (plan._with_batch_fix).
    fixes = [fix(**{"axis_rules__batch": [*mesh.batch_axes, *axes]})]
    moved = move(cfg, mesh, {a: 1 for a in axes if mesh.size(a) > 1})
    if moved:
        fixes.append(fix("moves the devices to data", **dict(moved)))
    return [
        warning(
            "TOKENS_REPLICATED",
            "axis_rules.batch",
            f"{shown_axes(mesh, axes)} splits neither the tokens (batch, sequence) nor the expert "
            f"hidden dim, so {dev.replication} devices hold the same "
            f"{fmt(dev.tokens_per_device)} tokens and repeat all of the block's work.",
            fixes,
        )
    ]


def _knob_of(cfg: Config, axis: str) -> str:
    for tier in ("ici", "dcn"):
        if cfg.parallelism(tier, axis) not in (1,):
            return f"{tier}_{axis}_parallelism"
    return f"ici_{axis}_parallelism"


# MaxText's decode axis: MaxText 0.2.5's layers/moe.py splits its inference routing by
# this axis's size, and it is described as the axis that shards the KV cache at decode;
# base.yml's logical rules name it in no cache rule (read, not run). The MoE block sees
# one new token per sequence, so on it this axis can only repeat the token or, by the
# axis rules, split the batch.
DECODE_AXIS = "context_autoregressive"


def decode_context(cfg: Config, mesh: MeshView, dev: PerDevice) -> list[Finding]:
    """At decode a sequence axis cannot split the one new token: an error for the
    training-time context axes, a warning for the decode axis (it is MaxText's axis for
    decode, and only the MoE block's copy of the token is repeated on it)."""
    if cfg.mode is not Mode.decode or dev.cp <= 1:
        return []
    axes = [a for a in mesh.sequence_axes if mesh.size(a) > 1]
    findings = []
    if DECODE_AXIS in axes:
        findings += _decode_token_repeated(cfg, mesh, dev)
        axes.remove(DECODE_AXIS)
    if not axes:
        return findings
    cp = mesh.product(axes)
    knobs = ", ".join(f"{_knob_of(cfg, a)}={mesh.size(a)}" for a in axes)
    moved = move(cfg, mesh, {a: 1 for a in axes})
    fixes = []
    if moved:  # a batch the new shards do not divide: the fix search completes it
        fixes.append(fix("moves the sequence devices to data", **dict(moved)))
    # Or to MaxText's decode axis: the cache stays split as it was, and the MoE block's
    # copy of the token is repeated there (DECODE_TOKEN_REPEATED says how to split it).
    kept = move(cfg, mesh, {a: 1 for a in axes}, to=DECODE_AXIS)
    if kept:
        fixes.append(fix(f"moves the sequence devices to {DECODE_AXIS}", **dict(kept)))
    return findings + [
        error(
            "DECODE_CONTEXT_PARALLEL",
            _knob_of(cfg, axes[0]),
            f"mode=decode feeds one token per sequence, which cp={cp} ({knobs}) cannot "
            f"split: the MoE block's sequence shards would each hold the same token. At "
            f"decode, {DECODE_AXIS} is MaxText's axis for decode.",
            fixes,
        )
    ]


def _decode_token_repeated(cfg: Config, mesh: MeshView, dev: PerDevice) -> list[Finding]:
    """The decode axis leaves the MoE block's token repeated on its devices unless the
    batch rule names it too."""
    size = mesh.size(DECODE_AXIS)
    knob = _knob_of(cfg, DECODE_AXIS)
    fixes = []
    if is_whole(dev.global_batch / (dev.batch_shards * size)):
        fixes.append(
            fix(
                "the MoE block splits the batch over the decode axis; attention keeps it",
                axis_rules__batch=[*mesh.batch_axes, DECODE_AXIS],
                axis_rules__sequence=[a for a in mesh.sequence_axes if a != DECODE_AXIS],
            )
        )
    return [
        warning(
            "DECODE_TOKEN_REPEATED",
            "axis_rules.batch",
            f"{knob}={size} is MaxText's decode axis, but the MoE block gets one new "
            f"token per sequence, so its {size} devices each route and compute the same "
            f"{fmt(dev.tokens_per_device)} token(s). Naming {DECODE_AXIS} in "
            "axis_rules.batch splits the batch over them in the MoE block"
            + (
                "."
                if fixes
                else f" (the global batch of {fmt(dev.global_batch)} would "
                f"need to divide over {dev.batch_shards * size} shards)."
            ),
            fixes,
        )
    ]


def gpu_hosts_in_one_slice(cfg: Config, mesh: MeshView, dev: PerDevice) -> list[Finding]:
    """On GPUs a slice is one host: its GPUs (`Traits.host_devices`) share NVLink, and hosts talk
    over the network. A config slice of more GPUs prices every collective among them at
    NVLink's bandwidth (`hardware.ici_bandwidth_gbps`), which the hosts do not have, so
    the exchange and the weights' gathers are priced as if they were local."""
    host = traits(cfg.hardware.platform).host_devices
    per_slice = mesh.num_devices // max(cfg.num_slices, 1)
    if not host or mesh.source != "config" or per_slice <= host:
        return []
    hosts = per_slice // host if per_slice % host == 0 else 0
    ici = ici_sizes(mesh)
    fixes = []
    # The axis that spans the hosts: fsdp (the weights split over them) or data (repeated
    # there) first, else any other whose devices fill whole hosts.
    spans = [a for a in ("fsdp", "data", *MESH_AXES) if hosts and ici[a] % hosts == 0]
    for axis in dict.fromkeys(spans):
        if len(fixes) == 2:
            break
        tiers = {
            "dcn": {a: mesh.dcn_product((a,)) * (hosts if a == axis else 1) for a in MESH_AXES},
            "ici": {a: n // hosts if a == axis else n for a, n in ici.items()},
        }
        # Every size written out where the knob differs (a -1 fill would fill anew).
        knobs = {
            f"{tier}_{a}_parallelism": n
            for tier, sizes in tiers.items()
            for a, n in sizes.items()
            if cfg.parallelism(tier, a) != n
        }
        fixes.append(
            fix(
                f"{hosts * cfg.num_slices} slices of {host} GPUs, {axis} across them",
                num_slices=cfg.num_slices * hosts,
                **knobs,
            )
        )
    return [
        warning(
            "GPU_HOSTS_IN_ONE_SLICE",
            "num_slices",
            f"num_slices={cfg.num_slices} puts {per_slice} {cfg.hardware.name} GPUs in a "
            f"slice, but a host holds {host}: the {math.ceil(per_slice / host)} "
            "hosts of each slice talk over the network, while every collective here is "
            "priced at NVLink's "
            f"{cfg.hardware.ici_bandwidth_gbps:g} GB/s. Spell the hosts as slices (the dcn "
            "axes say which collectives cross them) for times the network allows.",
            fixes,
            no_fix=f"No fix is offered: {per_slice} GPUs a slice are not whole hosts of "
            f"{host}; set num_slices to the hosts."
            if not hosts
            else f"No fix is offered: no mesh axis has a multiple of {hosts} devices in a "
            "slice to span the hosts; set num_slices and the dcn_*_parallelism sizes "
            "that match your hosts.",
        )
    ]


LAYOUT_RULES = (
    global_batch_whole,
    batch_divides_shards,
    local_batch_inflation,
    sequence_divides_cp,
    weights_divide_axes,
    tokens_replicated,
    decode_context,
    gpu_hosts_in_one_slice,
)
