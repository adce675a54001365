"""search=true: the launch layouts of a config's chips, each checked as a launch is,
ranked by the whole step's counted time (selector.layout_search, selector.step_time)."""

import dataclasses
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

import selector
from selector import layout_search
from selector.cli import main
from selector.config import Hardware
from selector.findings import errors_in
from selector.plan import _analyse
from selector.step_memory import REMAT_BY_MEMORY
from selector.step_time import step_time

TINY = ["model=tiny", "mesh=cpu_8", "search_global_batch=8"]
QWEN3_8K = ["model=qwen3_30b_a3b", "max_target_length=8192", "search_global_batch=64"]
QWEN_NEXT_32K = ["model=qwen3_next_80b_a3b", "max_target_length=32768", "search_global_batch=64"]
# A chip priced by round numbers, with one rate for every dot: the hand counts below
# divide by them.
FLAT = Hardware(
    name="flat",
    platform="tpu",
    memory_gib=16,
    matmul_tflops=100,
    hbm_bandwidth_gbps=1000,
    ici_bandwidth_gbps=10,
    dcn_bandwidth_gbps=1,
)


def config(*overrides: str):
    return selector.to_config(selector.compose(list(overrides)))


def parts_of(cfg):
    plan, findings = _analyse(cfg, None)
    assert plan is not None and not errors_in(findings), [f.code for f in findings]
    return plan, dict(step_time(cfg, plan.mesh, plan.per_device, plan.chosen_estimate).parts)


def test_step_time_counts_the_tiny_step_by_hand():
    # tiny: emb 64, 4 query heads and 2 kv heads of 16, vocabulary 256, two MoE layers
    # in float32;
    # two sequences of 2,048 tokens over fsdp=2 x context=2 x tensor=2.
    cfg = config(
        "model=tiny",
        "mesh=cpu_8",
        "ici_context_parallelism=2",
        "ici_tensor_parallelism=2",
        "ici_fsdp_parallelism=2",
        "per_device_batch_size=0.25",
    ).replace(hardware=FLAT)
    plan, parts = parts_of(cfg)
    assert plan.per_device.tokens_per_device == 1024
    rate, ici = 100e12, 10e9
    # The head: 2 x 1,024 tokens x 64 x 256 FLOPs, half a device's (tensor=2), three
    # passes.
    assert parts["head"] == pytest.approx(3 * 2 * 1024 * 64 * 256 / 2 / rate)
    # The attention's projections: q 64x64, k and v 64x32 each, out 64x64 = 12,288.
    assert parts["layer_dots"] == pytest.approx(2 * 3 * 2 * 1024 * 12288 / 2 / rate)
    # The scores and values: 2 dots x 2 x 1,024 queries x 2,048 keys x 64, causal half.
    attention = 2 * 2 * 1024 * 2048 * 64 / 2 / 2 / rate
    assert parts["attention"] == pytest.approx(2 * 3 * attention)
    # remat full: the layer's forward again, the MoE block's forward (a third of its
    # dots' time) included.
    moe_forward = plan.chosen_estimate.time_parts.compute / 3
    proj = 2 * 1024 * 12288 / 2 / rate
    assert parts["recompute"] == pytest.approx(2 * (proj + attention + moe_forward))
    # tensor=2: each layer's attention output summed forward and backward, each an
    # all-reduce (half the array out, twice) of 1,024 x 64 float32.
    assert parts["tensor_sums"] == pytest.approx(2 * 2 * 2 * 0.5 * 1024 * 64 * 4 / ici)
    # context=2: the keys and values of the whole sequence (2,048 x 2 x 2 heads x 16,
    # halved by tensor) gathered forward, their gradients scattered backward; half of
    # them come from the other shard.
    kv = 2048 * 2 * 2 * 16 / 2 * 4
    assert parts["context_exchange"] == pytest.approx(2 * 2 * 0.5 * kv / ici)
    assert parts["moe_blocks"] == pytest.approx(2 * plan.chosen_estimate.time_s)
    assert parts["gradient_sums"] == 0.0  # no data axis
    assert parts["overhead"] == 0.0  # the flat chip has no per-op figures


def test_ulysses_exchanges_heads_instead_of_gathering_keys():
    cfg = config(
        "model=tiny",
        "mesh=cpu_8",
        "ici_context_usp_ulysses_parallelism=2",
        "ici_fsdp_parallelism=4",
        "per_device_batch_size=0.5",
    ).replace(hardware=FLAT)
    plan, parts = parts_of(cfg)
    assert plan.per_device.tokens_per_device == 1024
    # Each layer: queries (64) in, outputs (64) back, keys and values (2 x 32) in, a
    # half of each sent, forward and backward; no keys gathered (cp = ulysses).
    nbytes = 2 * 2 * 0.5 * 1024 * (64 + 64 + 64) * 4
    assert parts["context_exchange"] == pytest.approx(nbytes / 10e9)


def test_data_parallel_gradients_are_summed_over_the_data_axis():
    cfg = config("model=tiny", "mesh=cpu_8", "ici_data_parallelism=8", "ici_fsdp_parallelism=1")
    _, parts = parts_of(cfg.replace(hardware=FLAT))
    assert parts["gradient_sums"] > 0 and parts["weight_gathers"] == 0.0
    _, fsdp = parts_of(config("model=tiny", "mesh=cpu_8").replace(hardware=FLAT))
    assert fsdp["gradient_sums"] == 0.0 and fsdp["weight_gathers"] > 0


def test_saving_more_recomputes_less_and_changes_nothing_else():
    base = config("model=qwen3_30b_a3b", "per_device_batch_size=1", "max_target_length=4096")
    runs = {}
    for policy in ("full", "minimal", "minimal_with_context"):
        plan, runs[policy] = parts_of(base.replace(remat_policy=policy))
    assert runs["full"]["recompute"] > runs["minimal"]["recompute"]
    assert runs["minimal"]["recompute"] > runs["minimal_with_context"]["recompute"]
    # minimal_with_context saves every projection and the attention's output; this
    # project's MoE block tags nothing, so its forward (a third of its dots) runs again.
    moe_forward = 48 * plan.chosen_estimate.time_parts.compute / 3
    assert runs["minimal_with_context"]["recompute"] == pytest.approx(moe_forward)
    # MaxText's block tags two of its three routed dots, which minimal saves.
    maxtext_like = base.replace(remat_policy="minimal_with_context", moe_checkpoint_names=True)
    plan, parts = parts_of(maxtext_like)
    assert parts["recompute"] == pytest.approx(48 * plan.chosen_estimate.time_parts.compute / 9)
    for name in ("head", "layer_dots", "attention", "weight_gathers"):
        assert runs["full"][name] == runs["minimal"][name]


@pytest.fixture(scope="module")
def tiny_found():
    return selector.search(selector.compose(TINY))


@pytest.fixture(scope="module")
def qwen_found():
    return selector.search(selector.compose(QWEN_NEXT_32K))


def test_every_layout_found_passes_the_check_and_keeps_the_global_batch(tiny_found, qwen_found):
    for found, base in ((tiny_found, TINY), (qwen_found, QWEN_NEXT_32K)):
        assert found.layouts
        for layout in found.layouts[:12]:
            cfg = selector.compose([*base, *layout.overrides])
            assert errors_in(selector.validate(cfg)) == [], layout.overrides
            assert layout.settings["per_device_batch_size"] * found.num_devices == pytest.approx(
                found.global_batch
            )


def test_the_search_finds_exactly_what_checking_every_layout_finds(tiny_found):
    """No pruning loses a layout: every mesh x remat policy checked at every tiling."""
    base = config(*TINY)
    base = base.replace(per_device_batch_size=1.0, num_devices=8, search=False)
    passing = set()
    for factors in layout_search.factorizations(8, len(layout_search.SEARCH_AXES)):
        sizes = dict(zip(layout_search.SEARCH_AXES, factors, strict=True))
        mesh_cfg = base.replace(**{f"ici_{a}_parallelism": s for a, s in sizes.items()})
        for remat in REMAT_BY_MEMORY:
            for tiling in (1, 2, 4, 8, 16, 32, 64):
                plan, findings = _analyse(
                    mesh_cfg.replace(remat_policy=remat, num_vocab_tiling=tiling), None
                )
                if plan is not None and not errors_in(findings):
                    passing.add((factors, remat, tiling))
                    break
    found = {
        (
            tuple(lay.settings[f"ici_{a}_parallelism"] for a in layout_search.SEARCH_AXES),
            lay.settings["remat_policy"],
            lay.settings["num_vocab_tiling"],
        )
        for lay in tiny_found.layouts
    }
    assert found == passing
    # Every layout is either found or refused, and counted once.
    refused = sum(n for _, n in tiny_found.refused)
    assert refused + len(tiny_found.layouts) == tiny_found.meshes * len(REMAT_BY_MEMORY)


def test_sure_fits_rank_first_then_by_counted_time():
    found = selector.search(selector.compose(QWEN3_8K))
    verdicts = [lay.verdict.value for lay in found.layouts]
    assert "yes" in verdicts and "margin" in verdicts
    assert verdicts == sorted(verdicts, key=lambda v: v != "yes")  # sure fits first
    sure = [lay.step.total for lay in found.layouts if lay.verdict.value == "yes"]
    assert sure[0] <= min(sure) * (1 + layout_search.TIE)
    assert all(b >= a / (1 + layout_search.TIE) for a, b in zip(sure, sure[1:], strict=False))


def test_global_batch_in_tokens_is_sequences_times_length():
    by_tokens = config("model=tiny", "mesh=cpu_8", "search_global_tokens=16384")
    assert layout_search.global_batch(by_tokens, 8) == 8
    assert layout_search.global_batch(config("model=tiny", "mesh=cpu_8"), 8) == 8


def test_a_long_sequence_searches_context_parallel_layouts():
    found = selector.search(
        selector.compose(
            ["model=tiny", "mesh=cpu_8", "max_target_length=65536", "search_global_batch=1"]
        )
    )
    contexts = {lay.settings["ici_context_parallelism"] for lay in found.layouts}
    assert contexts and min(contexts) > 1  # one sequence over 8 devices: cp or nothing


def test_cli_search_text_json_and_nothing_fits(capsys):
    assert main([*TINY, "search=true", "search_top=2"]) == 0
    out = capsys.readouterr().out
    assert "the 2 fastest meshes" in out and out.count("ici_data_parallelism=") == 2
    assert main([*TINY, "search=true", "output=json"]) == 0
    payload = json.loads(capsys.readouterr().out)
    assert payload["layouts"] and payload["meshes"] == 35
    assert all(lay["fits"] in ("yes", "margin") for lay in payload["layouts"])
    # DeepSeek-V3 on 8 CPU devices of 16 GiB: nothing fits.
    assert main(["model=deepseek_v3", "mesh=cpu_8", "search=true"]) == 1
    out = capsys.readouterr().out
    assert "error: no layout" in out and "MEMORY_EXCEEDED" in out


def test_cli_search_runs_without_a_traceback_in_a_subprocess():
    out = subprocess.run(
        [sys.executable, "-m", "selector", *QWEN_NEXT_32K, "search=true", "search_top=1"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode in (0, 3), out.stderr
    assert "Traceback" not in out.stderr and "1. step" in out.stdout
    assert math.isfinite(float(out.stdout.split("1. step ")[1].split(" s")[0]))


def test_layout_overrides_name_the_dispatch_the_check_chose(qwen_found):
    best = qwen_found.layouts[0]
    assert best.settings["dispatch"] == best.plan.strategy
    assert dataclasses.asdict(best.plan.placement)["exchange"] == best.settings["expert_exchange"]


def test_each_layout_takes_the_smallest_vocabulary_tiling_that_fits():
    found = selector.search(
        selector.compose(
            [
                "model=deepseek_v3",
                "num_devices=256",
                "max_target_length=32768",
                "search_global_batch=256",
            ]
        )
    )
    tiled = [lay for lay in found.layouts if lay.settings["num_vocab_tiling"] > 1]
    assert tiled  # DeepSeek-V3's 129,280-word logits at 32k tokens a device
    for layout in tiled[:4]:
        cfg = layout.plan.config.replace(num_vocab_tiling=layout.settings["num_vocab_tiling"] // 2)
        plan, findings = _analyse(cfg, None)
        assert "MEMORY_EXCEEDED" in {f.code for f in errors_in(findings)}


def test_data_parallel_gradient_sum_by_hand():
    # data=8: every device holds the whole model and sums its float32 gradients with
    # the 7 others (an all-reduce: 7/8 of them out, twice). tiny's non-expert weights:
    # embedding and head 2 x 256 x 64, final norm 64, two layers' attention 2 x 12,288
    # and norms 2 x 128 = 57,664; its MoE blocks 2 layers x (8 experts x 3 x 64 x 128
    # and the router's 64 x 8).
    cfg = config("model=tiny", "mesh=cpu_8", "ici_data_parallelism=8", "ici_fsdp_parallelism=1")
    _, parts = parts_of(cfg.replace(hardware=FLAT))
    held = 57664 + 2 * (8 * 3 * 64 * 128 + 64 * 8)
    assert parts["gradient_sums"] == pytest.approx(2 * 7 / 8 * held * 4 / 10e9)


def test_maxtext_route_layouts_pass_the_routes_own_check(maxtext_dir):
    """On the MaxText route each mesh is taken as MaxText runs it (the exchange its
    expert axis implies, the mesh laid on the v5p torus): every layout found, re-read
    from the files with its overrides, has no error on that route."""
    from selector.maxtext.importer import from_maxtext

    base = str(maxtext_dir / "configs" / "base.yml")
    args = [
        "model_name=qwen3-30b-a3b",
        "compile_topology=v5p-128",
        "max_target_length=8192",
        "search_global_batch=64",
    ]
    imported = from_maxtext(base, args)
    found = layout_search.search(
        imported.config, route=imported.for_mesh, spell=imported.launch_settings
    )
    assert dict(found.refused).get("MAXTEXT_MESH_NOT_ON_TORUS", 0) > 0
    exchanged = [lay for lay in found.layouts if lay.settings["ici_expert_parallelism"] > 1]
    assert exchanged and all(lay.plan.placement.exchange.value == "all_to_all" for lay in exchanged)
    for layout in [*found.layouts[:4], *exchanged[:2]]:
        # MaxText's keys only: the dispatch as sparse_matmul, the exchange by the axis.
        assert not {"dispatch", "expert_exchange", "expert_group"} & set(layout.settings)
        assert layout.settings["sparse_matmul"] == "true"
        again = from_maxtext(base, [*args, *layout.overrides])
        plan, findings = selector.api.analyse_any(again.config)
        assert not errors_in(again.findings + findings), layout.overrides
        assert plan.chosen_estimate.name == layout.plan.chosen_estimate.name
        # The re-check counts what the search counted.
        assert plan.chosen_estimate.device_bytes == pytest.approx(layout.device_bytes)


ROOT = Path(__file__).resolve().parents[2]


def test_the_readme_and_the_study_quote_the_stored_search_results():
    speed = json.loads((ROOT / "bench/results/search.json").read_text())["cases"]
    maxtext = json.loads((ROOT / "bench/results/search_maxtext.json").read_text())["cases"]
    readme = " ".join((ROOT / "README.md").read_text().split())
    page = (ROOT / "docs/results/search.md").read_text()
    deepseek = speed["DeepSeek-V3, 256 v5p, 32k, batch 64"]
    assert f"{deepseek['median_s']:.1f} s on one core" in readme
    assert f"({deepseek['checked']:,} checks)" in readme
    for name, row in speed.items():
        line = f"| {name} | {row['meshes']} | {row['checked']:,} | {row['layouts']} |"
        assert f"{line} {row['median_s']:.2f} |" in page, name
    for name, row in maxtext.items():
        numbers = f"{row['estimate_gib']:.1f} | {row['compiled_gib']:.1f} | {row['error']:+.0%} |"
        assert numbers in page, name
        assert f"{row['compiled_gib']:.1f} GiB" in readme, name


def test_the_stored_maxtext_cases_are_what_the_search_finds_today(maxtext_dir):
    """The layouts MaxText compiled are still the search's first: a change of the count
    or the ranking that moves them makes the stored compiles stale (re-run
    `python -m bench.search --maxtext BASE_YML`)."""
    from bench.search import MAXTEXT_CASES
    from selector.maxtext.importer import from_maxtext

    stored = json.loads((ROOT / "bench/results/search_maxtext.json").read_text())["cases"]
    base = str(maxtext_dir / "configs" / "base.yml")
    for name, args in MAXTEXT_CASES.items():
        imported = from_maxtext(base, args)
        found = layout_search.search(
            imported.config, route=imported.for_mesh, spell=imported.launch_settings
        )
        assert found.layouts[0].overrides == stored[name]["layout"], name


def test_bench_search_check_recomputes_the_stored_tiny_case():
    from bench.search import main as bench_main

    assert bench_main(["--check"]) == 0
