"""compile=true on a MaxText config: MaxText 0.2.5's own train step, compiled ahead of
time by its train_compile (checks.maxtext_step), beside the estimate.

The compile itself runs only where MaxText is importable (Python >= 3.12, the `maxtext`
extra: nox session tests-3.12); without it the route exits 2 naming the extra."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from checks import maxtext_step
from selector import cli

ROOT = Path(__file__).resolve().parents[2]
# A small MoE decoder on MaxText's base.yml, 4 v5p chips (v5p-8 counts TensorCores).
SMALL_MOE = [
    "base_num_decoder_layers=2",
    "base_emb_dim=512",
    "base_mlp_dim=256",
    "base_num_query_heads=4",
    "base_num_kv_heads=4",
    "head_dim=128",
    "vocab_size=32000",
    "num_experts=8",
    "num_experts_per_tok=2",
    "base_moe_mlp_dim=256",
    "per_device_batch_size=1",
    "max_target_length=512",
    "compile_topology=v5p-8",
]
HAS_MAXTEXT = maxtext_step.available()


def test_out_of_memory_is_read_from_maxtexts_own_message():
    """train_compile's RESOURCE_EXHAUSTED line, as MaxText 0.2.5 printed it for
    Mixtral-8x7B on 8 v5p chips (bench/results/maxtext_step_cache.json), gives what the
    step needs and what the chip allows, in XLA's GiB (2**30)."""
    cache = json.loads((ROOT / "bench" / "results" / "maxtext_step_cache.json").read_text())
    oom = [v for v in cache.values() if v["status"] == "oom"]
    assert oom
    for entry in oom:
        parsed = maxtext_step.parse_log("some log line\n" + entry["message"] + "\nmore")
        assert parsed["status"] == "oom"
        assert parsed["used_bytes"] == pytest.approx(101.1 * 2**30, rel=0.002)
        assert parsed["capacity_bytes"] == pytest.approx(95.73 * 2**30)
    stats = (
        "Memory analysis: CompiledMemoryStats(generated_code_size_in_bytes=10, "
        "argument_size_in_bytes=400, output_size_in_bytes=300, alias_size_in_bytes=250, "
        "temp_size_in_bytes=100, host_generated_code_size_in_bytes=0)"
    )
    step = maxtext_step.MaxTextStep("ok", "cmd", 1.0, **_bytes(maxtext_step.parse_log(stats)))
    assert step.device_bytes == 400 + 300 - 250 + 100


def _bytes(parsed: dict) -> dict:
    return {k: v for k, v in parsed.items() if k != "status"}


def test_without_maxtext_the_route_names_the_extra(maxtext_dir, monkeypatch, capsys):
    """No maxtext to import: exit 2, one paragraph naming the extra, no traceback."""
    monkeypatch.setattr(maxtext_step, "available", lambda: False)
    base = maxtext_dir / "configs" / "base.yml"
    status = cli.main([str(base), *SMALL_MOE, "compile=true"])
    err = capsys.readouterr().err
    assert status == 2, err
    assert "maxtext extra" in err and "Python >= 3.12" in err and "Traceback" not in err


def test_a_gpu_target_is_refused_with_the_fix(maxtext_dir, monkeypatch, capsys):
    monkeypatch.setattr(maxtext_step, "available", lambda: True)
    base = maxtext_dir / "configs" / "base.yml"
    overrides = [o for o in SMALL_MOE if not o.startswith("compile_topology=")]
    status = cli.main([str(base), *overrides, "hardware=gpu", "num_devices=8", "compile=true"])
    err = capsys.readouterr().err
    assert status == 2 and "compile_topology=" in err and "Traceback" not in err


def test_the_command_carries_maxtexts_keys_and_the_target(maxtext_dir):
    """Our own keys (num_devices, output, compile) stay out of MaxText's command line; a
    model file given as the config runs as base.yml with model_name=, as MaxText reads it."""
    import selector

    base = maxtext_dir / "configs" / "base.yml"
    given = [*SMALL_MOE, "output=json", "compile=true"]
    imported = selector.from_maxtext(base, given)
    args = maxtext_step.maxtext_command(str(base), given, imported.config, None)
    assert args[0] == str(base)
    assert "output=json" not in args and "compile=true" not in args
    assert args[-3:] == [
        "compile_topology=v5p-8",
        "compile_topology_num_slices=1",
        "sparse_matmul=true",
    ]
    model = maxtext_dir / "configs" / "models" / "qwen3-30b-a3b.yml"
    given = ["num_devices=8", "per_device_batch_size=1"]
    imported = selector.from_maxtext(model, given)
    args = maxtext_step.maxtext_command(str(model), given, imported.config, None)
    assert args[:2] == [str(base), "model_name=qwen3-30b-a3b"]
    assert "num_devices=8" not in args and "compile_topology=v5p-16" in args


def _selector(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "selector", *args],
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )


@pytest.mark.skipif(not HAS_MAXTEXT, reason="MaxText 0.2.5 needs Python >= 3.12")
def test_maxtexts_train_step_is_compiled_beside_the_estimate():
    """MaxText's own train_compile, for 4 v5p chips: its compiled bytes in the JSON and the
    report beside the estimate; a config MaxText refuses is an error naming its reason."""
    pytest.importorskip("libtpu", reason='needs the tpu extra: pip install ".[tpu]"')
    import maxtext

    base = str(Path(maxtext.__file__).parent / "configs" / "base.yml")
    out = _selector(base, *SMALL_MOE, "compile=true", "output=json")
    assert out.returncode == 0, out.stderr[-2000:]
    assert "compiling MaxText's train step" in out.stderr
    report = json.loads(out.stdout)
    step = report["compiled"]["maxtext_train_compile"]
    assert step["status"] == "ok" and step["temp"] > 0 and step["arguments"] > 0
    assert "compile_topology=v5p-8" in step["command"] and "num_devices" not in step["command"]
    assert step["device_bytes"] == (
        step["arguments"] + step["outputs"] - step["aliased"] + step["temp"]
    )
    assert report["compiled"]["estimate_bytes"] > 0
    # MaxText 0.2.5 wants base_mlp_dim == base_moe_mlp_dim in a fully MoE model.
    refused = [o if o != "base_mlp_dim=256" else "base_mlp_dim=1024" for o in SMALL_MOE]
    out = _selector(base, *refused, "compile=true", "output=json")
    assert out.returncode == 1, out.stderr[-2000:]
    codes = {f["code"]: f for f in json.loads(out.stdout)["findings"]}
    assert (
        "base_mlp_dim must equal base_moe_mlp_dim" in codes["MAXTEXT_STEP_NOT_COMPILED"]["message"]
    )
