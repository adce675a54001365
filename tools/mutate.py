"""Mutation testing of the modules the selector's numbers and the layers' exchange rest
on, with mutmut (issue 29 line 5). Not part of the suite: a full pass is hours on two
cores.

    python -m tools.mutate selector               # every mutant of cost, memory, placement, policy
    python -m tools.mutate layers --sample 20     # 20 mutants a module, drawn with --seed
    python -m tools.mutate selector --sample 40 --seed 0
    python -m tools.mutate torus                  # the MaxText route's torus check
    python -m tools.mutate memory                 # every mutant of the memory model
    python -m tools.mutate cost                   # every mutant of the cost model
    python -m tools.mutate cost --survivors       # its survivors again, after new tests
    python -m tools.mutate memory --again         # re-judged after the tests changed
    python -m tools.mutate placement --function exchange_group   # one function's mutants
    python -m tools.mutate step --sample 40 --seed 0   # the whole step's count, sampled
    python -m tools.mutate step --module selector/architecture.py   # one module, every mutant
    python -m tools.mutate layout --sample 40 --seed 0   # the batch and mesh rules, sampled
    python -m tools.mutate settings --sample 60 --seed 0   # the rules on plain values
    python -m tools.mutate fixes --function verified      # the fix search, one function

Each part has its own modules and its own tests (PARTS): every selector test reaches
every selector function through `resolve`, so a surviving mutant costs its part's whole
selection, and the layer tests (minutes) would be run for every selector mutant if the
two shared one. A part runs in build/mutate-<part>/, a copy of the tracked files whose
pyproject.toml names the part's modules and tests; mutmut keeps its results there
(`mutmut show NAME` inside it shows one). The summary counts, per module, the mutants
killed and those that survived, with each survivor's diff; a sample states how many
mutants it drew of how many.
"""

from __future__ import annotations

import argparse
import os
import random
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

PARTS = {
    "selector": {
        "modules": (
            "selector/cost.py",
            "selector/memory_model.py",
            "selector/placement.py",
            "selector/policy.py",
        ),
        "tests": (
            "tests/selector/test_cost.py",
            "tests/selector/test_memory_model.py",
            "tests/selector/test_selector_decisions.py",
            "tests/selector/test_selector_api.py",
            "tests/selector/test_selector_findings.py",
            "tests/selector/test_candidate_plan.py",
            "tests/selector/test_whole_model.py",
            "tests/selector/test_report_text.py",
        ),
    },
    "layers": {
        "modules": ("layers/expert_parallel.py", "layers/grouped_matmul.py"),
        # The parity tests run the Pallas kernels inside the exchanged block (interpret
        # mode); the target tests compile it for TPU, where only Mosaic kernels pass.
        "tests": (
            "tests/layers/test_grouped_matmul.py",
            "tests/layers/test_expert_parallel.py",
            "tests/layers/test_layers_parity.py",
            "tests/selector/test_targets.py",
        ),
    },
    # Where the expert weights rest and which axes form the expert group, against the
    # selector's tests that read the placement (the exchange's parity is the layers').
    "placement": {
        "modules": ("selector/placement.py",),
        "tests": (
            "tests/selector/test_selector_decisions.py",
            "tests/selector/test_report_text.py",
            "tests/selector/test_selector_findings.py",
        ),
    },
    # The cost model (candidates, rows from the tile plans, FLOPs, traffic, time) against
    # every selector test that prices a plan: resolve reaches it from each of them.
    "cost": {
        "modules": ("selector/cost.py",),
        "tests": (
            "tests/selector/test_cost.py",
            "tests/selector/test_candidate_plan.py",
            "tests/selector/test_memory_model.py",
            "tests/selector/test_selector_decisions.py",
            "tests/selector/test_selector_api.py",
            "tests/selector/test_selector_findings.py",
            "tests/selector/test_whole_model.py",
            "tests/selector/test_report_text.py",
        ),
    },
    # The counted time (what a program does, priced by the machine's constants) against
    # its own tests and the cost model's.
    "timing": {
        "modules": ("selector/timing.py",),
        "tests": ("tests/selector/test_timing.py", "tests/selector/test_cost.py"),
    },
    # The counted memory model and the dispatches' arrays it and the traffic sum, against
    # their own tests and the cost model's (a survivor costs about 20 s here, against
    # 95 s in the selector part's whole selection).
    "memory": {
        "modules": ("selector/memory_model.py", "selector/block_arrays.py"),
        "tests": ("tests/selector/test_memory_model.py", "tests/selector/test_cost.py"),
    },
    # The auto policy (which candidate wins, and why) against the decisions, the report's
    # reasons and the findings.
    "policy": {
        "modules": ("selector/policy.py",),
        "tests": (
            "tests/selector/test_selector_decisions.py",
            "tests/selector/test_report_text.py",
            "tests/selector/test_selector_findings.py",
        ),
    },
    # The whole step's memory, the parameter counts and the memory fixes the rules offer
    # (issue 49 line 5), against the tests that count them by hand.
    "step": {
        "modules": (
            "selector/step_memory.py",
            "selector/architecture.py",
            "selector/rules/strategy.py",
        ),
        "tests": (
            "tests/selector/test_whole_model.py",
            "tests/selector/test_drop_fraction.py",
            "tests/selector/test_rules_strategy.py",
            "tests/selector/test_margins.py",
            "tests/selector/test_cost.py",
            "tests/selector/test_selector_findings.py",
            "tests/selector/test_memory_model.py",
        ),
    },
    # The batch and mesh rules a launch is checked against (local batch inflation, shards
    # that do not divide, decode under cp) and the per-device numbers they read.
    "layout": {
        "modules": (
            "selector/rules/layout.py",
            "selector/per_device.py",
            "selector/rules/moves.py",
        ),
        "tests": (
            "tests/selector/test_rules_layout.py",
            "tests/selector/test_selector_findings.py",
            "tests/selector/test_selector_decisions.py",
            "tests/selector/test_selector_api.py",
            "tests/selector/test_rules_strategy.py",
            "tests/selector/test_whole_model.py",
        ),
    },
    # The rules on plain values and on the decoder's settings, checked before anything
    # is derived from them (bad input gets an error that names the setting and its fix).
    "settings": {
        "modules": ("selector/rules/settings.py", "selector/rules/model.py"),
        "tests": (
            "tests/selector/test_rules_settings.py",
            "tests/selector/test_selector_findings.py",
            "tests/selector/test_whole_model.py",
            "tests/selector/test_selector_api.py",
            "tests/selector/test_selector_decisions.py",
            "tests/selector/test_rules_strategy.py",
            "tests/selector/maxtext/test_maxtext.py",
        ),
    },
    # The fix search every finding's fixes pass through (each run on the route and kept
    # when it clears its finding; a device move completed with its batch), against the
    # tests that pin fixes.
    "fixes": {
        "modules": ("selector/plan.py",),
        "tests": (
            "tests/selector/test_selector_findings.py",
            "tests/selector/test_cost.py",
            "tests/selector/test_rules_layout.py",
            "tests/selector/test_rules_settings.py",
            "tests/selector/test_rules_strategy.py",
            "tests/selector/test_selector_decisions.py",
            "tests/selector/maxtext/test_maxtext_torus.py",
        ),
    },
    # The MaxText route's torus check, against JAX's own assignment and MaxText's files.
    "torus": {
        "modules": ("selector/maxtext/torus.py",),
        "tests": ("tests/selector/maxtext/test_maxtext_torus.py",),
    },
}


def mutant_names(module: str) -> list[str]:
    """Every mutant mutmut makes of `module`, by the names `mutmut run` takes."""
    from mutmut.mutation.file_mutation import mutate_file_contents
    from mutmut.utils.format_utils import get_mutant_name

    path = Path(module)
    mutated = mutate_file_contents(module, (ROOT / path).read_text())
    return sorted(get_mutant_name(path, name) for name in mutated.mutant_names)


def toml_list(items) -> str:
    return "[" + ", ".join(f'"{i}"' for i in items) + "]"


def workdir(part: str) -> Path:
    """build/mutate-<part>: the tracked files, with [tool.mutmut] set to the part."""
    work = ROOT / "build" / f"mutate-{part}"
    tracked = subprocess.run(
        ["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    for name in tracked:
        src, dst = ROOT / name, work / name
        if src.is_file() and (not dst.exists() or dst.read_bytes() != src.read_bytes()):
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst)
    spec = PARTS[part]
    pyproject = (ROOT / "pyproject.toml").read_text()
    pyproject = re.sub(
        r"(?m)^only_mutate = \[[^\]]*\]", f"only_mutate = {toml_list(spec['modules'])}", pyproject
    )
    pyproject = re.sub(
        r"(?m)^pytest_add_cli_args_test_selection = \[[^\]]*\]",
        f"pytest_add_cli_args_test_selection = {toml_list(spec['tests'])}",
        pyproject,
    )
    (work / "pyproject.toml").write_text(pyproject)
    return work


def results(work: Path) -> dict[str, str]:
    out = subprocess.run(
        [sys.executable, "-m", "mutmut", "results", "--all", "true"],
        cwd=work,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return dict(line.strip().rsplit(": ", 1) for line in out.splitlines() if ": " in line.strip())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("part", choices=sorted(PARTS))
    ap.add_argument("--sample", type=int, metavar="N", help="N mutants a module, drawn")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-children", type=int, default=2)
    ap.add_argument(
        "--function", metavar="NAME", help="only the mutants of this function (every one)"
    )
    ap.add_argument(
        "--module",
        metavar="PATH",
        action="append",
        help="only this module of the part (repeatable; a full pass of one module)",
    )
    ap.add_argument(
        "--again",
        action="store_true",
        help="run every chosen mutant even where mutmut stored a result (after the tests "
        "changed: a plain run resumes, and keeps the survivors of the tests before)",
    )
    ap.add_argument(
        "--survivors",
        action="store_true",
        help="run again only the chosen mutants mutmut stored as survivors (after tests "
        "were added for them; a changed function's mutants need --function NAME --again)",
    )
    args = ap.parse_args(argv)
    spec = PARTS[args.part]
    work = workdir(args.part)
    rng = random.Random(args.seed)  # one draw across the part's modules, in PARTS order
    chosen: dict[str, list[str]] = {}
    total: dict[str, int] = {}
    every_of: dict[str, list[str]] = {}
    modules = spec["modules"]
    if args.module:
        unknown = sorted(set(args.module) - set(modules))
        if unknown:
            ap.error(
                f"part {args.part!r} has no module {', '.join(unknown)}: it has {', '.join(modules)}"
            )
        modules = tuple(m for m in modules if m in args.module)
    for module in modules:
        every = mutant_names(module)
        if args.function:  # mutmut names x_NAME__mutmut_K, a method xǁClassǁNAME__mutmut_K
            every = [
                n
                for n in every
                if f"x_{args.function}__mutmut_" in n or f"ǁ{args.function}__mutmut_" in n
            ]
        total[module] = len(every)
        every_of[module] = every
        chosen[module] = rng.sample(every, min(args.sample, len(every))) if args.sample else every
    if args.survivors:
        stored = results(work)
        chosen = {m: [n for n in chosen[m] if stored.get(n) == "survived"] for m in chosen}
    names = [n for module in modules for n in chosen[module]]
    if args.module and not (args.sample or args.function or args.again or args.survivors):
        stored = results(work)  # resume: the module's mutants without a stored result
        names = [n for n in names if stored.get(n) not in ("killed", "survived", "timeout")]
    run = [sys.executable, "-m", "mutmut", "run", "--max-children", str(args.max_children)]
    # Named mutants are run even when a result is stored (a sample is re-judged whole).
    named = args.sample or args.function or args.again or args.survivors or args.module
    if args.survivors and not names:
        print("no stored survivors to run again")
        return 0
    # JAX's persistent compilation cache: a mutant whose programs compile to the clean
    # run's HLO reuses them (the layers' full pass ran 15 to 25 mutants a minute with
    # it, its seeded samples 5 to 6 without). The cache keys on the HLO, so a mutant
    # that changes a program compiles it afresh.
    env = dict(os.environ)
    env.setdefault("JAX_COMPILATION_CACHE_DIR", str(ROOT / "build" / "jax-cache"))
    env.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    env.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "-1")
    # A module whose every mutant has a result runs nothing (an empty list would run all).
    ran = not (args.module and not names)
    code = (
        subprocess.run(run + (names if named else []), cwd=work, env=env).returncode if ran else 0
    )
    if code != 0:
        return code
    status = results(work)
    print(f"\nmutation testing, part {args.part!r} (mutmut; results in {work}):")
    survivors = []
    for module in modules:
        mine = chosen[module]
        survived = [n for n in mine if status.get(n, "not checked") != "killed"]
        survivors += survived
        of = (
            f"a sample of {len(mine)} of {total[module]} mutants (seed {args.seed})"
            if args.sample
            else f"{total[module]} mutants"
        )
        if args.survivors:
            of = f"the stored survivors of {total[module]} mutants"
        if args.function:
            of += f" of {args.function}"
        print(f"  {module}: {len(mine) - len(survived)} of {len(mine)} killed ({of})")
        if args.survivors or args.function:
            every = every_of[module]
            killed = sum(status.get(n) == "killed" for n in every)
            print(f"    every stored result of those {len(every)}: {killed} killed")
    for name in survivors:
        print(f"\n{name}: {status.get(name)}")
        shown = subprocess.run(
            [sys.executable, "-m", "mutmut", "show", name], cwd=work, capture_output=True, text=True
        ).stdout
        print("\n".join(line for line in shown.splitlines() if line[:2] in ("- ", "+ ")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
