"""MaxText 0.2.5's own RoutedMoE beside our MoEBlock, with identical weights and inputs.

Runs only where MaxText is importable (its wheel wants Python >= 3.12 and jax 0.12; see
noxfile.py, session tests-3.12). Both blocks run on the 8 simulated CPU devices (data=8);
outputs and every gradient (input, router kernel, expert weights) are compared on host
copies (eager ops across two meshes of the same devices are unsafe, see NOTES). One more
test compiles both, ahead of time for 8 abstract v5p chips (XLA:TPU through libtpu;
nothing runs), and compares their per-device memory.
"""

import os
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hlo import collectives
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
# comparison is of the routed block): MaxText's side, then ours. MaxText routes the
# DeepSeek-V3 way (pre-bias weights, group-limited top-k) only for a model_name starting
# with "deepseek3" (moe.py: GateLogit and get_topk); decoder_block=deepseek alone gives
# a plain top-k whose weights carry the bias. So its side names its shipped tiny
# DeepSeek-V3 file, whose dims the settings below replace.
_DEEPSEEK_ROUTING = tuple(o for o in ROUTINGS["deepseek_v3"] if not o.startswith("shared_"))
DEEPSEEK_V3 = (
    ("model_name=deepseek3-tiny", "override_model_config=true", *_DEEPSEEK_ROUTING),
    _DEEPSEEK_ROUTING,
)


def maxtext_config(run_name: str, *settings: str):
    """MaxText's config: its own base.yml under `settings`, for a run that writes nothing
    (no checkpoints, no distributed system) and leaves JAX's persistent compilation cache
    off (base.yml's is ~/jax_cache: entries written for abstract TPU/GPU devices by later
    tests in this process fail to load)."""
    from maxtext.configs import pyconfig

    base = os.path.join(os.path.dirname(maxtext.__file__), "configs", "base.yml")
    return pyconfig.initialize(
        [
            None,
            base,
            f"run_name={run_name}",
            f"base_output_directory={tempfile.gettempdir()}/moe_cp_maxtext_output",
            "enable_checkpointing=false",
            "skip_jax_distributed_system=true",
            "jax_cache_dir=",
            *settings,
        ]
    )


def routed_moe(cfg, mesh, hidden: int, **dtypes):
    """MaxText's RoutedMoE as its decoder builds it, for `cfg` on `mesh`."""
    from flax import nnx
    from maxtext.layers import initializers, moe

    return moe.RoutedMoE(
        config=cfg,
        num_experts=cfg.num_experts,
        num_experts_per_tok=cfg.num_experts_per_tok,
        mesh=mesh,
        kernel_init=initializers.nd_dense_init(1.0, "fan_in", "truncated_normal"),
        kernel_axes=("embed", None),
        intermediate_dim=hidden,
        rngs=nnx.Rngs(0),
        **dtypes,
    )


def maxtext_block(*overrides: str):
    """MaxText's RoutedMoE on its own (data=8) mesh of the 8 CPU devices."""
    from maxtext.utils import maxtext_utils

    cfg = maxtext_config(
        "moe_cp_parity",
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
    )
    mesh = maxtext_utils.get_mesh_from_config(cfg)
    return routed_moe(cfg, mesh, HIDDEN), mesh


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


# --- Per-device memory compiled for v5p -------------------------------------------------

# A small bf16 model on 8 v5p chips, fsdp=2 x context=4 (the sequence split 4 ways). The
# sequence, 3 x 512, puts the factor 3 in every token count (384 tokens a device, 768
# routed rows, 1536, 3072 ...) and in none of the weights' dims (powers of two): a
# collective with a dim divisible by 3 moves tokens.
V5P_EMB, V5P_HIDDEN, V5P_EXPERTS, V5P_TOP_K = 512, 256, 16, 2
V5P_BATCH, V5P_SEQ = 2, 1536
V5P_MESH = ("ici_fsdp_parallelism=2", "ici_context_parallelism=4")


def v5p_target():
    """8 abstract v5p chips (libtpu's compile-only topology), or skip naming the extra."""
    pytest.importorskip("libtpu", reason='needs the tpu extra: pip install ".[tpu]"')
    from checks.targets import devices
    from selector.targets import Target, TargetUnavailable

    target = Target("v5p", 8)
    try:
        return target, devices(target)
    except TargetUnavailable as exc:
        pytest.skip(str(exc))


def compile_train_like(loss, w, x, options):
    """The compiled d(loss)/d(w, x) with each gradient sharded as its primal, as a train
    step keeps them (a plain jit(grad) returns MaxText's weight gradients replicated).
    Without the persistent compilation cache (MaxText's configs point it at ~/jax_cache):
    an entry written for abstract devices fails to load back, and that warning fails."""
    out = (jax.tree.map(lambda a: a.sharding, w), x.sharding)
    lowered = jax.jit(jax.grad(loss, argnums=(0, 1)), out_shardings=out).lower(w, x)
    cached = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    try:
        return lowered.compile(options)
    finally:
        jax.config.update("jax_enable_compilation_cache", cached)


def maxtext_v5p_program(devices, options):
    """MaxText's RoutedMoE on its default TPU path (sparse_matmul, megablox: its Pallas
    kernels, native on a TPU mesh), parameters sharded by MaxText's logical axis rules."""
    from flax import nnx
    from flax.core.spmd import logical_axis_rules
    from flax.linen import logical_to_mesh_axes
    from jax.sharding import NamedSharding
    from maxtext.utils import maxtext_utils, sharding

    cfg = maxtext_config(
        "moe_cp_memory",
        "hardware=tpu",
        *V5P_MESH,
        f"base_emb_dim={V5P_EMB}",
        f"base_mlp_dim={V5P_HIDDEN}",
        f"base_moe_mlp_dim={V5P_HIDDEN}",
        f"num_experts={V5P_EXPERTS}",
        f"num_experts_per_tok={V5P_TOP_K}",
        "sparse_matmul=true",
        "megablox=true",
        "load_balance_loss_weight=0.01",  # a balance loss, as ours computes
        "dtype=bfloat16",
        "weight_dtype=bfloat16",
        f"per_device_batch_size={V5P_BATCH / 8}",
        f"max_target_length={V5P_SEQ}",
    )
    mesh = maxtext_utils.get_mesh_from_config(cfg, devices)
    with logical_axis_rules(cfg.logical_axis_rules):
        block = nnx.eval_shape(
            lambda: routed_moe(cfg, mesh, V5P_HIDDEN, weight_dtype=jnp.bfloat16, dtype=jnp.bfloat16)
        )
        graph, params, rest = nnx.split(block, nnx.Param, ...)
        # MaxText's own resolution of each parameter's logical axes (its train state's).
        shardings = sharding.nnx_construct_named_sharding(params, mesh)
        x_spec = logical_to_mesh_axes(
            ("activation_batch_moe", "activation_length_moe", "activation_embed_moe")
        )
    w = jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), params, shardings
    )
    x = jax.ShapeDtypeStruct(
        (V5P_BATCH, V5P_SEQ, V5P_EMB), jnp.bfloat16, sharding=NamedSharding(mesh, x_spec)
    )

    def loss(w, x):
        y, lb_loss, _ = nnx.merge(graph, w, rest)(x)
        return jnp.sum(y * y) + lb_loss

    # Its routing broadcasts ranks implicitly; its layers read the rules while tracing.
    with (
        logical_axis_rules(cfg.logical_axis_rules),
        jax.set_mesh(mesh),
        jax.numpy_rank_promotion("allow"),
    ):
        return compile_train_like(loss, w, x, options)


def our_v5p_program(devices, options):
    """Our MoEBlock at the same model, mesh and dtypes: megablox dispatch (gathered
    experts, the Pallas grouped matmul), the plan the selector resolves for it."""
    from flax import nnx

    import layers
    import selector
    from layers.programs import abstract_inputs, block_forward, fwd_bwd_loss

    cfg = selector.compose(
        [
            "model=tiny",
            "hardware=v5p",
            "num_devices=8",
            *V5P_MESH,
            f"base_emb_dim={V5P_EMB}",
            f"base_moe_mlp_dim={V5P_HIDDEN}",
            f"num_experts={V5P_EXPERTS}",
            f"num_experts_per_tok={V5P_TOP_K}",
            "norm_topk_prob=false",  # MaxText's default
            "dispatch=megablox",  # the selector picks dense at this small shape
            "expert_exchange=gather",
            "dtype=bfloat16",
            "param_dtype=bfloat16",
            f"per_device_batch_size={V5P_BATCH / 8}",
            f"max_target_length={V5P_SEQ}",
            "context_parallel_load_balance=false",
        ]
    )
    plan = selector.resolve(cfg)
    assert plan.gmm_backend == "pallas_megablox"
    mesh = layers.mesh_for_plan(plan, devices)
    block = nnx.eval_shape(lambda: layers.MoEBlock(plan, mesh=mesh, rngs=nnx.Rngs(0)))
    w, x = abstract_inputs(block, V5P_BATCH, V5P_SEQ)
    return compile_train_like(fwd_bwd_loss(block_forward(block)), w, x, options)


def token_collectives(text: str) -> list:
    """Collectives with a token-sized dim (divisible by 3 here, see V5P_SEQ)."""
    return [(op, s) for op, s in collectives(text) if any(d % 3 == 0 for shape in s for d in shape)]


def test_per_device_memory_compiled_for_v5p_against_maxtexts_routedmoe():
    """fwd+bwd of MaxText's RoutedMoE (Pallas megablox) and of our MoEBlock, compiled for
    8 v5p chips on the same fsdp=2 x context=4 mesh, weights and gradients at the same
    shardings: both run the Mosaic grouped matmul, keep the sequence split (no
    collective moves tokens), hold the same bytes at rest, and ours needs no more
    scratch (temp) per device than MaxText's."""
    target, devices = v5p_target()
    options = target.compile_options()
    theirs = maxtext_v5p_program(devices, options)
    ours = our_v5p_program(devices, options)
    mt, mo = theirs.memory_analysis(), ours.memory_analysis()
    mib = 2.0**20
    numbers = (
        f"per device, MiB: temp ours {mo.temp_size_in_bytes / mib:.2f} vs MaxText "
        f"{mt.temp_size_in_bytes / mib:.2f} (ratio "
        f"{mo.temp_size_in_bytes / mt.temp_size_in_bytes:.3f}); arguments ours "
        f"{mo.argument_size_in_bytes / mib:.2f} vs MaxText {mt.argument_size_in_bytes / mib:.2f}"
    )
    print(numbers)
    for name, program in (("MaxText", theirs), ("ours", ours)):
        text = program.as_text()
        assert "tpu_custom_call" in text, f"{name}: no Mosaic kernel (interpreted Pallas?)"
        assert not token_collectives(text), f"{name} gathers tokens: {token_collectives(text)}"
    assert mo.argument_size_in_bytes == mt.argument_size_in_bytes, numbers
    assert mo.output_size_in_bytes == mt.output_size_in_bytes, numbers
    assert mo.temp_size_in_bytes <= mt.temp_size_in_bytes, numbers
