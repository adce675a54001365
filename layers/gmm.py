"""Grouped matmul: rows sorted by expert times that expert's weights.

gmm(x_RK, w_EKN, group_sizes_E) -> y_RN, rows [start_e, start_e + size_e) use w[e].
Backends by platform (the plan's `gmm_backend`): TPU the Pallas megablox kernel,
elsewhere `jax.lax.ragged_dot`.
"""

from __future__ import annotations

import jax


def gmm(x_RK, w_EKN, group_sizes_E, backend: str = "ragged_dot"):
    if backend == "pallas_megablox":
        from jax.experimental.pallas.ops.tpu.megablox import gmm as pallas_gmm

        return pallas_gmm(x_RK, w_EKN, group_sizes_E, preferred_element_type=x_RK.dtype)
    return jax.lax.ragged_dot(x_RK, w_EKN, group_sizes_E)
