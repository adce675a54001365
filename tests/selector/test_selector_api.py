"""The Python API: presets, the reported case, compose from anywhere, the resolver."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from helpers import codes, typed
from omegaconf import OmegaConf

import selector
from selector import Dispatch

CONF = selector.conf_dir()
MODELS = sorted(p.stem for p in (CONF / "model").glob("*.yaml"))
MESHES = sorted(p.stem for p in (CONF / "mesh").glob("*.yaml"))
HARDWARE = sorted(p.stem for p in (CONF / "hardware").glob("*.yaml"))
REPORTED = ("model=qwen3_next_80b_a3b", "ici_context_parallelism=4", "max_target_length=8192")


def test_presets_exist():
    assert {"qwen3_next_80b_a3b", "qwen3_30b_a3b", "mixtral_8x7b", "deepseek_v3", "tiny"} <= set(
        MODELS
    )
    assert {"v5e", "v5p", "v6e", "h100", "h200", "cpu"} <= set(HARDWARE)
    assert "cpu_8" in MESHES and len(MESHES) >= 4


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("mesh", MESHES)
def test_every_preset_composes_and_validates(model, mesh):
    cfg = selector.to_config(selector.compose([f"model={model}", f"mesh={mesh}"]))
    assert cfg.model_name == model
    findings = selector.validate(cfg)  # never raises
    # One sequence per device and no context parallelism: only memory can be an error,
    # and for the tiny model an embedding (64) too narrow for fsdp over 256 chips.
    allowed = {"MEMORY_EXCEEDED"} | ({"EMBED_NOT_DIVISIBLE"} if model == "tiny" else set())
    assert codes(f for f in findings if f.severity.value == "error") <= allowed


# Where each preset's training state (float32 weights, gradients, Adam) fits, and where
# only inference does: DeepSeek-V3's 671 B parameters need about 10.7 TB to train.
FITS = [
    ("tiny", "cpu_8", "train"),
    ("qwen3_30b_a3b", "h200_8", "train"),
    ("mixtral_8x7b", "h200_8", "train"),
    ("qwen3_next_80b_a3b", "v5p_128", "train"),
    ("deepseek_v3", "v5p_128", "prefill"),
]


@pytest.mark.parametrize("model,mesh,mode", FITS)
def test_every_model_resolves_where_it_fits(model, mesh, mode):
    plan = selector.resolve(selector.compose([f"model={model}", f"mesh={mesh}", f"mode={mode}"]))
    assert plan.strategy in (Dispatch.megablox, Dispatch.dense, Dispatch.subgroup_capacity)


def test_training_state_that_cannot_fit_says_so():
    with pytest.raises(selector.ConfigError) as info:
        selector.resolve(selector.compose(["model=deepseek_v3", "mesh=v5p_128"]))
    (f,) = [f for f in info.value.findings if f.code == "MEMORY_EXCEEDED"]
    assert "the whole step needs" in f.message and "parameters' state dominates" in f.message
    # The breakdown names every part a training step holds.
    for part in ("weights", "gradients", "optimizer", "saved activations", "logits"):
        assert part in f.message


@pytest.mark.parametrize("hardware", HARDWARE)
def test_every_hardware_preset_overrides_the_mesh_choice(hardware):
    cfg = selector.to_config(selector.compose(["mesh=h200_8", f"hardware={hardware}"]))
    assert cfg.hardware.name == hardware and cfg.hardware.memory_gib > 0


def test_reported_case_inflates_then_fixes():
    with pytest.raises(selector.ConfigError) as info:
        selector.resolve(selector.compose([*REPORTED, "per_device_batch_size=1"]))
    assert "LOCAL_BATCH_INFLATION" in codes(info.value.findings)
    plan = selector.resolve(selector.compose([*REPORTED, "per_device_batch_size=0.25"]))
    assert plan.cp == 4 and plan.per_device.tokens_per_device == 2048
    assert plan.per_device.local_batch == 1 and plan.per_device.sub_seq == 2048


def test_all_three_context_axes_count_for_cp():
    for axis in ("context", "context_usp_ulysses", "context_autoregressive"):
        plan = selector.resolve(typed(f"ici_{axis}_parallelism=4", "per_device_batch_size=0.25"))
        assert plan.cp == 4 and plan.per_device.sub_seq == 512
    plan = selector.resolve(
        typed(
            "ici_context_parallelism=2",
            "ici_context_usp_ulysses_parallelism=2",
            "per_device_batch_size=0.25",
        )
    )
    assert plan.cp == 4


def test_derived_numbers():
    plan = selector.resolve(
        typed(
            "ici_context_parallelism=2",
            "per_device_batch_size=1",
            "allow_local_batch_inflation=true",
            "capacity_factor=1.25",
            "max_target_length=1024",
        )
    )
    d = plan.per_device
    assert (d.global_batch, d.batch_shards, d.local_batch, d.sub_seq) == (8, 4, 2, 512)
    assert d.tokens_per_device == 1024 and d.gmm_rows == 2048
    assert d.capacity_per_subgroup == 160  # ceil(512 * 2 / 8 * 1.25)


def test_auto_policy():
    assert selector.resolve(typed()).strategy is Dispatch.megablox
    assert selector.resolve(typed("capacity_factor=1.5")).strategy is Dispatch.subgroup_capacity
    one = selector.resolve(typed("num_experts=1", "num_experts_per_tok=1"))
    assert one.strategy is Dispatch.mlp
    explicit = selector.resolve(typed("dispatch=dense"))
    assert explicit.strategy is Dispatch.dense and "requested" in explicit.reason
    verdicts = {c.strategy: c.verdict for c in selector.resolve(typed()).candidates}
    assert "dropless" in verdicts[Dispatch.subgroup_capacity]


def test_deepseek_decode_picks_a_routed_dispatch_because_dense_reads_every_expert():
    """Decode is bound by the weights it reads: dense reads all 256 experts of a layer,
    a grouped matmul only those its tokens chose; the report says so in its reason."""
    plan = selector.resolve(
        selector.compose(
            [
                "model=deepseek_v3",
                "mesh=v5p_128",
                "mode=decode",
                "per_device_batch_size=1",
                "max_target_length=1",
            ]
        )
    )
    assert plan.strategy is Dispatch.megablox
    routed = plan.chosen_estimate
    dense = plan.candidate(Dispatch.dense).estimate
    assert dense.traffic.hbm > 20 * routed.traffic.hbm  # weights read per step
    # In time, at the HBM bandwidth, over 10x too.
    assert dense.time_parts.memory > 10 * routed.time_parts.memory
    assert "memory" in plan.reason


def test_plan_says_what_the_block_does_with_sharded_weights():
    fsdp = selector.resolve(typed("ici_fsdp_parallelism=8"))
    assert fsdp.expert_weights.startswith("rest sharded (embed over fsdp=8)")
    assert fsdp.placement.embed_axes == ("fsdp",) and "reduce-scattered" in fsdp.expert_weights
    plain = selector.resolve(typed("ici_fsdp_parallelism=1", "ici_data_parallelism=8"))
    assert plain.expert_weights.startswith("rest replicated")
    tp = selector.resolve(typed("ici_tensor_parallelism=2", "per_device_batch_size=0.5"))
    assert "hidden over tensor=2" in tp.expert_weights and "stays split" in tp.expert_weights
    cp = selector.resolve(
        typed("ici_context_parallelism=4", "per_device_batch_size=0.25", "expert_exchange=gather")
    )
    assert cp.placement.embed_axes == ("fsdp", "context")  # weights rest on cp devices too
    ep = selector.resolve(
        typed(
            "ici_context_parallelism=4", "per_device_batch_size=0.25", "expert_exchange=all_to_all"
        )
    )
    assert ep.placement.group_axes == ("context",) and ep.placement.experts_per_device == 2
    assert "expert parallel over context=4" in ep.expert_weights


def test_plan_is_frozen_and_serialisable():
    plan = selector.resolve(typed())
    with pytest.raises(AttributeError):
        plan.strategy = Dispatch.dense
    d = plan.as_dict()
    assert d["strategy"] == "megablox" and d["per_device"]["tokens_per_device"] == 2048


def test_compose_from_a_temporary_working_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = selector.compose(["model=mixtral_8x7b"])
    assert cfg.num_experts == 8 and cfg.base_emb_dim == 4096
    assert list(tmp_path.iterdir()) == []


def test_installed_package_composes_outside_the_checkout(tmp_path):
    """The packaged conf/ is found from any directory (not only next to the source)."""
    code = "import selector; print(selector.compose(['model=deepseek_v3']).num_experts)"
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "256"


def test_live_jax_mesh_shape_wins(jax_cpu8):
    import numpy as np
    from jax.sharding import AxisType, Mesh

    devices = np.array(jax_cpu8.devices()).reshape(2, 4)
    mesh = Mesh(devices, ("data", "context"), axis_types=(AxisType.Auto,) * 2)
    plan = selector.resolve(
        selector.compose(
            ["model=tiny", "mesh=cpu_8", "hardware=cpu", "per_device_batch_size=0.25"]
        ),
        mesh,
    )
    assert plan.mesh.source == "live mesh" and plan.cp == 4 and plan.per_device.batch_shards == 2
    assert plan.gmm_backend == "tiled_gmm"
    on_h200 = selector.resolve(selector.compose(["model=tiny", "per_device_batch_size=0.25"]), mesh)
    assert "HARDWARE_PLATFORM_MISMATCH" in codes(on_h200.findings)
    assert on_h200.gmm_backend == "tiled_gmm"


def test_resolver_inside_a_user_hydra_config(tmp_path):
    """A user's own Hydra app writes `moe_dispatch: ${moe_dispatch:}` (and the
    exchange beside it, `${moe_exchange:}`)."""
    (tmp_path / "conf").mkdir()
    (tmp_path / "conf" / "train.yaml").write_text(
        textwrap.dedent("""
        learning_rate: 3e-4
        num_devices: 8
        ici_fsdp_parallelism: 2
        ici_context_parallelism: 4
        per_device_batch_size: 0.25
        max_target_length: 8192
        num_experts: 64
        num_experts_per_tok: 8
        capacity_factor: 1.25
        moe_dispatch: ${moe_dispatch:}
        nested:
          moe: {model: tiny, num_devices: 8, ici_fsdp_parallelism: 8, capacity_factor: -1}
          dispatch: ${moe_dispatch:nested.moe}
          exchange: ${moe_exchange:nested.moe}
        long:
          moe: {model: tiny, num_devices: 8, ici_context_parallelism: 8, num_experts: 64,
                per_device_batch_size: 0.125}
          dispatch: ${moe_dispatch:long.moe}
          exchange: ${moe_exchange:long.moe}
    """)
    )
    (tmp_path / "train.py").write_text(
        textwrap.dedent("""
        import hydra, selector
        selector.register_resolvers()

        @hydra.main(version_base=None, config_path="conf", config_name="train")
        def main(cfg):
            print(cfg.moe_dispatch, cfg.nested.dispatch, cfg.nested.exchange)
            print(cfg.long.dispatch, cfg.long.exchange)
            inner = selector.compose(["model=tiny"])  # compose works inside an app too
            print(inner.model_name)

        main()
    """)
    )
    env = {**os.environ, "HYDRA_FULL_ERROR": "1"}
    out = subprocess.run(
        [sys.executable, "train.py", "hydra.run.dir=."],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env=env,
    )
    assert out.returncode == 0, out.stderr
    # What selector.resolve picks for the same two configs, outside any Hydra app.
    top = selector.resolve(
        selector.compose(
            [
                "num_devices=8",
                "ici_fsdp_parallelism=2",
                "ici_context_parallelism=4",
                "per_device_batch_size=0.25",
                "max_target_length=8192",
                "num_experts=64",
                "num_experts_per_tok=8",
                "capacity_factor=1.25",
            ]
        )
    )
    nested = selector.resolve(
        selector.compose(
            ["model=tiny", "num_devices=8", "ici_fsdp_parallelism=8", "capacity_factor=-1"]
        )
    )
    long = selector.resolve(
        selector.compose(
            [
                "model=tiny",
                "num_devices=8",
                "ici_context_parallelism=8",
                "num_experts=64",
                "per_device_batch_size=0.125",
            ]
        )
    )
    assert top.strategy.value == "subgroup_capacity"
    assert long.placement.exchange.value == "all_to_all"  # the two exchanges both seen
    assert out.stdout.split() == [
        top.strategy.value,
        nested.strategy.value,
        nested.placement.exchange.value,
        long.strategy.value,
        long.placement.exchange.value,
        "tiny",
    ]


def test_resolver_reports_config_errors():
    selector.register_resolvers()
    cfg = OmegaConf.create(
        {
            "num_devices": 8,
            "ici_context_parallelism": 4,
            "per_device_batch_size": 1,
            "max_target_length": 8192,
            "d": "${moe_dispatch:}",
        }
    )
    with pytest.raises(Exception, match="LOCAL_BATCH_INFLATION"):
        _ = cfg.d


def test_selector_core_never_imports_jax():
    code = (
        "import sys, selector; selector.resolve(selector.compose([]));"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('jax', 'flax', 'layers')))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        cwd=Path(__file__).parent,
    )
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize(
    "cfg, code, setting",
    [
        ({"num_experts": "abc"}, "VALUE_TYPE_INVALID", "num_experts"),
        ({"num_expertz": 3}, "UNKNOWN_SETTING", "num_expertz"),
        (42, "CONFIG_NOT_A_MAPPING", "config"),
    ],
)
def test_validate_never_raises(cfg, code, setting):
    """The README's promise: a bad config is findings, not an exception."""
    found = selector.validate(cfg)
    assert [(f.code, f.setting) for f in found] == [(code, setting)]
    assert found[0].severity.value == "error" and len(found[0].message) > 40


def test_to_config_reads_the_presets_a_mapping_names():
    """`model=` in a mapping means what it means on the command line, and a setting
    beside it still wins."""
    assert selector.to_config({"model": "deepseek_v3"}) == selector.to_config(
        selector.compose(["model=deepseek_v3"])
    )
    beside = selector.to_config({"model": "deepseek_v3", "num_experts": 64})
    assert (beside.model_name, beside.num_experts) == ("deepseek_v3", 64)
    (f,) = selector.validate({"model": "deepseek_v4"})
    assert f.code == "PRESET_UNKNOWN" and "deepseek_v3" in f.message


def test_resolver_beside_an_apps_own_nodes_and_a_path_that_is_not_there():
    """At the root an app's own node (`moe:`) is not taken for `mode` or `model`
    misspelled, while a node spelled like a node setting (`hardwre:`) still is; a path
    to no node says which path and what to give instead."""
    selector.register_resolvers()
    app = OmegaConf.create({"model": "tiny", "mesh": "cpu_8", "moe": {"x": "${moe_exchange:}"}})
    assert app.moe.x == "gather"
    typo = OmegaConf.create(
        {"model": "tiny", "hardwre": {"memory_gib": 3}, "d": "${moe_dispatch:}"}
    )
    with pytest.raises(Exception, match="UNKNOWN_SETTING"):
        _ = typo.d
    flat = OmegaConf.create({"model": "tiny", "mdl": 3, "modle": "x", "d": "${moe_dispatch:}"})
    with pytest.raises(Exception, match="UNKNOWN_SETTING .modle."):
        _ = flat.d
    lost = OmegaConf.create({"model": "tiny", "run": {"e": "${moe_exchange:nope}"}})
    with pytest.raises(Exception, match="no node 'nope' in the config"):
        _ = lost.run.e
