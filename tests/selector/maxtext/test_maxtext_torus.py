"""MaxText's mesh on a v5p slice's torus: the check refuses, before launch, a mesh that
MaxText's create_device_mesh cannot lay out, as JAX's own assignment decides it."""

import itertools
import json
import math
import re
from pathlib import Path

import numpy as np
import pytest
from helpers import routed_findings
from jax._src import mesh_utils  # the assignment MaxText's create_device_mesh runs

import selector
from selector.maxtext.torus import MAXTEXT_MESH_AXES, unassigned_axis
from selector.targets import torus

ROOT = Path(__file__).resolve().parents[3]


def jax_unassigned(logical, physical):
    """The logical axis JAX's assignment stops at, or None when it lays the mesh out."""
    devices = np.arange(math.prod(physical)).reshape(physical)
    try:
        mesh_utils._create_device_mesh_for_nd_torus(devices, logical)
    except NotImplementedError as exc:
        return int(re.search(r"logical_axis_index (\d+)", str(exc)).group(1))
    return None


def meshes(chips: int, axes: int):
    """Every way to write `chips` as `axes` powers of two, in order."""
    powers = [2**i for i in range(int(math.log2(chips)) + 1)]
    return [s for s in itertools.product(powers, repeat=axes) if math.prod(s) == chips]


@pytest.mark.parametrize("chips", [16, 32, 64, 128, 256])
def test_assignment_is_jaxs(chips):
    """Over every 4-axis power-of-two mesh of a v5p slice, the check stops at the axis
    JAX's _create_device_mesh_for_nd_torus stops at, and passes what it lays out."""
    physical = torus("v5p", chips)
    shapes = meshes(chips, 4)
    outcomes = [(unassigned_axis(s, physical), jax_unassigned(s, physical)) for s in shapes]
    assert all(ours == theirs for ours, theirs in outcomes), [
        (s, o) for s, o in zip(shapes, outcomes, strict=True) if o[0] != o[1]
    ]
    assert any(o[0] is None for o in outcomes) and any(o[0] is not None for o in outcomes)


def test_maxtexts_own_failure_is_refused_before_launch(maxtext_dir):
    """MaxText 0.2.5's train_compile of DeepSeek-V3 (8 layers) for v5p-128 with context 2
    beside fsdp 32 stopped in create_device_mesh (its message is in the bench cache);
    the route refuses the same keys, and accepts context 4 beside fsdp 16, which
    compiled, and the fix it offers."""
    base = str(maxtext_dir / "configs" / "base.yml")
    cache = json.loads((ROOT / "bench" / "results" / "maxtext_step_cache.json").read_text())
    failed = [
        (command, entry)
        for command, entry in cache.items()
        if "ici_context_parallelism=2 ici_fsdp_parallelism=32" in command
        and "compile_topology=v5p-128" in command
    ]
    assert failed and all("logical_axis_index 5 of size 2" in e["message"] for _, e in failed)
    assert MAXTEXT_MESH_AXES[5] == "context"
    command = failed[0][0]
    over = [kv for kv in command.split()[5:] if "=" in kv]

    def analyse(config):
        return selector.api.analyse_any(config)[1]

    def findings(*extra):
        imported = selector.from_maxtext(base, [*over, *extra])
        found = imported.findings + analyse(imported.config)
        return found, [f.code for f in found]

    found, codes = findings()
    assert "MAXTEXT_MESH_NOT_ON_TORUS" in codes
    spelled = routed_findings(base, over)
    (torus_finding,) = [f for f in spelled if f.code == "MAXTEXT_MESH_NOT_ON_TORUS"]
    assert torus_finding.setting == "ici_context_parallelism"
    assert "context=2 is not the product" in torus_finding.message
    assert "64-chip v5p slice (4x4x4)" in torus_finding.message
    assert "(fsdp=32, context=2)" in torus_finding.message
    assert "splits a physical axis" in torus_finding.fixes[0].note
    assert [x.render() for x in torus_finding.fixes] == ["allow_split_physical_axes=true"]
    assert "MAXTEXT_MESH_NOT_ON_TORUS" not in findings("allow_split_physical_axes=true")[1]
    four = [kv.replace("=2", "=4").replace("=32", "=16") for kv in over]
    assert "MAXTEXT_MESH_NOT_ON_TORUS" not in [
        f.code for f in selector.from_maxtext(base, four).findings
    ]


def _codes(base, over):
    return [
        f.code for f in selector.from_maxtext(base, ["model_name=qwen3-30b-a3b", *over]).findings
    ]


def test_each_slice_of_a_multislice_run_and_a_custom_mesh_are_checked(maxtext_dir):
    """Each slice lays out its ICI axes alone (the DCN part of an axis is across slices),
    and a custom_mesh_and_rule file's mesh_axes replace the config's."""
    base = str(maxtext_dir / "configs" / "base.yml")
    two = ["compile_topology=v5p-128", "compile_topology_num_slices=2", "dcn_data_parallelism=2"]
    cp2 = ["ici_context_parallelism=2", "ici_fsdp_parallelism=32"]
    assert "MAXTEXT_MESH_NOT_ON_TORUS" in _codes(base, [*two, *cp2])
    cp4 = ["ici_context_parallelism=4", "ici_fsdp_parallelism=16"]
    assert "MAXTEXT_MESH_NOT_ON_TORUS" not in _codes(base, [*two, *cp4])
    custom = ["compile_topology=v5p-128", "custom_mesh_and_rule=cp-as-ep"]
    assert "MAXTEXT_MESH_NOT_ON_TORUS" in _codes(base, [*custom, *cp2])
    assert "MAXTEXT_MESH_NOT_ON_TORUS" not in _codes(base, [*custom, *cp4])
    # pure-fsdp's mesh has no context axis: the sizes fall short of the slice, which is
    # not this check's to say.
    fsdp_only = ["compile_topology=v5p-128", "custom_mesh_and_rule=pure-fsdp"]
    assert "MAXTEXT_MESH_NOT_ON_TORUS" not in _codes(base, [*fsdp_only, *cp2])


def test_a_bad_switch_is_named(maxtext_dir):
    base = str(maxtext_dir / "configs" / "base.yml")
    with pytest.raises(selector.maxtext.MaxTextError, match="allow_split_physical_axes"):
        _codes(base, ["compile_topology=v5p-128", "allow_split_physical_axes=maybe"])


def test_small_and_other_slices_are_not_checked(maxtext_dir):
    """v5p's 2x2x2 slice has its own ordering (any shape), v6e slices theirs, and a chip
    count that is no v5p slice (24) or a mesh that does not resolve is left to the other
    checks."""
    base = str(maxtext_dir / "configs" / "base.yml")
    for over in (
        ["compile_topology=v5p-16", "ici_context_parallelism=8", "ici_fsdp_parallelism=1"],
        ["compile_topology=v6e-64", "ici_context_parallelism=2", "ici_fsdp_parallelism=32"],
        ["num_devices=24", "ici_context_parallelism=2"],
        # More devices than the slice has: no mesh resolves, and the mesh's own finding says so.
        ["compile_topology=v5p-128", "ici_context_parallelism=4", "ici_expert_parallelism=32"],
    ):
        codes = [f.code for f in selector.from_maxtext(base, over).findings]
        assert "MAXTEXT_MESH_NOT_ON_TORUS" not in codes, over


def test_the_command_line_shows_the_verified_fix(maxtext_dir, capsys):
    """The importer's findings go through the route's fix check like the analysis' do:
    the report spells the fix into the message, and the run exits 1."""
    from selector.cli import main

    base = str(maxtext_dir / "configs" / "base.yml")
    over = ["model_name=qwen3-30b-a3b", "compile_topology=v5p-128", "per_device_batch_size=0.5"]
    status = main([base, *over, "ici_context_parallelism=2", "ici_fsdp_parallelism=32"])
    out = capsys.readouterr().out
    assert status == 1
    assert "MAXTEXT_MESH_NOT_ON_TORUS" in out
    assert "Fix: allow_split_physical_axes=true" in " ".join(out.split())
