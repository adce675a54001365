"""The training example: the same loss at every cp (attention, MoE and optimizer
included), one compiled step, state created sharded, and a rejected config stopping
before anything compiles."""

import importlib.util
import os
import subprocess
import sys

import jax
import numpy as np
import pytest
from subproc import ROOT

import layers
import selector
from examples.train import TrainSettings, setup

BATCH, SEQ, STEPS = 8, 256, 3
MESHES = {
    "data8": {"data": 8},
    "data2_cp4": {"data": 2, "context": 4},
    "data2_ulysses2_cp2": {"data": 2, "context_usp_ulysses": 2, "context": 2},
}
SETTINGS = TrainSettings(steps=STEPS, vocab=32, layers=2, heads=2, learning_rate=3e-3)


def config(*extra: str):
    return selector.to_config(
        selector.compose(
            [
                "model=tiny",
                "mesh=cpu_8",
                "dtype=float32",
                f"per_device_batch_size={BATCH / 8}",
                f"max_target_length={SEQ}",
                "allow_local_batch_inflation=true",  # one global batch on every mesh
                "expert_exchange=gather",
                *extra,
            ]
        )
    )


def losses(mesh_name: str, *extra: str) -> tuple[list[dict], object]:
    trainer = setup(config(*extra), SETTINGS, layers.make_mesh(MESHES[mesh_name]))
    return [trainer.step(i) for i in range(STEPS)], trainer


_runs: dict = {}


def run(mesh_name: str, *extra: str):
    key = (mesh_name, extra)
    if key not in _runs:
        _runs[key] = losses(mesh_name, *extra)
    return _runs[key]


def relative(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


@pytest.mark.parametrize("mesh_name", ["data2_cp4", "data2_ulysses2_cp2"])
def test_same_loss_at_every_cp(jax_cpu8, mesh_name):
    base, _ = run("data8")
    other, _ = run(mesh_name)
    assert base[-1]["loss"] < base[0]["loss"]  # it learns
    for step, (a, b) in enumerate(zip(other, base, strict=True)):
        for key in ("loss", "load_balance_loss"):
            assert relative(a[key], b[key]) <= 1e-5, (step, key, a[key], b[key])


def test_capacity_path_same_loss_when_no_subgroup_overflows(jax_cpu8):
    """subgroup_capacity applies capacity per sequence shard (per device's sub-sequence),
    so at cp=4 its subgroups are a quarter of cp=1's: with drops the two runs differ by
    design. With a capacity no subgroup can overflow (capacity_factor = E / k) they must
    agree, and both must report no drops."""
    extra = ("dispatch=subgroup_capacity", "capacity_factor=4.0")
    base, _ = run("data8", *extra)
    cp4, _ = run("data2_cp4", *extra)
    for step, (a, b) in enumerate(zip(cp4, base, strict=True)):
        assert a["dropped"] == b["dropped"] == 0.0
        assert relative(a["loss"], b["loss"]) <= 1e-5, (step, a["loss"], b["loss"])


def test_steps_after_the_first_do_not_recompile(jax_cpu8):
    _, trainer = run("data2_cp4")
    assert trainer.step_fn._cache_size() == 1


def test_parameters_and_optimizer_state_are_created_sharded(jax_cpu8):
    _, trainer = run("data2_cp4")
    params = jax.tree.leaves(trainer.params)
    big = [p for p in params if p.size >= 64 * 64]
    assert big and all(not p.sharding.is_fully_replicated for p in big)
    mu = jax.tree.leaves(trainer.opt_state[0].mu)
    for p, m in zip(params, mu, strict=True):
        assert m.sharding.is_equivalent_to(p.sharding, p.ndim)


def test_a_rejected_config_stops_before_compiling(tmp_path):
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "examples.train",
            "ici_context_parallelism=4",
            "per_device_batch_size=1",
            "max_target_length=2048",
            f"hydra.run.dir={tmp_path}",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert out.returncode == 1, out.stderr[-2000:]
    assert "LOCAL_BATCH_INFLATION" in out.stdout and "nothing was compiled" in out.stderr
    assert "Traceback" not in out.stdout + out.stderr
    assert not (tmp_path / "run.json").exists()


def test_loss_floor_is_the_entropy_of_the_language():
    from examples.data import MarkovLanguage

    lang = MarkovLanguage(16, seed=1)
    tokens = lang.batch(0, 64, 512)
    counts = np.zeros((16, 16))
    for row in tokens:
        for a, b in zip(row[:-1], row[1:], strict=True):
            counts[a, b] += 1
    freq = counts / counts.sum(1, keepdims=True)
    logs = np.log(np.where(freq > 0, freq, 1.0))
    empirical = -(freq * logs).sum(axis=1).mean()
    assert abs(empirical - lang.floor) < 0.02


@pytest.mark.parametrize(
    "arg,says",
    [
        ("steps=5", "Did you mean train.steps"),
        ("+steps=5", "Did you mean train.steps"),
        ("+train.steps=3", "write train.steps=3"),
        ("~model", "deletes a setting"),
        ("num_experts=" + "9" * 5000, "Cannot apply the overrides"),
        ("num_experts=" + "[" * 3000 + "1" + "]" * 3000, "nests its value deeper"),
        ("train.steps=abc", "Cannot apply the overrides"),
    ],
    ids=["steps", "plus-steps", "plus-existing", "delete", "huge", "deep", "wrong-type"],
)
def test_a_bad_override_gets_one_paragraph_and_exit_2(arg, says):
    from examples.train import compose_problem, override_problem

    assert says in (override_problem([arg]) or compose_problem([arg]))
    assert override_problem(["train.steps=3", "model=tiny", "hydra.run.dir=x", "-m"]) is None
    out = subprocess.run(
        [sys.executable, "-m", "examples.train", arg],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert out.returncode == 2 and says in out.stderr
    assert "Traceback" not in out.stderr


def test_the_record_is_written_without_matplotlib(tmp_path, monkeypatch, capsys):
    """With matplotlib missing, run.json is written and the skipped plot is named."""
    import builtins

    from examples.train import TrainSettings, write_outputs

    real_import = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name.startswith("matplotlib"):
            raise ImportError("No module named 'matplotlib'")
        return real_import(name, *args, **kwargs)

    class Plan:
        cp = 1

        def as_dict(self):
            return {"strategy": "megablox"}

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    history = [{"loss": 2.0, "load_balance_loss": 1.0}]
    paths = write_outputs(tmp_path, None, TrainSettings(), Plan(), history, 1.5)
    assert paths == [tmp_path / "run.json"] and (tmp_path / "run.json").is_file()
    assert "skipped loss.png" in capsys.readouterr().err


PLUGIN_NOISE = (
    "Unable to load CUDA",
    "Jax plugin configuration error",
    "cudart_stub",
    "unexpected worker hostname",
    "could not determine TPU accelerator type",
    "absl::InitializeLog",
)


@pytest.fixture(scope="module")
def cp4_command(tmp_path_factory):
    """`python -m examples.train` at (data=2, context=4) for one step, started as a user
    starts it: no JAX_PLATFORMS or XLA_FLAGS of the test session's."""
    out_dir = tmp_path_factory.mktemp("train_cp4")
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("JAX_PLATFORMS", "XLA_FLAGS", "MOE_CP_PLUGIN_LOGS")
    }
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "examples.train",
            "ici_context_parallelism=4",
            "per_device_batch_size=0.25",
            "max_target_length=512",
            "train.steps=1",
            "train.plot=false",
            f"hydra.run.dir={out_dir}",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=600,
    )


def test_the_step_compiles_without_involuntary_rematerialization(cp4_command):
    """From the embedding on, activations are born in the (batch, sequence) sharding: a
    lookup that comes out split like the table makes XLA replicate the whole activation
    to reshard it, and say so on stderr."""
    assert cp4_command.returncode == 0, cp4_command.stderr[-3000:]
    assert "train cp=4" in cp4_command.stderr  # the sequence really is split
    assert "Involuntary full rematerialization" not in cp4_command.stderr


def test_a_command_prints_no_compiler_plugin_noise(cp4_command):
    """With the tpu/gpu extras installed, a jax start on a machine without accelerators
    prints about 30 lines of plugin errors; the project's commands drop them."""
    from checks.jax_start import PLUGINS, accelerator_present

    installed = [p for p in PLUGINS if importlib.util.find_spec(p.replace("-", "_"))]
    if not installed or accelerator_present():
        pytest.skip("needs the tpu or gpu extra on a machine without accelerators")
    assert cp4_command.returncode == 0, cp4_command.stderr[-3000:]
    for line in PLUGIN_NOISE:
        assert line not in cp4_command.stderr, cp4_command.stderr[:3000]
