"""MaxText 0.2.5's own RoutedMoE beside our MoEBlock, with identical weights and inputs.

Runs only where MaxText is importable (its wheel wants Python >= 3.12 and jax 0.12; see
noxfile.py, session tests-3.12). Both blocks run on the 8 simulated CPU devices (data=8);
outputs and every gradient (input, router kernel, expert weights) are compared on host
copies (eager ops across two meshes of the same devices are unsafe, see NOTES).
"""

import os
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from layer_helpers import ROUTINGS, assert_close, build, inputs, loss_and_grads

from layers.maxtext_params import load_maxtext, paths

maxtext = pytest.importorskip("maxtext", reason="MaxText 0.2.5 needs Python >= 3.12")
# MaxText 0.2.5's RoutedMoE sows intermediates the way flax 0.12.12 deprecates.
pytestmark = pytest.mark.filterwarnings("ignore:Using 'Module.sow\\(\\)':DeprecationWarning")

BATCH, SEQ, EMB, HIDDEN = 8, 32, 64, 128  # the tiny model (conf/model/tiny.yaml)

# MaxText settings -> our selector overrides, per routing.
SOFTMAX = (
    ("num_experts=8", "num_experts_per_tok=2"),  # MaxText defaults: softmax of the top-k
    ("num_experts=8", "num_experts_per_tok=2", "norm_topk_prob=true"),
)
# DeepSeek-V3 routing as the routing tests spell it, without the shared expert (the
# comparison is of the routed block): MaxText's side (theirs, with its decoder block),
# then ours.
_DEEPSEEK_ROUTING = tuple(o for o in ROUTINGS["deepseek_v3"] if not o.startswith("shared_"))
DEEPSEEK_V3 = (("decoder_block=deepseek", *_DEEPSEEK_ROUTING), _DEEPSEEK_ROUTING)


def maxtext_block(*overrides: str):
    """MaxText's RoutedMoE on its own (data=8) mesh of the 8 CPU devices."""
    from flax import nnx
    from maxtext.configs import pyconfig
    from maxtext.layers import initializers, moe
    from maxtext.utils import maxtext_utils

    base = os.path.join(os.path.dirname(maxtext.__file__), "configs", "base.yml")
    cfg = pyconfig.initialize(
        [
            None,
            base,
            "run_name=moe_cp_parity",
            f"base_output_directory={tempfile.gettempdir()}/moe_cp_maxtext_output",
            "enable_checkpointing=false",
            "skip_jax_distributed_system=true",
            "hardware=cpu",
            "ici_data_parallelism=8",
            f"base_emb_dim={EMB}",
            f"base_mlp_dim={HIDDEN}",
            f"base_moe_mlp_dim={HIDDEN}",
            "dtype=float32",
            "weight_dtype=float32",
            "per_device_batch_size=1",
            f"max_target_length={SEQ}",
            *overrides,
        ]
    )
    mesh = maxtext_utils.get_mesh_from_config(cfg)
    block = moe.RoutedMoE(
        config=cfg,
        num_experts=cfg.num_experts,
        num_experts_per_tok=cfg.num_experts_per_tok,
        mesh=mesh,
        kernel_init=initializers.nd_dense_init(1.0, "fan_in", "truncated_normal"),
        kernel_axes=("embed", None),
        intermediate_dim=HIDDEN,
        rngs=nnx.Rngs(0),
    )
    return block, mesh


def maxtext_tree(block) -> dict:
    """The block's variables as nested dicts of host arrays (gate/bias included)."""
    from flax import nnx
    from maxtext.layers.moe import MoEBiasVar

    state = nnx.to_pure_dict(nnx.state(block, nnx.Any(nnx.Param, MoEBiasVar)))
    return jax.tree.map(np.asarray, state)


def maxtext_loss_and_grads(block, mesh, x, cot):
    """MaxText's (y, d/d params tree, d/dx) for loss = <y, cot>, as host arrays."""
    from flax import nnx

    graph, params, rest = nnx.split(block, nnx.Param, ...)

    def loss(params, x):
        y, _, _ = nnx.merge(graph, params, rest)(x)
        return jnp.sum(y * cot), y

    # MaxText's routing broadcasts ranks implicitly; our tests raise on that (conftest).
    with jax.set_mesh(mesh), jax.numpy_rank_promotion("allow"):
        (_, y), (gp, gx) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(
            params, x
        )
    grads = jax.tree.map(np.asarray, nnx.to_pure_dict(gp))
    return np.asarray(y), grads, np.asarray(gx)


def leaf(tree, path):
    for key in path:
        tree = tree[key]
    return tree


def compare(strategy, mt_overrides, our_overrides, capacity_factor=None, randomize_bias=False):
    """Load MaxText's weights into our block; both forward and backward on the same input.
    Returns {what: max abs error} and our statistics."""
    block, mesh = maxtext_block(*mt_overrides)
    tree = maxtext_tree(block)
    if randomize_bias:  # MaxText starts its routed bias at zero: give it something to steer
        bias = np.random.default_rng(3).standard_normal(tree["gate"]["bias"].shape) * 0.05
        tree["gate"]["bias"] = bias.astype(np.float32)
        block.gate.bias[...] = jnp.asarray(tree["gate"]["bias"])
    ours = build(strategy, {"data": 8}, BATCH, SEQ, *our_overrides, capacity_factor=capacity_factor)
    load_maxtext(ours, tree)
    x, cot = inputs(BATCH, SEQ, EMB)
    x, cot = np.asarray(x), np.asarray(cot)
    my, mgrads, mgx = maxtext_loss_and_grads(block, mesh, jnp.asarray(x), jnp.asarray(cot))
    y, stats, gw, gx = loss_and_grads(ours, x, cot)
    errors = {"output": (np.asarray(y), my), "d/dx": (np.asarray(gx), mgx)}
    for field, path in paths("routed").items():
        if path[-1] == "bias":  # steers selection only: no gradient on either side
            continue
        errors[f"d/d{'/'.join(path)}"] = (np.asarray(getattr(gw, field)), leaf(mgrads, path))
    return errors, stats


def check(errors):
    for what, (ours, theirs) in errors.items():
        assert_close(ours, theirs, what=what)


def test_softmax_routing_matches_maxtexts_routedmoe(jax_cpu8):
    """MaxText defaults (sparse_matmul, ragged path) against our megablox dispatch."""
    errors, stats = compare(
        "megablox", ("sparse_matmul=true", "megablox=false", *SOFTMAX[0]), SOFTMAX[1]
    )
    check(errors)
    assert float(stats["dropped_fraction"]) == 0.0


@pytest.mark.xfail(
    strict=True,
    reason="open: output off by 78-85% of scale against MaxText 0.2.5 (with or without a "
    "routed bias); the MaxText overrides or our sigmoid/group routing differ, not found yet",
)
def test_deepseek_v3_routing_matches_maxtexts_routedmoe(jax_cpu8):
    """Sigmoid scores, a routed bias (selection only), group-limited top-k and scaling."""
    errors, _ = compare(
        "megablox",
        ("sparse_matmul=true", "megablox=false", *DEEPSEEK_V3[0]),
        DEEPSEEK_V3[1],
        randomize_bias=True,
    )
    check(errors)


def test_capacity_drops_match_maxtexts_dense_capacity_path(jax_cpu8):
    """MaxText's dense path with a capacity factor (capacity over each whole sequence)
    against our subgroup_capacity with MaxText's rounding, on data=8 (no context split):
    the same tokens are dropped, so outputs and gradients agree."""
    errors, stats = compare(
        "subgroup_capacity",
        ("sparse_matmul=false", "capacity_factor=0.5", *SOFTMAX[0]),
        (*SOFTMAX[1], "capacity_rounding=maxtext"),
        capacity_factor=0.5,
    )
    assert float(stats["dropped_tokens"]) > 0  # the comparison must exercise drops
    check(errors)
