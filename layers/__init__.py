"""Flax NNX MoE layers (dense, subgroup_capacity, megablox dispatch)."""
