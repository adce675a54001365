"""SwiGLU expert math shared by the dispatch strategies: (silu(x @ wi_0) * (x @ wi_1)) @ wo.

Legend: B batch, S sequence, T tokens, M embedding, H hidden, E experts, C capacity.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import jax
import jax.numpy as jnp


@dataclass(frozen=True)
class ExpertWeights:
    """Router, routed-expert and shared-expert weights as the strategies see them (a
    pytree; the optional parts are None when the model has none). S is the shared
    experts' hidden dim (selector.plan_sizes.shared_width).

    Attributes:
      gate_ME: the router kernel; bias_E: its routed bias (steers selection only).
      wi_0_EMH, wi_1_EMH, wo_EHM: the routed experts' SwiGLU (M the embedding, E the
        experts, H an expert's hidden dim).
      shared_*: the shared experts' SwiGLU and gate, None when the model has none.

    Examples:
      >>> import layers, selector
      >>> plan = selector.resolve(selector.compose(["model=tiny", "mesh=cpu_8",
      ...     "ici_context_parallelism=4", "per_device_batch_size=0.25"]))
      >>> from flax import nnx
      >>> block = layers.MoEBlock(plan, mesh=layers.mesh_for_plan(plan), rngs=nnx.Rngs(0))
      >>> w = block.weights()
      >>> w.gate_ME.shape, w.wi_0_EMH.shape, w.shared_wi_0_MS is None
      ((64, 8), (8, 64, 128), True)
    """

    gate_ME: jax.Array
    wi_0_EMH: jax.Array
    wi_1_EMH: jax.Array
    wo_EHM: jax.Array
    bias_E: jax.Array | None = None  # routed bias: steers selection only
    shared_wi_0_MS: jax.Array | None = None
    shared_wi_1_MS: jax.Array | None = None
    shared_wo_SM: jax.Array | None = None
    shared_gate_M1: jax.Array | None = None  # sigmoid gate on the shared output


WEIGHT_FIELDS = [f.name for f in dataclasses.fields(ExpertWeights)]
jax.tree_util.register_dataclass(ExpertWeights, data_fields=WEIGHT_FIELDS, meta_fields=[])


def einsum(subscripts: str, *operands, platform: str):
    """`jnp.einsum` whose sums accumulate in float32 on every backend (result in the
    operands' dtype). XLA:TPU and XLA:GPU accumulate a bfloat16 dot in float32 by
    themselves, and so did XLA:CPU up to jax 0.10. XLA:CPU in jax 0.12.0.1 keeps a
    *batched* bfloat16 dot (an einsum with a label on both operands and the output, e.g.
    "teh,ehm->tem") in bfloat16 throughout: a 128-long sum came back 2.3% off, 6,600 ulps
    from the rounded exact result, and it rejects bf16 x bf16 -> f32 for that dot
    ("Unsupported element type for DotThunk::Execute"). So when the mesh's devices are
    CPUs (`platform`, the spec's, decided from the mesh as the grouped matmul's kernel
    is) the operands go to float32 for the dot; other targets get the plain einsum.
    `lax.platform_dependent` would decide the same at lowering, but it changed XLA:TPU's
    compiled program for targets that are not CPUs (its cost analysis moved by 0.3%)."""
    dtype = jnp.result_type(*operands)
    if platform != "cpu" or dtype == jnp.float32 or not jnp.issubdtype(dtype, jnp.floating):
        return jnp.einsum(subscripts, *operands)
    return jnp.einsum(subscripts, *(o.astype(jnp.float32) for o in operands)).astype(dtype)


def swiglu(gate_h, up_h):
    return jax.nn.silu(gate_h) * up_h


def expert_swiglu(x, w: ExpertWeights, dtype, x_dims: str, h_dims: str, platform: str):
    """Every expert's SwiGLU over `x` with einsum labels: x is `{x_dims}m`, the hidden and
    output are `{h_dims}h` / `{h_dims}m` (h_dims names the expert dim e)."""
    wi_0, wi_1, wo = (a.astype(dtype) for a in (w.wi_0_EMH, w.wi_1_EMH, w.wo_EHM))
    xd = x.astype(dtype)
    h = swiglu(
        einsum(f"{x_dims}m,emh->{h_dims}h", xd, wi_0, platform=platform),
        einsum(f"{x_dims}m,emh->{h_dims}h", xd, wi_1, platform=platform),
    )
    return einsum(f"{h_dims}h,ehm->{h_dims}m", h, wo, platform=platform)


def dense_ffn(x_TM, wi_0_MH, wi_1_MH, wo_HM):
    """One SwiGLU MLP over every token (the plain MlpBlock and the one-expert case)."""
    return swiglu(x_TM @ wi_0_MH, x_TM @ wi_1_MH) @ wo_HM


def shared_swiglu(x_TM, w: ExpertWeights, dtype):
    """The shared experts' SwiGLU of every token, scaled by the sigmoid gate when the
    model has one (Qwen3-Next); zero when the model has no shared experts."""
    if w.shared_wi_0_MS is None:
        return None
    xd = x_TM.astype(dtype)
    y = dense_ffn(
        xd,
        w.shared_wi_0_MS.astype(dtype),
        w.shared_wi_1_MS.astype(dtype),
        w.shared_wo_SM.astype(dtype),
    )
    if w.shared_gate_M1 is not None:
        gate_T1 = jnp.einsum(
            "tm,mo->to", x_TM.astype(jnp.float32), w.shared_gate_M1.astype(jnp.float32)
        )
        y = y * jax.nn.sigmoid(gate_T1).astype(dtype)
    return y
