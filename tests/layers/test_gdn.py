"""Qwen3-Next's Gated DeltaNet in the decoder (`checks.gdn`): the chunked delta rule
against the token-by-token one, and the same split over context shards (the state
carried from shard to shard by all-gathered affine maps, the convolution's halo from
the previous shard) against the whole sequence on one device, values and gradients."""

from __future__ import annotations

import pytest


def _inputs(b=2, s=256, heads=3, dk=8, dv=6, seed=0):
    import jax

    keys = jax.random.split(jax.random.key(seed), 5)
    q = jax.random.normal(keys[0], (b, s, heads, dk))
    k = jax.random.normal(keys[1], (b, s, heads, dk))
    v = jax.random.normal(keys[2], (b, s, heads, dv))
    # Decays of real size: -softplus(.) of unit normals, so exp(g) spans (0, 1).
    g = -jax.nn.softplus(jax.random.normal(keys[3], (b, s, heads)))
    beta = jax.nn.sigmoid(jax.random.normal(keys[4], (b, s, heads)))
    return q, k, v, g, beta


def _loss(fn):
    import jax.numpy as jnp

    return lambda *xs: jnp.sum(jnp.sin(fn(*xs)))


def test_chunked_delta_rule_matches_the_recurrence(jax_cpu8):
    """Four chunks of 64 and a carried state: outputs, final state and the gradients of
    every input agree with the token-by-token rule."""
    import jax
    import jax.numpy as jnp

    from checks import gdn

    xs = _inputs()
    out, state = jax.jit(gdn.chunked)(*xs)
    want, want_state = jax.jit(gdn.recurrent)(*xs)
    assert jnp.allclose(out, want, atol=1e-4), float(jnp.abs(out - want).max())
    assert jnp.allclose(state, want_state, atol=1e-4)
    grads = jax.jit(jax.grad(_loss(lambda *a: gdn.chunked(*a)[0]), argnums=range(5)))(*xs)
    want_grads = jax.jit(jax.grad(_loss(lambda *a: gdn.recurrent(*a)[0]), argnums=range(5)))(*xs)
    for got, ref in zip(grads, want_grads, strict=True):
        assert jnp.allclose(got, ref, atol=1e-3), float(jnp.abs(got - ref).max())


def test_transition_is_the_shards_affine_map(jax_cpu8):
    """From any incoming state, the chunks end at A S_in + B."""
    import jax
    import jax.numpy as jnp

    from checks import gdn

    xs = _inputs(s=128)
    start = jax.random.normal(jax.random.key(7), (2, 3, 8, 6))
    a, b = gdn.transition(*xs)
    _, end = gdn.chunked(*xs, start)
    assert jnp.allclose(end, jnp.einsum("bhkj,bhjv->bhkv", a, start) + b, atol=1e-4)


@pytest.mark.parametrize("cp", [4])
def test_context_sharded_gdn_matches_one_device(jax_cpu8, cp):
    """The delta rule and the causal convolution with the sequence split over `cp`
    devices (shard_map over a context axis) give the whole sequence's outputs and
    gradients."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import PartitionSpec as P

    from checks import gdn

    mesh = jax.sharding.Mesh(np.array(jax.devices()[:cp]), ("context",))
    xs = _inputs()
    x = jax.random.normal(jax.random.key(3), (2, 256, 5))
    w = jax.random.normal(jax.random.key(4), (4, 5))

    def whole(q, k, v, g, beta, x, w):
        return (
            gdn.chunked(q, k, v, g, beta)[0].sum(-1) + gdn.causal_conv(x, w, ()).sum(-1)[..., None]
        )

    def split(q, k, v, g, beta, x, w):
        seq = P(None, "context")
        fn = jax.shard_map(
            lambda q, k, v, g, beta, x, w: (
                gdn.sharded(q, k, v, g, beta, ("context",)).sum(-1)
                + gdn.causal_conv(x, w, ("context",)).sum(-1)[..., None]
            ),
            mesh=mesh,
            in_specs=(seq, seq, seq, seq, seq, seq, P()),
            out_specs=seq,
            check_vma=False,
        )
        return fn(q, k, v, g, beta, x, w)

    args = (*xs, x, w)
    got = jax.jit(split)(*args)
    want = jax.jit(whole)(*args)
    assert jnp.allclose(got, want, atol=1e-4), float(jnp.abs(got - want).max())
    grads = jax.jit(jax.grad(_loss(split), argnums=range(7)))(*args)
    want_grads = jax.jit(jax.grad(_loss(whole), argnums=range(7)))(*args)
    for got_g, ref in zip(grads, want_grads, strict=True):
        assert jnp.allclose(got_g, ref, atol=1e-3), float(jnp.abs(got_g - ref).max())
