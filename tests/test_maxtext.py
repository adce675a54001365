"""The MaxText route: base_config chains, model files, overrides, MaxText findings."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import codes

import selector
from selector.cli import main

FIXTURES = Path(__file__).parent / "fixtures" / "maxtext"
BASE = str(FIXTURES / "base.yml")
CUSTOM = str(FIXTURES / "custom.yml")
REPORTED = [
    "model_name=qwen3-next-like",
    "ici_context_parallelism=4",
    "per_device_batch_size=1",
    "max_target_length=8192",
    "num_devices=8",
]


def test_base_plus_model_file_by_model_name():
    imported = selector.from_maxtext(BASE, ["model_name=qwen3-next-like", "num_devices=8"])
    cfg = imported.config
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.base_moe_mlp_dim) == (512, 10, 512)
    assert cfg.per_device_batch_size == 12.0  # from the base file
    assert imported.files[-1].endswith("models/qwen3-next-like.yml")
    assert "decoder_block" in imported.ignored and "steps" in imported.ignored


def test_base_config_chain_overrides_and_unknown_key():
    imported = selector.from_maxtext(CUSTOM, ["num_devices=8", "max_target_length=4096"])
    cfg = imported.config
    assert imported.files[0].endswith("base.yml") and imported.files[1].endswith("custom.yml")
    assert cfg.ici_context_parallelism == 4 and cfg.max_target_length == 4096  # override wins
    assert cfg.num_experts == 512  # model_name from custom.yml selects the model file
    assert cfg.dispatch is selector.Dispatch.subgroup_capacity  # sparse_matmul=false, cf>0
    assert "some_future_key" in imported.ignored
    plan = selector.resolve(cfg)
    assert plan.cp == 4 and plan.per_device.tokens_per_device == 1024


def test_logical_axis_rules_decide_the_roles(tmp_path):
    (tmp_path / "run.yml").write_text(
        f"base_config: {BASE}\n"
        "logical_axis_rules: [['activation_batch', ['data']], "
        "['activation_length', ['context']], ['exp', 'expert'], ['mlp', 'tensor']]\n"
    )
    cfg = selector.from_maxtext(tmp_path / "run.yml", ["num_devices=8"]).config
    assert cfg.axis_rules.batch == ["data"] and cfg.axis_rules.sequence == ["context"]
    found = selector.validate(cfg)
    # fsdp=8 now shards neither batch nor sequence, yet the embed rule rests weights on it
    assert "AXIS_RULE_WEIGHTS_OFF_TOKENS" in codes(found)


@pytest.mark.parametrize(
    "overrides,code",
    [
        (["sparse_matmul=true", "capacity_factor=1.25"], "MAXTEXT_SPARSE_IGNORES_CAPACITY"),
        (
            ["sparse_matmul=true", "ici_context_parallelism=4", "per_device_batch_size=0.25"],
            "MAXTEXT_FLATTEN_GATHERS_SEQUENCE",
        ),
        (
            [
                "sparse_matmul=false",
                "capacity_factor=1.25",
                "ici_context_parallelism=4",
                "per_device_batch_size=0.25",
            ],
            "MAXTEXT_CAPACITY_OVER_FULL_SEQUENCE",
        ),
        (["ici_sequence_parallelism=2"], "MAXTEXT_AXIS_NOT_MODELLED"),
    ],
)
def test_maxtext_findings(overrides, code):
    imported = selector.from_maxtext(
        BASE, ["model_name=qwen3-next-like", "num_devices=8", "max_target_length=8192", *overrides]
    )
    assert code in codes(imported.findings)


def test_maxtext_findings_near_misses():
    quiet = selector.from_maxtext(
        BASE,
        [
            "model_name=qwen3-next-like",
            "num_devices=8",
            "sparse_matmul=false",
            "capacity_factor=1.25",
            "ici_context_autoregressive_parallelism=4",
            "per_device_batch_size=0.25",
        ],
    )
    assert not codes(quiet.findings)  # the autoregressive axis is the one MaxText reads


def test_reported_case_through_the_maxtext_route(capsys):
    status = main([f"maxtext_config={BASE}", *REPORTED])
    out = capsys.readouterr().out
    assert status == 1
    assert "LOCAL_BATCH_INFLATION" in out and "per_device_batch_size=0.25" in out
    assert "Ignored" in out and "steps" in out
    fixed = [
        a if not a.startswith("per_device") else "per_device_batch_size=0.25" for a in REPORTED
    ]
    assert main([f"maxtext_config={BASE}", *fixed]) == 0
    assert "tokens per device      2,048" in capsys.readouterr().out


def test_maxtext_json_output(capsys):
    assert main([f"maxtext_config={CUSTOM}", "num_devices=8", "output=json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["plan"]["strategy"] == "subgroup_capacity"
    assert "some_future_key" in data["maxtext"]["ignored"]


@pytest.mark.parametrize(
    "args,expect",
    [
        ([f"maxtext_config={FIXTURES / 'missing.yml'}"], "does not exist"),
        ([f"maxtext_config={BASE}", "ici_context_parallelism=four"], "ici_context_parallelism"),
        ([f"maxtext_config={BASE}", "model_name=nope"], "model_name='nope'"),
        ([f"maxtext_config={BASE}", "hardware=tpu9"], "hardware='tpu9'"),
        ([f"maxtext_config={BASE}", "dispatch=fast"], "dispatch"),
        ([f"maxtext_config={BASE}", "noequals"], "key=value"),
        ([f"maxtext_config={BASE}", "-m"], "cannot be combined"),
    ],
)
def test_bad_maxtext_input_exits_2_with_a_message(capsys, args, expect):
    assert main(args) == 2
    err = capsys.readouterr().err
    assert expect in err and "Traceback" not in err


def test_unreadable_and_looping_files_exit_2(tmp_path, capsys):
    (tmp_path / "bad.yml").write_text("key: [unclosed\n")
    (tmp_path / "a.yml").write_text("base_config: b.yml\n")
    (tmp_path / "b.yml").write_text("base_config: a.yml\n")
    (tmp_path / "list.yml").write_text("- 1\n- 2\n")
    for name, expect in (
        ("bad.yml", "not readable YAML"),
        ("a.yml", "loop"),
        ("list.yml", "not a mapping"),
    ):
        assert main([f"maxtext_config={tmp_path / name}", "num_devices=8"]) == 2
        assert expect in capsys.readouterr().err


def test_maxtext_route_as_a_subprocess_has_no_traceback():
    out = subprocess.run(
        [sys.executable, "-m", "selector", f"maxtext_config={BASE}", *REPORTED],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 1 and "Traceback" not in out.stdout + out.stderr
