"""The MaxText route on MaxText's own files (the maxtext 0.2.5 wheel's configs/, fetched
at test time): every shipped MoE model config, MaxText's hardware and num_slices
meanings, overrides that must exist, facts about MaxText stated as measured."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import codes, routed_findings
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import selector
import selector.maxtext.files
from selector import ScoreFunc
from selector.cli import main

REPORTED = [
    "model_name=qwen3-next-80b-a3b",
    "ici_context_parallelism=4",
    "per_device_batch_size=1",
    "max_target_length=8192",
    "num_devices=8",
]
# What a shipped model may rightly be told on 256 chips with base.yml's batch: it does
# not fit, its dims do not split over 256 fsdp devices, our block's routing is not
# MaxText's for it, or its own axis rules give the expert axis to two weight dims
# (deepseek3-671b-2dfsdp: mlp_moe takes 'expert', so flax leaves the expert dim
# unsharded). Nothing may come from base.yml's own defaults.
MODEL_FINDINGS = {
    "MEMORY_EXCEEDED",
    "MEMORY_WITHIN_MARGIN",  # the route's margin: compile to be sure
    "EMBED_NOT_DIVISIBLE",
    "MAXTEXT_ROUTING_NOT_IN_BLOCK",
    "MAXTEXT_AXIS_USED_TWICE",
}


@pytest.fixture(scope="module")
def base(maxtext_dir) -> str:
    return str(maxtext_dir / "configs" / "base.yml")


def moe_models(maxtext_dir) -> list[str]:
    return sorted(
        p.stem
        for p in (maxtext_dir / "configs" / "models").glob("*.yml")
        if "num_experts" in p.read_text()
    )


def test_base_yml_alone_gives_no_finding(base):
    imported = selector.from_maxtext(base, ["num_devices=8"])
    plan, found = selector.api.analyse_any(imported.config)
    assert plan is not None and imported.findings + found == []
    assert any("hardware=tpu" in n for n in imported.notes)
    assert any("num_slices=-1" in n for n in imported.notes)


def test_every_shipped_moe_model_gives_a_plan(maxtext_dir, base):
    models = moe_models(maxtext_dir)
    assert len(models) == 35
    seen = {}
    for name in models:
        imported = selector.from_maxtext(base, [f"model_name={name}", "num_devices=256"])
        plan, found = selector.api.analyse_any(imported.config)
        assert plan is not None, name
        extra = codes(imported.findings + found) - MODEL_FINDINGS
        assert not extra, (name, extra)
        seen[name] = imported.config
    # The routing each family runs in MaxText, mapped onto the block.
    v3 = seen["deepseek3-671b"]
    assert (v3.routed_score_func, v3.routed_bias, v3.routed_scaling_factor) == (
        ScoreFunc.sigmoid,
        True,
        2.5,
    )
    assert v3.norm_topk_prob and v3.shared_experts == 1 and not v3.shared_expert_gate
    split = seen["deepseek3-671b-batchsplit"]
    assert (split.n_routing_groups, split.topk_routing_group) == (8, 4)
    v2 = seen["deepseek2-16b"]
    assert v2.routed_score_func is ScoreFunc.softmax and not v2.norm_topk_prob
    assert v2.shared_experts == 2
    nxt = seen["qwen3-next-80b-a3b"]
    assert nxt.shared_experts == 1 and nxt.shared_expert_gate and nxt.norm_topk_prob
    assert seen["mixtral-8x7b"].norm_topk_prob  # MaxText's softmax over the top-k
    assert seen["qwen3.5-35b-a3b-fp8"].param_dtype == "float8_e4m3fn"


@pytest.mark.parametrize("name", ["qwen3-next-80b-a3b", "mixtral-8x7b"])
def test_shipped_model_through_the_cli(base, name, capsys):
    status = main([f"maxtext_config={base}", f"model_name={name}", "num_devices=256"])
    out = capsys.readouterr().out
    assert status == 0, out
    assert "Ignored" in out and "Traceback" not in out


def test_reported_case_reaches_the_inflation(base, capsys):
    assert main([f"maxtext_config={base}", *REPORTED]) == 1
    out = capsys.readouterr().out
    assert "LOCAL_BATCH_INFLATION" in out and "per_device_batch_size=0.25" in out
    assert "RECURRENCE_LOAD_BALANCED" in out  # base.yml balances the shards: MaxText refuses
    assert "MESH_AXIS_INVALID" not in out and "is not a preset" not in out


def test_hardware_keeps_maxtexts_meaning_and_chip_prices(base):
    gpu = selector.from_maxtext(base, ["hardware=gpu", "num_devices=8"])
    assert gpu.config.hardware.name == "h100"
    h200 = selector.from_maxtext(base, ["hardware=gpu", "chip=h200", "num_devices=8"])
    assert h200.config.hardware.name == "h200" and not any("chip=" in n for n in h200.notes[2:])
    with pytest.raises(selector.MaxTextError, match="MaxText's platforms"):
        selector.from_maxtext(base, ["hardware=v5p", "num_devices=8"])


def test_adamw_moments_take_maxtexts_dtypes(base):
    """MaxText keeps AdamW's mu in mu_dtype, which inherits weight_dtype when unset, and
    nu in weight_dtype (configs/pyconfig.py). Its compiled step agrees: Qwen3-Next at 4
    layers on 64 v5p chips holds 1.26 GiB of arguments with float32 weights and 0.63 with
    bfloat16 (docs/results/whole-step.md). An explicit optimizer_bytes_per_param wins."""

    def moments(*over):
        return selector.from_maxtext(
            base, ["num_devices=8", *over]
        ).config.optimizer_bytes_per_param

    assert moments() == 8.0  # base.yml: float32 weights, mu_dtype unset
    assert moments("weight_dtype=bfloat16") == 4.0
    assert moments("weight_dtype=bfloat16", "mu_dtype=float32") == 6.0
    assert moments("weight_dtype=bfloat16", "optimizer_bytes_per_param=8") == 8.0


def test_num_slices_minus_one_is_understood(base):
    cfg = selector.from_maxtext(base, ["num_devices=8"]).config
    assert cfg.num_slices == 1
    two = selector.from_maxtext(base, ["num_devices=16", "num_slices=2"]).config
    assert selector.resolve(two).mesh.size("data") == 2  # dcn_data_parallelism=-1 fills it


def test_maxtext_findings_read_the_resolved_mesh(base):
    """cp comes from a -1 fill here; the capacity fact still fires."""
    over = [
        "model_name=mixtral-8x7b",
        "sparse_matmul=false",
        "capacity_factor=1.25",
        "ici_context_parallelism=-1",
        "ici_fsdp_parallelism=1",
        "ici_data_parallelism=1",
        "per_device_batch_size=0.125",
        "num_devices=8",
    ]
    imported = selector.from_maxtext(base, over)
    assert "MAXTEXT_CAPACITY_OVER_FULL_SEQUENCE" in codes(imported.findings)
    assert imported.config.capacity_rounding.value == "maxtext"


def test_ragged_path_is_not_said_to_gather_the_sequence(base):
    """MaxText's grouped-matmul paths (ragged and Pallas) keep the sequence sharded, as
    compiled by XLA:TPU: no warning for either; a note says what was measured, where."""
    common = [
        "model_name=mixtral-8x7b",
        "ici_context_parallelism=4",
        "per_device_batch_size=0.25",
        "num_devices=8",
    ]
    ragged = selector.from_maxtext(base, [*common, "megablox=false"])
    assert not codes(ragged.findings)
    pallas = selector.from_maxtext(base, common)
    assert not codes(pallas.findings)
    (note,) = [n for n in pallas.notes if "grouped matmul with cp=4" in n]
    assert "XLA:TPU" in note and "3209 -> 1926 -> 931" in note


def test_load_balance_loss_facts(base):
    common = ["model_name=qwen3-30b-a3b", "num_devices=8", "load_balance_loss_weight=0.01"]
    ragged = selector.from_maxtext(base, [*common, "megablox=false"])
    assert "MAXTEXT_LOAD_BALANCE_LOSS_LOCAL" in codes(ragged.findings)
    dense = selector.from_maxtext(base, [*common, "sparse_matmul=false"])
    assert "MAXTEXT_LOAD_BALANCE_LOSS_PER_SEQUENCE" in codes(dense.findings)
    assert "MAXTEXT_LOAD_BALANCE_LOSS_SIGMOID" not in codes(dense.findings)  # softmax


def test_sigmoid_routing_load_balance_loss_fact(base):
    """DeepSeek-V3's sigmoid routing: the fact gives both MaxText definitions and ours."""
    over = ["model_name=deepseek3-671b", "num_devices=256", "load_balance_loss_weight=0.01"]
    imported = selector.from_maxtext(base, over)
    assert imported.config.routed_score_func is ScoreFunc.sigmoid
    (f,) = [f for f in imported.findings if f.code == "MAXTEXT_LOAD_BALANCE_LOSS_SIGMOID"]
    assert "1.004384" in f.message and "1.026532" in f.message and "1.002419" in f.message
    assert "Megatron" not in f.message
    megatron = selector.from_maxtext(base, [*over, "moe_use_megatron_seq_aux_loss=true"])
    (f,) = [f for f in megatron.findings if f.code == "MAXTEXT_LOAD_BALANCE_LOSS_SIGMOID"]
    assert "Megatron" in f.message


def test_a_weight_axis_given_twice_is_a_finding(tmp_path, base):
    """A user's rule giving 'expert' to embed_moe, merged in front of base.yml's: flax
    assigns it to the embed dim and skips the exp rule, so MaxText leaves the expert
    dim unsharded; the route follows it and says so."""
    (tmp_path / "run.yml").write_text(
        f"base_config: {base}\nlogical_axis_rules: [['embed_moe', ['fsdp', 'expert']]]\n"
    )
    imported = selector.from_maxtext(
        tmp_path / "run.yml", ["num_devices=8", "model_name=mixtral-8x7b"]
    )
    (f,) = [f for f in imported.findings if f.code == "MAXTEXT_AXIS_USED_TWICE"]
    assert "exp -> ['expert'] (expert taken)" in f.message
    rules = imported.config.axis_rules
    assert rules.experts == () and rules.embed == ("fsdp", "expert")


def test_ignored_keys_are_counted_and_only_those_that_matter_listed(base):
    imported = selector.from_maxtext(base, ["model_name=gpt-oss-20b", "num_devices=8"])
    assert len(imported.ignored) > 500
    listed = ", ".join(imported.relevant_ignored)
    assert "mlp_activations=['sigmoid', 'linear']" in listed and "mlp_bias=True" in listed
    assert "steps" not in listed and len(imported.relevant_ignored) < 10
    assert "Ignored" in imported.summary() and "steps," not in imported.summary()


@pytest.mark.parametrize(
    "args,expect",
    [
        (["ici_contex_parallelism=8"], "Did you mean ici_context_parallelism"),
        (["per_device_batchsize=4"], "Did you mean per_device_batch_size"),
        (["ici_context_parallelism=four"], "ici_context_parallelism"),
        (["model_name=nope"], "model_name='nope'"),
        (["chip=tpu9"], "chip='tpu9'"),
        (["dispatch=fast"], "dispatch"),
        (["noequals"], "key=value"),
        (["-m"], "cannot be combined"),
    ],
)
def test_bad_maxtext_input_exits_2_with_a_message(base, capsys, args, expect):
    assert main([f"maxtext_config={base}", "num_devices=8", *args]) == 2
    err = capsys.readouterr().err
    assert expect in err and "Traceback" not in err


def test_unreadable_empty_and_looping_files_exit_2(tmp_path, capsys):
    (tmp_path / "bad.yml").write_text("steps: 1\nkey: [unclosed\n")
    (tmp_path / "a.yml").write_text("base_config: b.yml\n")
    (tmp_path / "b.yml").write_text("base_config: a.yml\n")
    (tmp_path / "list.yml").write_text("- 1\n- 2\n")
    (tmp_path / "empty.yml").write_text("")
    for name, expect in (
        ("bad.yml", "line 3"),
        ("a.yml", "loop"),
        ("list.yml", "not a mapping"),
        ("empty.yml", "is empty"),
        ("missing.yml", "does not exist"),
    ):
        assert main([f"maxtext_config={tmp_path / name}", "num_devices=8"]) == 2
        assert expect in capsys.readouterr().err, name


def test_json_and_subprocess(base):
    out = subprocess.run(
        [sys.executable, "-m", "selector", f"maxtext_config={base}", *REPORTED, "output=json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 1 and "Traceback" not in out.stdout + out.stderr
    data = json.loads(out.stdout)
    assert data["maxtext"]["ignored_count"] > 500
    assert data["maxtext"]["files"][-1].endswith("qwen3-next-80b-a3b.yml")
    assert Path(data["maxtext"]["files"][0]).name == "base.yml"


def test_facts_of_mixtral_capacity_and_unmodelled_axes(base, tmp_path):
    """Four MaxText facts, each from MaxText's own base.yml and one override: capacity
    on the sparse path (ignored there), capacity at inference, an axis the check does
    not model, norm_topk_prob=false where MaxText still normalises."""
    common = ["model_name=mixtral-8x7b", "num_devices=8"]
    sparse = selector.from_maxtext(base, [*common, "capacity_factor=1.25"])
    assert "MAXTEXT_SPARSE_IGNORES_CAPACITY" in codes(sparse.findings)
    assert "MAXTEXT_SPARSE_IGNORES_CAPACITY" not in codes(
        selector.from_maxtext(base, common).findings
    )
    inference = [*common, "sparse_matmul=false", "capacity_factor=1.25"]
    at_inference = selector.from_maxtext(base, [*inference, "model_call_mode=inference"])
    assert "MAXTEXT_INFERENCE_CAPACITY" in codes(at_inference.findings)
    assert "MAXTEXT_INFERENCE_CAPACITY" not in codes(
        selector.from_maxtext(base, inference).findings
    )
    unmodelled = selector.from_maxtext(
        base, [*common, "ici_fsdp_transpose_parallelism=2", "ici_fsdp_parallelism=4"]
    )
    assert "MAXTEXT_AXIS_NOT_MODELLED" in codes(unmodelled.findings)
    # base.yml itself says norm_topk_prob: false (a note, not a finding); a root config
    # that says true, overridden to false, is the user's own choice that MaxText ignores.
    root = tmp_path / "root.yml"
    root.write_text(Path(base).read_text().replace("norm_topk_prob: false", "norm_topk_prob: true"))
    moe = [
        "num_devices=8",
        "num_experts=8",
        "num_experts_per_tok=2",
        "decoder_block=mistral",
    ]
    norm = selector.from_maxtext(str(root), [*moe, "norm_topk_prob=false"])
    assert "MAXTEXT_NORM_TOPK_PROB_IGNORED" in codes(norm.findings)
    assert "MAXTEXT_NORM_TOPK_PROB_IGNORED" not in codes(
        selector.from_maxtext(str(root), moe).findings
    )


# Files under MaxText's configs/ that are not run configs, and why.
NOT_RUN_CONFIGS = {
    "custom_mesh_and_rule": "mesh-and-rule fragments, read through custom_mesh_and_rule=NAME",
}


def test_every_shipped_yaml_goes_through_the_route(maxtext_dir, capsys):
    """Every YAML MaxText 0.2.5 ships under configs/ that describes a run (training,
    inference, post-training, GPU and TPU variants; base_config chains resolved beside
    the file, then in MaxText's configs folder) gives a report: exit 0, 1 or 3 (within
    the memory margin), never 2, never a traceback."""
    from selector.cli import main

    root = maxtext_dir / "configs"
    files = sorted(root.rglob("*.yml"))
    chained = [f for f in files if "base_config:" in f.read_text()]
    assert len(files) == 129 and len(chained) == 38
    run = [f for f in files if f.relative_to(root).parts[0] not in NOT_RUN_CONFIGS]
    failed = {}
    for path in run:
        status = main([f"maxtext_config={path}", "num_devices=8"])
        out = capsys.readouterr()
        if status not in (0, 1, 3) or "Traceback" in out.out + out.err:
            failed[str(path.relative_to(root))] = out.err.strip()[:200]
    assert not failed, failed


def test_custom_mesh_and_rule_is_read_as_maxtext_reads_it(base):
    """cp-as-ep (MaxText's switch that folds the context devices into the expert
    group): its file's logical_axis_rules replace base.yml's, so the experts rest over
    context and expert; an unknown name is an error naming the files there."""
    common = ["model_name=qwen3-30b-a3b", "num_devices=8", "ici_context_parallelism=4"]
    plain = selector.from_maxtext(base, [*common, "ici_fsdp_parallelism=2"])
    folded = selector.from_maxtext(
        base, [*common, "ici_fsdp_parallelism=2", "custom_mesh_and_rule=cp-as-ep"]
    )
    assert plain.config.axis_rules.experts == ("expert",)
    assert folded.config.axis_rules.experts == ("context", "expert")
    assert any("cp-as-ep.yml" in n for n in folded.notes)
    with pytest.raises(selector.MaxTextError, match="cp-as-ep"):
        selector.from_maxtext(base, [*common, "custom_mesh_and_rule=nope"])


def test_route_fixes_are_spelled_in_maxtext_keys_and_pass_the_route(base):
    """DeepSeek-V3 on 256 devices with base.yml's float32 weights and 16 sequences of
    2,048 tokens a device: the whole step (131 GiB) is over a v5p even with the route's
    margin, MEMORY_EXCEEDED. Among the fixes the native check tries is param_dtype=
    bfloat16; on the MaxText route it is spelled weight_dtype=bfloat16 (MaxText's key),
    and applied on the same route it clears the error (exit 3: within the margin, where
    the fix in our spelling exits 2: unknown MaxText key). What the route offers is
    spelled in MaxText's keys or this check's own."""
    from selector.cli import main

    over = ["model_name=deepseek3-671b", "num_devices=256", "per_device_batch_size=16"]
    imported = selector.from_maxtext(base, over)
    _, found = selector.api.analyse_any(imported.config)
    (ours,) = [f for f in found if f.code == "MEMORY_EXCEEDED"]
    assert "param_dtype=bfloat16" in [x.render() for x in ours.tried]
    spelled = routed_findings(base, over)
    (memory,) = [f for f in spelled if f.code == "MEMORY_EXCEEDED"]
    rendered = [x.render() for x in memory.fixes]
    assert rendered and not any("param_dtype" in r for r in rendered)
    assert "param_dtype" not in memory.message
    # Those that add chips add slices, in MaxText's own keys (num_slices, dcn_*_parallelism).
    chips = [r for r in rendered if r.startswith("num_devices=")]
    assert all("num_slices=" in r and "dcn_fsdp_parallelism=" in r for r in chips)
    args = [f"maxtext_config={base}", *over]
    assert main(args) == 1
    assert main([*args, "weight_dtype=bfloat16"]) == 3
    assert main([*args, "param_dtype=bfloat16"]) == 2


def test_the_reason_says_where_the_dispatch_came_from(base):
    """A dispatch read from base.yml's sparse_matmul is not 'requested explicitly'."""
    imported = selector.from_maxtext(base, ["model_name=qwen3-30b-a3b", "num_devices=8"])
    reason = imported.explain_reason("requested explicitly with dispatch=megablox; x")
    assert reason == (
        "MaxText runs megablox: sparse_matmul=true (from base.yml) runs its dropless "
        "grouped matmul; x"
    )
    mine = selector.from_maxtext(base, ["num_devices=8", "sparse_matmul=false"])
    assert "sparse_matmul=false (from your override)" in mine.dispatch_source


@pytest.mark.parametrize(
    "setting",
    [
        "moe_dispatch_no_expert_sharding=true",
        "shard_exp_on_fsdp=true",
        "shard_embed_moe_on_fsdp=true",
        "use_ring_of_experts=true",
        "context_sharding=expert",
    ],
)
def test_maxtext_sharding_switches_not_modelled_are_named(base, setting):
    """A MaxText 0.2.5 key that changes which axes shard the MoE block, set away from
    base.yml's value, is a warning naming it; at base.yml's value it says nothing."""
    from selector.maxtext.facts import SHARDING_KEYS_NOT_MODELLED

    key = setting.split("=")[0]
    assert key in SHARDING_KEYS_NOT_MODELLED
    common = ["model_name=qwen3-30b-a3b", "num_devices=8"]
    plain = selector.from_maxtext(base, common)
    assert "MAXTEXT_SHARDING_NOT_MODELLED" not in codes(plain.findings)
    switched = selector.from_maxtext(base, [*common, setting])
    (f,) = [f for f in switched.findings if f.code == "MAXTEXT_SHARDING_NOT_MODELLED"]
    assert f.setting == key and key in f.message and "base.yml" in f.message


def test_expert_shard_attention_option_is_explained(base, capsys):
    """MaxText 0.2.5's config has no expert_shard_attention_option (only its deprecated
    pyconfig reads it): exit 2 with where that layout lives now."""
    args = [f"maxtext_config={base}", "model_name=qwen3-30b-a3b", "num_devices=8"]
    assert main([*args, "expert_shard_attention_option=context"]) == 2
    err = capsys.readouterr().err
    assert "custom_mesh_and_rule=ep-as-cp" in err and "Traceback" not in err


@pytest.mark.parametrize(
    "extra,spelled",
    [
        (["expert_exchange=all_to_all"], "has no setting known to give it"),
        (["ici_expert_parallelism=2", "ici_fsdp_parallelism=1"], "ici_expert_parallelism=2"),
        (["expert_exchange=gather"], "ici_expert_parallelism=1"),
    ],
)
def test_a_recommended_placement_names_the_maxtext_settings(base, extra, spelled):
    """On the route, the plan's expert placement is spelled in MaxText's settings, or
    the report says MaxText has none. An exchange over the context devices has none:
    cp-as-ep, the switch that rests the experts over context, leaves the MoE tokens
    unsplit over context, which the route reports as an error."""
    over = [
        "model_name=qwen3-30b-a3b",
        "num_devices=8",
        "ici_context_parallelism=4",
        "ici_fsdp_parallelism=2",
        "per_device_batch_size=0.25",
        *extra,
    ]
    imported = selector.from_maxtext(base, over)
    plan, _ = selector.api.analyse_any(imported.config)
    reason = imported.explain_reason(plan.reason, plan)
    assert spelled in reason.replace("\n", " ")
    if extra == ["expert_exchange=all_to_all"]:
        # The fsdp devices join the context ones in the group: MaxText has no setting
        # for that either (its expert axis is a mesh axis of its own).
        assert plan.placement.group_axes == ("fsdp", "context")
        folded = selector.from_maxtext(base, [*over, "custom_mesh_and_rule=cp-as-ep"])
        _, found = selector.api.analyse_any(folded.config)
        assert "AXIS_RULE_WEIGHTS_OFF_TOKENS" in codes(found)


def test_the_route_picks_what_maxtext_runs_and_shows_the_exchange_beside_it(base, capsys):
    """Without an expert axis MaxText all-gathers the expert weights: the route's pick is
    megablox/gather, while this project's exchange over the context devices, which
    MaxText has no setting for, is shown as the alternative with its numbers."""
    args = [
        f"maxtext_config={base}",
        "model_name=qwen3-next-80b-a3b",
        "ici_context_parallelism=4",
        "num_devices=64",
        "per_device_batch_size=0.25",
        "context_parallel_load_balance=false",  # MaxText refuses it with cp for Qwen3-Next
    ]
    status, got = _route_json(args, capsys)
    chosen = [c for c in got["plan"]["candidates"] if c["chosen"]]
    assert status == 0 and [c["name"] for c in chosen] == ["megablox/gather"]
    (note,) = [n for n in got["maxtext"]["notes"] if n.startswith("Alternative")]
    assert "megablox/all_to_all" in note and "MaxText has no setting" in note


def test_the_route_offers_no_placement_maxtext_cannot_be_told(base, capsys):
    """DeepSeek-V3 on v5p-512 at cp 4 and 32k tokens is within the margin (exit 3). The
    exchange over fsdp and context would bring it to 62.8 GiB, but MaxText 0.2.5 has no
    key for that placement: the route does not offer it as a fix, and given by hand it
    is a warning that the numbers are layers.MoEBlock's, whose fix is what MaxText runs."""
    args = [
        f"maxtext_config={base}",
        "model_name=deepseek3-671b",
        "compile_topology=v5p-512",
        "ici_context_parallelism=4",
        "per_device_batch_size=0.25",
        "max_target_length=32768",
    ]
    status, got = _route_json(args, capsys)
    (margin,) = [f for f in got["findings"] if f["code"] == "MEMORY_WITHIN_MARGIN"]
    assert status == 3
    assert not any("expert_exchange" in x for x in margin["fixes"])
    assert "expert_exchange" not in margin.get("no_fix", "")
    placed = [*args, "expert_exchange=all_to_all", "expert_group=expert_sequence_and_fsdp"]
    status, got = _route_json(placed, capsys)
    (warned,) = [f for f in got["findings"] if f["code"] == "MAXTEXT_PLACEMENT_NOT_MAXTEXTS"]
    assert status == 0 and warned["severity"] == "warning"
    assert warned["fixes"] == ["expert_exchange=gather expert_group=auto"]
    # Giving MaxText's own placement by hand says nothing, and offers no other placement.
    status, got = _route_json([*args, "expert_exchange=gather", "expert_group=auto"], capsys)
    assert "MAXTEXT_PLACEMENT_NOT_MAXTEXTS" not in {f["code"] for f in got["findings"]}
    assert not any("expert_exchange" in x for f in got["findings"] for x in f["fixes"])
    # With compile_topology, more chips are more slices of the topology, in its key.
    (margin,) = [f for f in got["findings"] if f["code"] == "MEMORY_WITHIN_MARGIN"]
    assert margin["fixes"][0].startswith("compile_topology_num_slices=4 ")
    assert not any("num_devices" in x for x in margin["fixes"])


def test_maxtexts_own_exchange_given_by_hand_is_counted_as_maxtext_runs_it(base):
    """With an expert axis MaxText exchanges over it into a receive buffer of its own
    size; spelling that placement by hand (expert_exchange=all_to_all
    expert_group=expert) is the same launch and counts the same bytes as leaving it to
    MaxText, where a group left to this check (expert_group=auto) is warned about."""
    over = [
        "model_name=deepseek3-671b",
        "compile_topology=v5p-512",
        "ici_context_parallelism=4",
        "ici_expert_parallelism=8",
        "ici_fsdp_parallelism=-1",
        "per_device_batch_size=0.25",
        "max_target_length=32768",
    ]
    theirs = selector.from_maxtext(base, over)
    spelled = selector.from_maxtext(
        base, [*over, "expert_exchange=all_to_all", "expert_group=expert"]
    )
    assert spelled.config == theirs.config
    assert "MAXTEXT_PLACEMENT_NOT_MAXTEXTS" not in codes(spelled.findings)
    auto = selector.from_maxtext(base, [*over, "expert_exchange=all_to_all"])
    (warned,) = [f for f in auto.findings if f.code == "MAXTEXT_PLACEMENT_NOT_MAXTEXTS"]
    assert "runs expert_exchange=all_to_all expert_group=expert here" in warned.message


def _route_json(args: list[str], capsys) -> tuple[int, dict]:
    status = main([*args, "output=json"])
    out = capsys.readouterr().out
    return status, (json.loads(out) if status != 2 else {})


@settings(
    max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
def test_route_fixes_pass_the_route_property(maxtext_dir, base, capsys, data):
    """Over MaxText's shipped MoE model files and plausible overrides: every finding on
    the route names a MaxText key (or this check's own), and every fix it offers, applied
    as one more override on the same route, is accepted (exit 0 or 1) and clears that
    finding."""
    from selector.maxtext.importer import OWN_KEYS

    name = data.draw(st.sampled_from(moe_models(maxtext_dir)), label="model")
    devices = data.draw(st.sampled_from([8, 64, 256]), label="num_devices")
    over = [f"model_name={name}", f"num_devices={devices}"]
    over += data.draw(
        st.lists(
            st.sampled_from(
                [
                    "ici_context_parallelism=4",
                    "per_device_batch_size=4",
                    "weight_dtype=bfloat16",
                    "max_target_length=32768",
                    "capacity_factor=1.0",
                    "sparse_matmul=false",
                    "ici_expert_parallelism=8",
                ]
            ),
            unique=True,
            max_size=3,
        ),
        label="overrides",
    )
    args = [f"maxtext_config={base}", *over]
    status, report = _route_json(args, capsys)
    if status == 2:
        return  # a MaxText error (say, an axis product that is not num_devices): no fixes
    raw, _, _ = selector.maxtext.files.load_chain(Path(base))
    for finding in report["findings"]:
        setting = finding["setting"].split(".")[0]
        assert setting in raw or setting in OWN_KEYS or setting.startswith("ici_"), finding
        for fix_text in finding["fixes"]:
            keys = [part.split("=")[0] for part in fix_text.split()]
            assert all(k in raw or k in OWN_KEYS for k in keys), fix_text
            fixed_status, fixed = _route_json([*args, *fix_text.split()], capsys)
            assert fixed_status in (0, 1, 3), (over, fix_text)
            assert finding["code"] not in {f["code"] for f in fixed["findings"]}, (over, fix_text)


def test_maxtext_habits_positional_config_topology_and_model_file(maxtext_dir, capsys):
    """MaxText's `train.py CONFIG key=value`: the config path positionally; its
    ahead-of-time target compile_topology=v5p-16 (TensorCores: 8 chips) names the chips
    priced; a model file given as the config is read with base.yml beneath it, as
    model_name= would read it."""
    base = str(maxtext_dir / "configs" / "base.yml")
    model = str(maxtext_dir / "configs" / "models" / "qwen3-30b-a3b.yml")
    common = ["compile_topology=v5p-16", "per_device_batch_size=1", "max_target_length=4096"]
    status, positional = _route_json([base, "model_name=qwen3-30b-a3b", *common], capsys)
    assert status == 0
    assert positional["plan"]["per_device"]["num_devices"] == 8
    assert positional["hardware"] == "v5p"
    status, from_model = _route_json([model, *common], capsys)
    assert status == 0
    assert any("is a model file" in n for n in from_model["maxtext"]["notes"])
    assert from_model["model"] == positional["model"]
    assert from_model["model"]["params_total"] / 1e9 == pytest.approx(30.5, rel=0.03)
    # A topology this check cannot price, and a model file with another model_name: exit 2.
    assert main([base, "compile_topology=v5p-15"]) == 2
    assert main([model, "model_name=mixtral-8x7b"]) == 2
    assert main(["no/such/base.yml"]) == 2
    assert "Traceback" not in capsys.readouterr().err


QWEN3_NEXT_CP4 = [
    "model_name=qwen3-next-80b-a3b",
    "ici_context_parallelism=4",
    "per_device_batch_size=0.25",
    "max_target_length=8192",
    "num_devices=64",
    "context_parallel_load_balance=false",  # MaxText refuses it with cp for Qwen3-Next
]


@pytest.mark.parametrize("override, origin", [(None, "from base.yml"), (64, "from your override")])
def test_maxtext_row_tile_is_honoured(base, override, origin):
    """MaxText's megablox path runs its Pallas kernel at wi_tile_fwd_batch_seq rows a
    tile, unclamped (read in its layers/moe.py): the route counts the rows at it, the
    layers get it as the plan's tile, and a note says where the value came from. At
    base.yml's 512 and 40 routed rows an expert that is 512 + 39 rows of work each."""
    extra = [] if override is None else [f"wi_tile_fwd_batch_seq={override}"]
    imported = selector.from_maxtext(base, QWEN3_NEXT_CP4 + extra)
    tm = 512 if override is None else override
    assert imported.config.gmm_row_tile == tm
    assert any(f"wi_tile_fwd_batch_seq={tm} ({origin})" in n for n in imported.notes)
    plan, found = selector.api.analyse_any(imported.config)
    assert plan is not None and "GMM_ROW_TILE_UNSUPPORTED" not in codes(found)
    assert (plan.gmm_tiling.tm, plan.gmm_tiling.source) == (tm, "gmm_row_tile")
    assert plan.chosen_estimate.rows == 512 * (tm + 39)  # 512 experts of 40 rows


def test_maxtext_row_tile_the_kernel_cannot_take_is_an_error(base):
    imported = selector.from_maxtext(base, QWEN3_NEXT_CP4 + ["wi_tile_fwd_batch_seq=20"])
    _, found = selector.api.analyse_any(imported.config)
    assert "GMM_ROW_TILE_UNSUPPORTED" in codes(found)


def test_qwen3_next_with_load_balanced_cp_is_refused_as_maxtext_refuses_it(base, capsys):
    """MaxText 0.2.5 refuses decoder_block=qwen3_next with context parallelism and
    context_parallel_load_balance=true (its Gated DeltaNet recurrence needs the shards
    in sequence order; its train_compile raised this for v5p-128, cp=4, measured from
    outside): the route reports it with the fix MaxText names."""
    args = [base, "model_name=qwen3-next-80b-a3b", "ici_context_parallelism=4"]
    args += ["num_devices=64", "per_device_batch_size=0.25"]
    status, got = _route_json(args, capsys)
    (f,) = [f for f in got["findings"] if f["code"] == "RECURRENCE_LOAD_BALANCED"]
    assert status == 1 and f["fixes"] == ["context_parallel_load_balance=false"]
    status, _ = _route_json([*args, "context_parallel_load_balance=false"], capsys)
    assert status == 0


def test_route_fix_previews_are_the_rerun_and_a_route_only_fix_is_found(base):
    """Mixtral-8x7B on v5p-16 at cp 4 (per_device_batch_size 0.25, sequences of 32k
    tokens, base.yml's float32 weights): MaxText's weight_dtype moves its optimizer state too, so on this route
    each fix's preview is what re-reading the files with it gives, not what our key
    would; a fix the native count dropped (over the chip there) is kept when the route's
    re-run fits. Every fix offered is re-run here and must say the same bytes."""

    over = [
        "model_name=mixtral-8x7b",
        "compile_topology=v5p-16",
        "ici_context_parallelism=4",
        "ici_fsdp_parallelism=2",
        "per_device_batch_size=0.25",
        "max_target_length=32768",
    ]
    imported = selector.from_maxtext(base, over)
    _, found = selector.api.analyse_any(imported.config)
    spelled = routed_findings(base, over)
    # Within the route's margin (v5p -27%/+41%) of the chip.
    memory_codes = ("MEMORY_EXCEEDED", "MEMORY_WITHIN_MARGIN")
    (memory,) = [f for f in spelled if f.code in memory_codes]
    assert memory.fixes
    for fix_ in memory.fixes:
        extra = fix_.render().split()
        plan, _ = selector.api.analyse_any(selector.from_maxtext(base, [*over, *extra]).config)
        assert fix_.held_bytes == plan.chosen_estimate.device_bytes, fix_.render()
        assert f"{fix_.held_bytes / 2**30:.3g} GiB" in memory.message
    held = [f.held_bytes for f in memory.fixes]
    assert held == sorted(held)
    # Our key keeps float32 moments, so natively param_dtype=bfloat16 leaves the step
    # within the margin and the native check drops it; MaxText's weight_dtype moves the
    # optimizer state too, and the route's re-run of the fix it tried keeps it.
    (ours,) = [f for f in found if f.code in memory_codes]
    assert "param_dtype=bfloat16" not in [x.render() for x in ours.fixes]
    assert "param_dtype=bfloat16" in [x.render() for x in ours.tried]
    assert "weight_dtype=bfloat16" in [x.render() for x in memory.fixes]


def test_a_fitting_joint_fix_drops_the_fixes_that_stay_over_the_chip(base):
    """The README's MaxText case (Qwen3-Next, 8 chips, cp 4, per_device_batch_size 1)
    has three errors; their joint fix fits a v5p, so no finding also offers a fix that
    leaves a device over the chip (per_device_batch_size=0.25 alone: 175 GiB)."""
    from selector.cli import main

    args = [
        f"maxtext_config={base}",
        "model_name=qwen3-next-80b-a3b",
        "ici_context_parallelism=4",
        "per_device_batch_size=1",
        "max_target_length=8192",
        "num_devices=8",
    ]
    imported = selector.from_maxtext(base, args[1:])
    _, found = selector.api.analyse_any(imported.config)
    errors = [f for f in found if f.severity.value == "error"]
    assert len(errors) >= 2
    for f in errors:
        assert f.fixes[0].note.startswith("clears ") and f.fixes[0].fits, f.code
        assert all(x.fits is not False for x in f.fixes), (f.code, [x.text() for x in f.fixes])
    assert main(args) == 1


def test_the_route_runs_one_fix_search_each_config_analysed_once(base, monkeypatch, capsys):
    """The README's MaxText case: the config is analysed once, the exchange left to the
    selector once (the alternative shown beside MaxText's pick), and each fix once, on
    the route, by the same search the native route runs (`plan.analyse`). No config is
    analysed twice and no fix's re-run checks fixes of its own (the search is not
    nested)."""
    from selector import plan as plan_module
    from selector.cli import main

    analysed = []
    inner = plan_module._analyse

    def counting(cfg, live_shape=None):
        analysed.append((cfg, tuple(sorted((live_shape or {}).items()))))
        return inner(cfg, live_shape)

    monkeypatch.setattr(plan_module, "_analyse", counting)
    over = ["model_name=qwen3-next-80b-a3b", "ici_context_parallelism=4"]
    over += ["per_device_batch_size=1", "max_target_length=8192", "num_devices=8"]
    assert main([f"maxtext_config={base}", *over, "output=json"]) == 1
    report = json.loads(capsys.readouterr().out)
    offered = {fix for f in report["findings"] for fix in f["fixes"]}
    assert len(analysed) == len(set(analysed)), "a config analysed twice"
    # The config, its exchange-free alternative, and at least each fix offered; at most
    # each fix the three findings proposed (tried) and the joint merges of three each.
    imported = selector.from_maxtext(base, over)
    _, found = plan_module.analyse(imported.config, check_fixes=False, given=imported.findings)
    proposed = sum(len(f.fixes) for f in found)
    assert 2 + len(offered) <= len(analysed) <= 2 + proposed + 3**3


def test_compile_topology_overrules_the_slice_and_device_counts_out_loud(base, capsys):
    """Under compile_topology MaxText takes the slices from compile_topology_num_slices
    (base.yml sets num_slices from it): a num_slices that says otherwise is noted as not
    read, and a num_devices other than the topology's chips is refused, not priced."""
    common = ["model_name=qwen3-30b-a3b", "compile_topology=v5p-128", "per_device_batch_size=1"]
    imported = selector.from_maxtext(base, [*common, "num_slices=4"])
    assert (imported.config.num_devices, imported.config.num_slices) == (64, 1)
    assert any("num_slices=4 is not read" in n for n in imported.notes)
    assert not any("num_slices=-1" in n for n in imported.notes)
    two = selector.from_maxtext(base, [*common, "compile_topology_num_slices=2", "num_devices=128"])
    assert (two.config.num_devices, two.config.num_slices) == (128, 2)
    assert not any("is not read" in n for n in two.notes)
    with pytest.raises(selector.maxtext.files.MaxTextError, match="num_devices=16 disagrees"):
        selector.from_maxtext(base, [*common, "num_devices=16"])
    assert main([base, *common, "num_devices=16"]) == 2
    assert "Traceback" not in capsys.readouterr().err
