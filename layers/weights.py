"""Every weight of the block, described once: its field in `ExpertWeights`, its shape by
letters, how it rests on the mesh, where it sits in the nnx module tree and in MaxText's
parameter tree. The block's parameter shapes and shardings (`MoEBlock.param_layout`),
its variables (`MoEBlock.variables`), the shard_map's in_specs (`Layout.weight_specs`)
and the MaxText port (`layers.maxtext_params`) all read this table.

Shape letters: M embedding, E experts, H expert hidden, S shared experts' hidden
(selector.problem.shared_width), 1 a dim of one. At-rest roles name the Layout axes a
dim is split over: "embed", "experts", "hidden", "shared_embed" (the router's and
shared experts' embedding dim: the embed axes and any fsdp axes folded into the expert
group), or None (whole on every device).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Weight:
    field: str  # ExpertWeights field
    letters: str  # the shape, one letter a dim
    at_rest: tuple[str | None, ...]  # Layout role a dim is split over, one a dim
    module: tuple[str, ...]  # attribute path of its nnx variable in MoEBlock
    part: str  # "routed", "shared" or "shared_gate": which MaxText subtree holds it
    maxtext: tuple[str, ...]  # path inside that subtree (MaxText 0.2.5's names)

    def __post_init__(self):
        assert len(self.letters) == len(self.at_rest), self


# MaxText: gate (embed, None); wi (exp, embed, mlp); wo (exp, mlp, embed); its MlpBlock
# for shared experts (embed, mlp) / (mlp, embed). The router's bias (E floats) is whole
# on every device.
WEIGHTS = (
    Weight(
        "gate_ME", "ME", ("shared_embed", None), ("gate", "kernel"), "routed", ("gate", "kernel")
    ),
    Weight("wi_0_EMH", "EMH", ("experts", "embed", "hidden"), ("wi_0",), "routed", ("wi_0",)),
    Weight("wi_1_EMH", "EMH", ("experts", "embed", "hidden"), ("wi_1",), "routed", ("wi_1",)),
    Weight("wo_EHM", "EHM", ("experts", "hidden", "embed"), ("wo",), "routed", ("wo",)),
    Weight("bias_E", "E", (None,), ("gate", "bias"), "routed", ("gate", "bias")),
    Weight(
        "shared_wi_0_MS",
        "MS",
        ("shared_embed", "hidden"),
        ("shared_experts", "wi_0", "kernel"),
        "shared",
        ("wi_0", "kernel"),
    ),
    Weight(
        "shared_wi_1_MS",
        "MS",
        ("shared_embed", "hidden"),
        ("shared_experts", "wi_1", "kernel"),
        "shared",
        ("wi_1", "kernel"),
    ),
    Weight(
        "shared_wo_SM",
        "SM",
        ("hidden", "shared_embed"),
        ("shared_experts", "wo", "kernel"),
        "shared",
        ("wo", "kernel"),
    ),
    Weight(
        "shared_gate_M1",
        "M1",
        ("shared_embed", None),
        ("shared_expert_gate", "kernel"),
        "shared_gate",
        ("kernel",),
    ),
)
BY_FIELD = {w.field: w for w in WEIGHTS}
