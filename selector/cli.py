"""`python -m selector [options] [key=value ...]`: the pre-launch check.

Composes the packaged config tree with Hydra overrides (Hydra's compose API and
override grammar: `key=value`, `group=option`, `~key`, sweeps with -m), resolves and
validates it, and prints the plan and findings. It never imports jax.

Exit status: 0 no errors (warnings allowed), 1 validation errors, 2 unusable input
(unknown key, wrong type, unparsable override, unreadable file). Never a traceback.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import os
import sys
import time

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException, OverrideParseException
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from .api import analyse_any
from .compose import compose, override_error, override_key, to_config
from .config import Exchange, ExpertGroup, OutputFormat
from .findings import ConfigError, errors_in, shown
from .layout_search import exit_code, render_search, search
from .maxtext import MaxTextError, analyse_on_route, from_maxtext
from .plan import analyse
from .plugins import check_mode
from .report import render_json, render_text

EXIT_OK, EXIT_INVALID, EXIT_USAGE, EXIT_MARGIN = 0, 1, 2, 3
# A sweep exits with its worst job's status: unusable input, then errors, then a device
# within the margin, then ok.
_WORST_LAST = (EXIT_OK, EXIT_MARGIN, EXIT_INVALID, EXIT_USAGE)


def worst(a: int, b: int) -> int:
    return max(a, b, key=_WORST_LAST.index)


def exit_status(findings) -> int:
    """1 with errors; 3 when the only doubt is a device within the memory margin
    (MEMORY_WITHIN_MARGIN: compile to be sure); 0 otherwise."""
    if errors_in(findings):
        return EXIT_INVALID
    return EXIT_MARGIN if any(f.code == "MEMORY_WITHIN_MARGIN" for f in findings) else EXIT_OK


DESCRIPTION = """\
Pre-launch check for the MoE block under context parallelism. It reads the mesh,
sequence length and model from the config tree (MaxText spelling for shared knobs),
picks the MoE dispatch and how expert weights meet the tokens (gathered or exchanged
by all-to-all), and reports every setting that would inflate the local batch, drop
tokens or waste memory, each with a fix that passes the next check.

overrides:
  key=value                 set a setting (ici_context_parallelism=4)
  model=NAME, mesh=NAME,    pick a preset (model: qwen3_next_80b_a3b, deepseek_v3,
  hardware=NAME             qwen3_30b_a3b, mixtral_8x7b, tiny)
  a=1,2 b=x,y  with -m      one check per combination (the worst sets the status),
                            then a summary line per job (exit, pick, device GiB)
  maxtext_config=PATH       check a MaxText YAML (base_config chain, models/) as it is;
  PATH key=value ...        the same, MaxText's way (train.py CONFIG key=value); a model
                            file (configs/models/NAME.yml) is read with base.yml beneath
  compile_topology=v5p-128  (MaxText route) the chips to price: 64 v5p chips a slice,
                            compile_topology_num_slices=N slices

exit status: 0 ok (warnings allowed), 1 validation errors, 2 unusable input, 3 no
errors but a device within the memory margin (compile=true to be sure)
"""


class _Usage(Exception):
    """Unusable command-line input: one paragraph, exit 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse would print usage and exit 2 on its own
        raise _Usage(f"{message}. See `python -m selector --help`.")


def parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="python -m selector",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("-m", "--multirun", action="store_true", help="sweep comma-separated values")
    p.add_argument(
        "-c",
        "--cfg",
        choices=("job", "all"),
        help="print the composed config as YAML (every key and its value) instead of checking",
    )
    p.add_argument("overrides", nargs="*", help="key=value overrides (see above)")
    return p


def _first_line(text) -> str:
    return str(text).strip().splitlines()[0] if str(text).strip() else ""


def explain(exc: BaseException, lines: list[str]) -> str:
    """One paragraph naming the setting and the fix, for overrides that fail: the
    finding's message, or Hydra's and OmegaConf's errors translated as `compose`
    translates them (`compose.override_error`; values quoted to one line)."""
    if isinstance(exc, ConfigError):
        return exc.findings[0].message
    return override_error(exc, lines).findings[0].message


MAX_JOBS = 1000  # a sweep past this is refused before anything is composed


def jobs(overrides: list[str], multirun: bool) -> list[list[str]]:
    """The override lists to check: one, or the cartesian product of every sweep."""
    for line in overrides:
        if line.split("=", 1)[0].startswith("hydra."):
            raise _Usage(
                f"{shown(line)!r} configures Hydra's job runner, which the check does not use "
                "(it writes no files); drop it."
            )
        if line.startswith("~"):
            raise _Usage(
                f"{shown(line)!r} deletes a setting, and every setting the check reads needs "
                "a value (without a model preset the block's sizes would be the schema's "
                "placeholders). Set it instead: key=value, or model=NAME for a preset."
            )
    if not multirun:
        return [overrides]
    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except (OverrideParseException, ValueError) as exc:  # ValueError: a 5000-digit int
        bad = next((o for o in overrides if _parses_badly(o)), " ".join(overrides))
        raise _Usage(explain(exc, [bad])) from None
    choices = []
    for o in parsed:
        prefix = {"ADD": "+", "FORCE_ADD": "++", "DEL": "~"}.get(o.type.name, "")
        if o.is_sweep_override():
            try:
                values = list(itertools.islice(o.sweep_string_iterator(), MAX_JOBS + 1))
            except HydraException as exc:
                raise _Usage(
                    f"Cannot expand the sweep {shown(o.input_line)!r}: {_first_line(exc)}."
                ) from None
            choices.append([f"{prefix}{o.get_key_element()}={v}" for v in values])
        else:
            choices.append([o.input_line])
        if math.prod(len(c) for c in choices) > MAX_JOBS:
            raise _Usage(
                f"The sweep asks for more than {MAX_JOBS:,} checks (at {shown(o.input_line)!r}); "
                "each is composed and reported, so split it into sweeps of at most "
                f"{MAX_JOBS:,} jobs."
            )
    return [list(combo) for combo in itertools.product(*choices)]


def _parses_badly(arg: str) -> bool:
    try:
        OverridesParser.create().parse_overrides([arg])
        return False
    except (OverrideParseException, ValueError):
        return True


def _compose(lines: list[str]):
    """The composed config for one job, or _Usage naming the override that fails."""
    try:
        return compose(lines)
    except (ConfigError, HydraException, OmegaConfBaseException, ValueError) as exc:
        raise _Usage(explain(exc, [_culprit(lines, exc)])) from None


def _culprit(lines: list[str], exc: BaseException) -> str:
    """The override to blame: the one the error names, else the first failing alone."""
    if isinstance(exc, ConfigError):
        key = exc.findings[0].setting
        return next((ln for ln in lines if override_key(ln) == key), key)
    for line in lines:
        try:
            compose([line])
        except Exception:  # noqa: BLE001 - we only look for the line that fails
            return line
    return " ".join(lines)


def _emit(text: str) -> None:
    """Print to stdout; a reader that went away (`| head`) is not an error of ours."""
    try:
        print(text, flush=True)
    except BrokenPipeError:
        # Point stdout at /dev/null so the interpreter's final flush stays quiet.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


def _progress(message: str) -> None:
    """Progress of a long check, on stderr (the report goes to stdout)."""
    print(message, file=sys.stderr, flush=True)


def analysed(config):
    """(plan, findings, compile or measure check, or None): compiled candidates when
    `compile=true`, timed ones when `measure=true`. A compiler plugin that is missing is
    unusable input (exit 2, naming the extra), and so is a run that fails."""
    if config.measure or config.compile:
        # Before the modes start jax: a quiet start, and simulated devices to time on CPU.
        flag = "measure" if config.measure else "compile"
        _or_usage(flag, "set up jax", lambda: check_mode("start")(config))
    if config.measure:
        doing = "time the candidates on this machine"
        return _or_usage(
            "measure", doing, lambda: check_mode("measure")(config, progress=_progress)
        )
    if not config.compile:
        plan, findings = analyse_any(config)
        return plan, findings, None
    doing = f"compile for {config.hardware.name}"
    return _or_usage("compile", doing, lambda: check_mode("compile")(config, progress=_progress))


def _or_usage(flag: str, doing: str, run):
    """run(), with a missing plugin or a failed run turned into one paragraph (exit 2)."""
    from .targets import TargetUnavailable

    try:
        return run()
    except TargetUnavailable as exc:
        raise _Usage(str(exc)) from None
    except Exception as exc:  # noqa: BLE001 - a failure is reported, not raised
        raise _Usage(
            f"{flag}=true could not {doing} ({type(exc).__name__}: "
            f"{shown(_first_line(exc), 300)}). The estimate-only check runs without "
            f"{flag}=true."
        ) from None


class _Bar:
    """Progress of a search that runs past a second, on stderr: a bar redrawn in place
    on a terminal, a line at each quarter otherwise."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.tty = sys.stderr.isatty()
        self.quarters = 0

    def __call__(self, done: int, total: int) -> None:
        if time.perf_counter() - self.start < 1.0:
            return
        if self.tty:
            if done % 10 and done != total:
                return
            filled = round(30 * done / total)
            end = "\n" if done == total else ""
            bar = f"[{'#' * filled}{'.' * (30 - filled)}]"
            print(f"\rsearching: {bar} {done}/{total} meshes", end=end, file=sys.stderr, flush=True)
        elif 4 * done // total > self.quarters:
            self.quarters = 4 * done // total
            print(f"searching: {done}/{total} meshes", file=sys.stderr, flush=True)


def search_report(config, check_first, route=None, spell=None) -> int:
    """`search=true`: the layouts of the config's chips, best first (text or JSON);
    with `compile=true`, then `check_first(layout)`: the first layout checked and
    compiled as a launch with its overrides would be, its report after the search's."""
    try:
        found = search(config, progress=_Bar(), route=route, spell=spell)
    except ValueError as exc:
        raise _Usage(str(exc)) from None
    if config.output is OutputFormat.json:
        _emit(json.dumps(found.as_dict(), sort_keys=True))
    else:
        _emit(render_search(config, found, config.search_top))
    status = exit_code(found)
    if config.compile and found.layouts:
        top = found.layouts[0]
        _progress(f"compile=true: checking the first layout, {' '.join(top.overrides)}")
        status = check_first(top)
    return status


def _native_first(top) -> int:
    """The first layout of a native search, checked with compile=true."""
    config = top.plan.config.replace(search=False, compile=True)
    plan, findings, compiled = analysed(config)
    return report(config, plan, findings, overrides=top.overrides, compiled=compiled)


def report(
    config, plan, findings, *, overrides, job=None, maxtext=None, compiled=None, maxtext_step=None
) -> int:
    """Print one report (text or JSON) and return its exit status."""
    estimate = plan.chosen_estimate.device_bytes if plan is not None else None
    if config.output is OutputFormat.json:
        payload = json.loads(render_json(config, plan, findings, overrides, compiled))
        if maxtext is not None:
            payload["maxtext"] = maxtext.as_dict()
        if maxtext_step is not None:
            payload["compiled"] = {
                "maxtext_train_compile": maxtext_step.as_dict(),
                "estimate_bytes": estimate,
            }
        _emit(json.dumps(payload, sort_keys=True))
    else:
        lines = []
        if job is not None:
            lines.append(f"=== job {job}: {' '.join(overrides) or '(defaults)'}")
        if maxtext is not None:
            lines.append(maxtext.summary())
        lines.append(render_text(config, plan, findings, compiled))
        if maxtext_step is not None:
            lines.append(maxtext_step.summary(estimate))
        _emit("\n".join(lines))
    return exit_status(findings)


def maxtext_main(overrides: list[str], multirun: bool, show_cfg: str | None = None) -> int:
    """`maxtext_config=PATH [key=value ...]`: check a MaxText config as it is (with
    `--cfg job`, print the config it imports instead)."""
    if multirun:
        raise _Usage(
            "-m cannot be combined with maxtext_config=; the MaxText route takes key=value "
            "overrides only (run one check per setting)."
        )
    path = next(a for a in overrides if a.startswith("maxtext_config=")).split("=", 1)[1]
    rest = [a for a in overrides if not a.startswith("maxtext_config=")]
    try:
        imported = from_maxtext(path, rest)
    except (MaxTextError, ConfigError, ValueError, TypeError) as exc:
        message = explain(exc, rest) if isinstance(exc, ConfigError) else _first_line(exc)
        raise _Usage(message) from None
    if show_cfg:
        _emit(OmegaConf.to_yaml(OmegaConf.structured(imported.config)))
        return EXIT_OK
    if imported.config.search:
        return search_report(
            imported.config,
            lambda top: maxtext_main(
                [f"maxtext_config={path}", *rest, *top.overrides, "search=false"], False
            ),
            route=imported.for_mesh,
            spell=imported.launch_settings,
        )
    # compile=true here compiles MaxText's own train step (checks.maxtext_step), not
    # this project's block: the estimate is made without compiling.
    wants_step = imported.config.compile
    config = imported.config.replace(compile=False)
    compiled = None
    if config.measure:  # the timed choice; the findings as the route checks them
        plan, _, compiled = analysed(config)
        findings = analyse_on_route(imported, path, rest, config)[1]
    else:
        plan, findings = analyse_on_route(imported, path, rest, config)
    from_import, findings = findings[: len(imported.findings)], findings[len(imported.findings) :]
    if imported.exchange_is_maxtexts:
        # Ours: the exchange and the row tile left to the selector.
        free = imported.config.replace(
            expert_exchange=Exchange.auto, expert_group=ExpertGroup.auto, gmm_row_tile=0
        )
        note = imported.alternative(plan, analyse(free, check_fixes=False)[0])
        imported.notes += [note] if note else []
    step = None
    if wants_step and plan is not None:
        step, found = _or_usage(
            "compile",
            "compile MaxText's train step",
            lambda: check_mode("maxtext_compile")(
                path, rest, imported.config, plan, progress=_progress
            ),
        )
        findings = [*findings, *found]
    if plan is not None:
        reason = imported.explain_reason(plan.reason, plan)
        plan = dataclasses.replace(plan, findings=tuple(findings), reason=reason)
    return report(
        imported.config,
        plan,
        from_import + findings,
        overrides=rest,
        maxtext=imported,
        compiled=compiled,
        maxtext_step=step,
    )


def _positional_config(overrides: list[str]) -> list[str]:
    """MaxText's habit, `train.py CONFIG key=value ...`: a first argument that names a
    YAML file is the MaxText config."""
    if overrides and "=" not in overrides[0] and overrides[0].endswith((".yml", ".yaml")):
        if not os.path.isfile(overrides[0]):
            raise _Usage(
                f"{overrides[0]!r} is not a file; give the path of a MaxText config "
                "(its configs/base.yml, or your own YAML with base_config:)."
            )
        return [f"maxtext_config={overrides[0]}", *overrides[1:]]
    return overrides


def run(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    args.overrides = _positional_config(args.overrides)
    if any(a.startswith("maxtext_config=") for a in args.overrides):
        return maxtext_main(args.overrides, args.multirun, args.cfg)
    todo = jobs(args.overrides, args.multirun)
    composed = [(lines, _compose(lines)) for lines in todo]  # every job, before any report
    if args.cfg:
        for _, cfg in composed:
            _emit(OmegaConf.to_yaml(cfg))
        return EXIT_OK
    status = EXIT_OK
    rows = []
    for i, (lines, cfg) in enumerate(composed):
        try:
            config = to_config(cfg)
            if config.search:
                status = worst(status, search_report(config, _native_first))
                continue
            plan, findings, compiled = analysed(config)
        except (ConfigError, OmegaConfBaseException, ValueError, TypeError) as exc:
            if not args.multirun:
                raise _Usage(explain(exc, lines)) from None
            plan, findings, code = None, [], _job_usage(i, explain(exc, lines))
        except _Usage as exc:  # a compile or measure run that failed
            if not args.multirun:
                raise
            plan, findings, code = None, [], _job_usage(i, str(exc))
        else:
            job = i if args.multirun else None
            code = report(config, plan, findings, overrides=lines, job=job, compiled=compiled)
        status = worst(status, code)
        rows.append(summary_row(i, lines, plan, findings, code))
    # JSON lines carry each job's numbers already, and a table would break their parsing.
    if args.multirun and all(cfg.get("output") != OutputFormat.json for _, cfg in composed):
        _emit(summary(rows, status))
    return status


def _job_usage(job: int, message: str) -> int:
    """In a sweep, one job's unusable input is that job's exit 2; the others still run."""
    print(f"error: job {job}: {message}", file=sys.stderr, flush=True)
    return EXIT_USAGE


def summary_row(job: int, overrides: list[str], plan, findings, status: int) -> list[str]:
    """One sweep job as the summary's cells: job, exit, pick, device GiB, errors, overrides."""
    errors = sorted({f.code for f in errors_in(findings)})
    if status == EXIT_USAGE:
        errors = ["unusable input (see stderr)"]
    pick = plan.chosen_estimate.name if plan is not None else "-"
    held = f"{plan.chosen_estimate.device_bytes / 2**30:.3g}" if plan is not None else "-"
    return [str(job), str(status), pick, held, ",".join(errors) or "-", " ".join(overrides)]


def summary(rows: list[list[str]], status: int) -> str:
    """The sweep's last lines: one aligned row a job, after every job's own report."""
    head = ["job", "exit", "pick", "device GiB", "errors", "overrides"]
    widths = [max(len(r[c]) for r in [head, *rows]) for c in range(len(head) - 1)]
    lines = [f"=== summary: {len(rows)} job(s), exit status {status} (the worst job's)"]
    for row in [head, *rows]:
        cells = [
            f"{v:>{w}}" if c in (0, 1, 3) else f"{v:<{w}}"
            for c, (v, w) in enumerate(zip(row[:-1], widths, strict=True))
        ]
        lines.append("  ".join([*cells, row[-1]]).rstrip())
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    try:
        return run(args)
    except _Usage as exc:
        print(f"error: {exc}", file=sys.stderr)
        if "output=json" in (a.replace(" ", "") for a in args):
            # A script reading the JSON gets one object for unusable input too.
            print(json.dumps({"ok": False, "exit_status": EXIT_USAGE, "error": str(exc)}))
        return EXIT_USAGE
    except RecursionError:  # a value nested thousands deep, in an override or a file
        print(
            "error: the input nests a value deeper than the check follows; settings take "
            "plain values (numbers, names, short lists).",
            file=sys.stderr,
        )
        return EXIT_USAGE


def entry() -> None:
    """Console script `moe-selector`: same as `python -m selector`."""
    sys.exit(main())
