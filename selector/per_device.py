"""Per-device numbers derived from the config and the mesh view (MaxText's batch rule)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from .config import CapacityRounding, Config, Mode
from .mesh import MeshView

_EPS = 1e-9


def is_whole(x: float) -> bool:
    return abs(x - round(x)) < _EPS * max(1.0, abs(x))


@dataclass(frozen=True)
class PerDevice:
    """What one device holds in the MoE block for one step.

    global_batch is MaxText's per_device_batch_size x num_devices; the local batch is the
    sequences each batch shard holds; the sequence is split cp ways; `replication` counts
    devices that hold the same tokens (axes that shard neither batch nor sequence).
    """

    num_devices: int
    batch_shards: int
    cp: int
    replication: int
    global_batch: float
    local_batch: float
    seq_len: int  # tokens per sequence in this step (1 when decoding)
    sub_seq: float
    tokens_per_device: float
    capacity_per_subgroup: int | None  # None when dropless (capacity_factor <= 0)
    expected_tokens_per_expert: float  # per subgroup, under uniform routing
    gmm_rows: float  # tokens x k: rows of the grouped matmul per device

    def as_dict(self) -> dict:
        return asdict(self)


def capacity(
    sub_seq: float,
    k: int,
    num_experts: int,
    capacity_factor: float,
    rounding: CapacityRounding = CapacityRounding.ours,
) -> int | None:
    """Per-subgroup expert capacity; None when dropless (capacity_factor <= 0).

    ours: max(1, ceil(sub_seq k / E x cf)). maxtext (MaxText 0.2.5's
    generate_masks_subgroup): int(max(ceil(sub_seq k / E) x cf, cf)), which truncates,
    so it can be 0 (every assignment dropped) when cf < 1.
    """
    if capacity_factor <= 0:
        return None
    # An expert can take at most every token of a subgroup (a token's k choices are
    # distinct experts): a larger capacity holds nothing more, and a huge factor would
    # overflow the count.
    most = max(1, math.ceil(sub_seq - _EPS))
    if rounding is CapacityRounding.maxtext:
        per_expert = math.ceil(sub_seq * k / num_experts - _EPS)
        wanted = max(per_expert * capacity_factor, capacity_factor)
        return int(min(wanted, most))
    wanted = sub_seq * k / num_experts * capacity_factor
    return max(1, min(most, math.ceil(min(wanted, most) - _EPS)))


def per_device(cfg: Config, mesh: MeshView) -> PerDevice:
    n = mesh.num_devices
    shards = mesh.batch_shards
    cp = mesh.cp
    # Devices holding the same tokens. At decode the one new token per sequence cannot
    # be split, so every sequence shard holds it too.
    splitting = shards if cfg.mode is Mode.decode else shards * cp
    replication = n // splitting
    global_batch = cfg.per_device_batch_size * n
    local_batch = global_batch / shards
    seq_len = 1 if cfg.mode is Mode.decode else cfg.max_target_length
    sub_seq = seq_len / cp if cfg.mode is not Mode.decode else 1.0
    tokens = local_batch * sub_seq
    k, experts = cfg.num_experts_per_tok, cfg.num_experts
    return PerDevice(
        num_devices=n,
        batch_shards=shards,
        cp=cp,
        replication=replication,
        global_batch=global_batch,
        local_batch=local_batch,
        seq_len=seq_len,
        sub_seq=sub_seq,
        tokens_per_device=tokens,
        capacity_per_subgroup=capacity(
            sub_seq, k, experts, cfg.capacity_factor, cfg.capacity_rounding
        ),
        expected_tokens_per_expert=sub_seq * k / experts,
        gmm_rows=tokens * k,
    )
