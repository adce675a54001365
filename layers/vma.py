"""Varying-axes bookkeeping for code that runs inside `shard_map(check_vma=True)`.

Inside the block's shard_map every value carries the mesh axes it varies over. Hand-
written kernels and VJPs create values (zeros carries, kernel outputs) that JAX types as
invariant, and produce cotangents that vary over more axes than their primal: these two
helpers restore the types JAX's own autodiff would have given.
"""

from __future__ import annotations

import jax
from jax import lax


def varying_axes(x) -> set:
    """The mesh axes `x` varies over (empty outside shard_map)."""
    aval = jax.typeof(x)
    manual = getattr(aval, "manual_axis_type", None)  # jax >= 0.10
    return set(manual.varying if manual is not None else getattr(aval, "vma", ()) or ())


def varying_like(value, *refs):
    """`value` marked varying over every axis its `refs` vary over (a loop carry built
    from zeros, or a kernel's output, is typed invariant though it is per device)."""
    axes = set().union(*(varying_axes(r) for r in refs)) - varying_axes(value)
    return lax.pcast(value, tuple(sorted(axes)), to="varying") if axes else value


def reduce_like(cotangent, primal):
    """A cotangent summed over the mesh axes its primal is replicated on (inside
    shard_map the gradient of replicated weights is a sum over devices)."""
    extra = varying_axes(cotangent) - varying_axes(primal)
    return lax.psum(cotangent, tuple(sorted(extra))) if extra else cotangent
