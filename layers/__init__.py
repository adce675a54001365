"""Flax NNX MoE layers whose dense, subgroup-capacity and megablox dispatches keep the
sequence sharded, forward and backward."""

from .ffn import ExpertWeights as ExpertWeights
from .grouped_matmul import gmm as gmm
from .moe import MlpBlock as MlpBlock
from .moe import MoEBlock as MoEBlock
from .sharding import Layout as Layout
from .sharding import make_mesh as make_mesh
from .sharding import mesh_for_plan as mesh_for_plan
from .spec import MoESpec as MoESpec
