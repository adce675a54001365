"""`python -m selector`: reports, exit codes 0/1/2, JSON, multirun, no tracebacks."""

import json
import subprocess
import sys

import pytest

REPORTED = ["model=qwen3_next_80b_a3b", "ici_context_parallelism=4", "max_target_length=8192"]


def run(*args: str, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "selector", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=120,
    )


def test_default_config_reports_and_exits_0(tmp_path):
    out = run(cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    for part in ("Mesh (config", "Per device", "Candidates", "Choice:", "OK: no errors"):
        assert part in out.stdout
    assert list(tmp_path.iterdir()) == []  # a pre-launch check leaves no files behind


def test_reported_case_exits_1_with_the_fix():
    out = run(*REPORTED, "per_device_batch_size=1")
    assert out.returncode == 1
    assert "LOCAL_BATCH_INFLATION" in out.stdout and "per_device_batch_size=0.25" in out.stdout
    assert "8,192" in out.stdout and "Traceback" not in out.stdout + out.stderr


def test_reported_case_fixed_exits_0_with_2048_tokens():
    out = run(*REPORTED, "per_device_batch_size=0.25")
    assert out.returncode == 0, out.stdout
    assert "tokens per device      2,048" in out.stdout


@pytest.mark.parametrize(
    "override,expect",
    [
        ("foo=1", "Unknown setting 'foo'"),
        ("+foo=1", "Unknown setting 'foo'"),
        ("ici_contxt_parallelism=2", "Did you mean ici_context_parallelism"),
        ("ici_context_parallelism=abc", "ici_context_parallelism"),
        ("per_device_batch_size=", "per_device_batch_size"),
        ("model=nope", "Available model presets"),
        ("dispatch=megabox", "megablox"),
        ("x==", "Cannot parse"),
    ],
)
def test_unusable_overrides_exit_2_with_one_paragraph(override, expect):
    out = run(override)
    assert out.returncode == 2
    assert expect in out.stderr
    assert "Traceback" not in out.stderr + out.stdout
    assert out.stderr.strip().count("\n") == 0  # one paragraph


def test_unusable_input_with_json_output_prints_one_json_object(capsys):
    """output=json with input that cannot be read: the paragraph on stderr as always,
    and on stdout one object a launch script can parse, with the exit status."""
    from selector.cli import main

    out = run("ici_contxt_parallelism=2", "output=json")
    assert out.returncode == 2 and "Did you mean" in out.stderr
    data = json.loads(out.stdout)
    assert data["ok"] is False and data["exit_status"] == 2
    assert "Did you mean ici_context_parallelism" in data["error"]
    assert main(["ici_contxt_parallelism=2"]) == 2
    assert capsys.readouterr().out == ""  # text output: the paragraph alone, on stderr


def test_json_output_for_launch_scripts():
    out = run(*REPORTED, "per_device_batch_size=0.25", "output=json")
    assert out.returncode == 0
    data = json.loads(out.stdout)
    assert data["ok"] is True and data["plan"]["cp"] == 4
    assert data["plan"]["per_device"]["tokens_per_device"] == 2048
    bad = json.loads(run(*REPORTED, "per_device_batch_size=1", "output=json").stdout)
    assert bad["ok"] is False
    assert [f["code"] for f in bad["findings"]] == ["LOCAL_BATCH_INFLATION"]
    # Each fix for a script: its overrides as typed, what a device then holds, and the
    # memory verdict then (the devices moved to data land within the margin).
    (inflation,) = bad["findings"]
    details = inflation["fix_details"]
    assert [d["overrides"] for d in details][0] == {"per_device_batch_size": "0.25"}
    assert [d["verdict"] for d in details] == ["yes", "yes", "margin"]
    assert details[2]["device_gib"] == pytest.approx(94.2, abs=0.05)
    assert "94.2 GiB, within the memory margin)" in " ".join(inflation["message"].split())


# The README's two multirun examples: one that passes, one whose worst job fails.
SWEEP_OK = [
    "-m",
    "ici_context_parallelism=4",
    "per_device_batch_size=0.25",
    "max_target_length=8192,32768",
    "expert_exchange=gather,all_to_all",
]
SWEEP_WORST = ["-m", "ici_context_parallelism=1,4", "per_device_batch_size=1"]


def test_multirun_prints_one_report_per_job(tmp_path):
    out = run(*SWEEP_OK, "output=json", cwd=tmp_path)
    reports = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert out.returncode == 0, out.stdout + out.stderr
    assert [r["overrides"][2:] for r in reports] == [
        [f"max_target_length={n}", f"expert_exchange={e}", "output=json"]
        for n in (8192, 32768)
        for e in ("gather", "all_to_all")
    ]
    assert [r["plan"]["placement"]["exchange"] for r in reports] == ["gather", "all_to_all"] * 2
    assert list(tmp_path.iterdir()) == []
    worst = run(*SWEEP_WORST, cwd=tmp_path)
    assert worst.stdout.count("=== job ") == 2 and worst.stdout.count("Candidates") == 2
    assert "OK: no errors" in worst.stdout and "LOCAL_BATCH_INFLATION" in worst.stdout
    assert worst.returncode == 1  # the worst job decides


def test_single_run_json_carries_its_overrides():
    out = run(*REPORTED, "per_device_batch_size=0.25", "output=json")
    assert json.loads(out.stdout)["overrides"] == [
        *REPORTED,
        "per_device_batch_size=0.25",
        "output=json",
    ]


@pytest.mark.parametrize("flag", [["--cfg", "job"], ["-c", "job"], ["--cfg=job"]])
def test_cfg_job_lists_every_key(flag):
    out = run(*flag, "model=tiny")
    assert out.returncode == 0, out.stderr
    assert "model_name: tiny" in out.stdout and "ici_context_parallelism:" in out.stdout


def test_help_describes_this_tool():
    out = run("--help")
    assert out.returncode == 0
    assert out.stdout.startswith("usage: python -m selector")
    assert "Pre-launch check for the MoE block" in out.stdout and "Hydra" not in out.stdout


@pytest.mark.parametrize(
    "args,expect",
    [
        (["hydra.run.dir=."], "Hydra's job runner"),
        (["ici_context_parallelism=1,2"], "add -m"),
        (["--nope"], "unrecognized arguments"),
        (["+num_experts=4"], "Write num_experts=4"),
    ],
)
def test_more_unusable_input_exits_2(args, expect):
    out = run(*args)
    assert out.returncode == 2 and expect in out.stderr and "Traceback" not in out.stderr


def test_bad_value_inside_a_sweep_exits_2():
    out = run("-m", "ici_context_parallelism=1,x")
    assert out.returncode == 2 and "ici_context_parallelism=x" in out.stderr


def test_the_cli_never_imports_jax():
    code = (
        "import sys; from selector.cli import main; status = main([]);"
        "print(status, sorted(m for m in sys.modules if m.split('.')[0] in ('jax', 'flax')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip().splitlines()[-1] == "0 []"


def test_a_closed_pipe_is_not_a_traceback():
    """`python -m selector | head -1`: the reader leaves early; no traceback, status kept."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "selector", *REPORTED, "per_device_batch_size=1"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    with proc:
        proc.stdout.close()  # nobody reads the report
        err = proc.stderr.read().decode()
        assert proc.wait(timeout=120) == 1
    assert "Traceback" not in err and "BrokenPipe" not in err


SWEEP_SMALL = ["model=tiny", "mesh=cpu_8", "ici_context_parallelism=1,2"]


def test_multirun_ends_with_one_summary_line_per_job():
    """The last lines of a sweep: a row a job with its exit status, its pick and what a
    device holds, each as the job's own JSON report says, and its overrides."""
    out = run("-m", *SWEEP_SMALL)
    assert out.returncode == 1, out.stderr
    lines = out.stdout.rstrip().splitlines()
    assert lines[-4] == "=== summary: 2 job(s), exit status 1 (the worst job's)"
    assert lines[-3].split()[:4] == ["job", "exit", "pick", "device"]
    for job, (row, cp) in enumerate(zip(lines[-2:], (1, 2), strict=True)):
        overrides = ["model=tiny", "mesh=cpu_8", f"ici_context_parallelism={cp}"]
        alone = run(*overrides, "output=json")
        report = json.loads(alone.stdout)
        chosen = next(c for c in report["plan"]["candidates"] if c["chosen"])
        errors = [f["code"] for f in report["findings"] if f["severity"] == "error"]
        cells = row.split()
        held = f"{chosen['device_bytes'] / 2**30:.3g}"
        assert cells[:4] == [str(job), str(alone.returncode), chosen["name"], held], row
        assert cells[4] == (",".join(errors) or "-") and cells[5:] == overrides, row
    assert lines[-1].split()[4] == "LOCAL_BATCH_INFLATION"  # the job that fails says why


def test_multirun_json_has_no_summary_table():
    out = run("-m", *SWEEP_SMALL, "output=json")
    assert [json.loads(line)["model_name"] for line in out.stdout.splitlines()] == ["tiny"] * 2


def test_a_job_that_cannot_run_is_its_own_exit_2_and_the_sweep_goes_on(monkeypatch, capsys):
    from selector import cli

    real = cli.analysed

    def fails_at_cp2(config):
        if config.ici_context_parallelism == 2:
            raise cli._Usage("compile=true could not compile for cpu (planted)")
        return real(config)

    monkeypatch.setattr(cli, "analysed", fails_at_cp2)
    assert cli.main(["-m", *SWEEP_SMALL[:2], "ici_context_parallelism=1,2,4"]) == 2
    out, err = capsys.readouterr()
    assert "error: job 1: compile=true could not compile for cpu (planted)" in err
    rows = out.rstrip().splitlines()[-3:]
    assert [r.split()[:2] for r in rows] == [["0", "0"], ["1", "2"], ["2", "1"]]
    assert rows[1].split()[2:4] == ["-", "-"] and "unusable input" in rows[1]
