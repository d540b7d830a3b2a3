"""A script's first calls: each mode in a fresh process, nothing warm.

Two benchmarks, each running every mode (plain, staged, plain_again) in a
new Python process per repetition; paired ratios pair the processes of one
repetition, and `plain_again`, a second plain process, is the control.

`python -m benchmarks.first_calls [--processes N] [--model criteo]
[--name NAME]` runs what a user's script does first: build the model,
`fit` 3 epochs with validation every epoch, `evaluate` three times, then
`fit` one more epoch, all from `tf.data.Dataset`s (`benchmarks.regimes`'
models and data), in the order plain, staged, plain_again. `benchmarks.
regimes` times calls after an untimed one per mode; here every call is
timed from a cold process, so a staged model's one-time costs (planning
SmartStage, building its stages, tracing its prefix, the call that times
the whole model's steps once) are in the figures.

`python -m benchmarks.first_calls --scripts [featurespace_seeded,...]
[--processes N] [--package-root DIR] [--name NAME]` times whole user
scripts (`benchmarks.scripts`, one module each), each written for plain
Keras and with keras_stage's three lines. A child process imports the
script, which makes its data, then times from its model's construction to
its end (`script`) and its first `fit`, `evaluate` and `predict`; the
parent times the whole process (`process`: start-up, imports, data, the
script and exit). The modes' order rotates per repetition (plain staged
plain_again, then staged plain_again plain, ...). The children inherit
`KERAS_BACKEND`: on JAX or torch, where plain Keras cannot fit string
inputs, the `*_split` scripts run (their plain mode is the hand split).

With `--package-root DIR`, either benchmark's children import
`keras_stage` from `DIR/keras_stage` (an older checkout at a git worktree,
say) while every other module, `benchmarks` included, comes from this
checkout. The parent imports neither TensorFlow nor Keras.

Results: a table, and `benchmarks/results/first_calls/<name>.json`.
"""

import argparse
import contextlib
import json
import os
import pathlib
import platform
import statistics
import subprocess
import sys
import tempfile
import time

from benchmarks.decisions import agree, decisions_logged
from benchmarks.environment import git
from benchmarks.paired import paired_ratio
from benchmarks.scripts import SCRIPTS

CALLS = ("fit", "evaluate_1", "evaluate_2", "evaluate_3", "fit_again")
MODES = ("plain", "staged", "plain_again")
ROOT = pathlib.Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "first_calls"
# What is timed of a script, in the table's order: the script (from its
# model's construction to its end), its first calls, the whole process.
PARTS = (
    "script",
    "fit",
    "evaluate",
    "evaluate_holdout",
    "predict",
    "process",
)
DEFAULT_PROCESSES = 4
DEFAULT_SCRIPT_PROCESSES = 5
# Seconds a child may run. A script's full size takes well under it on 2
# cores; a hung child must not stall the run.
TIMEOUT = 600
# Starts the line of a child's output that holds its results: a script
# prints its own lines too.
MARKER = "first_calls result: "


class ChildFailed(RuntimeError):
    """A child process failed, timed out or printed no result."""


def one_process(mode_name, model_name):
    """The calls' seconds in this process (run as `--child`)."""
    from benchmarks import regimes

    spec = regimes.MODELS[model_name]
    sizes = regimes.Sizes(val_train_batches=40, val_epochs=3)
    data = regimes.make_data(spec, sizes, {"val_train", "val", "eval"})
    mode = regimes.MODE_CLASSES[mode_name](spec, data, "dataset")
    mode.build()
    clock = regimes.StepClock()
    train = mode.feed("val_train", True)
    val, test = mode.feed("val"), mode.feed("eval")
    seconds = {}

    def timed(name, method, feed, **kwargs):
        started = time.perf_counter()
        mode.call(method, clock, feed, **kwargs)
        seconds[name] = time.perf_counter() - started

    timed("fit", "fit", train, validation=val, epochs=3)
    for index in range(1, 4):
        timed(f"evaluate_{index}", "evaluate", test)
    timed("fit_again", "fit", train, validation=val, epochs=1)
    return seconds


def one_script_process(name, mode, tiny=False):
    """Script `name` in `mode` in this process (run as `--child-script`).

    Returns:
        `benchmarks.scripts.one_script`'s record, plus where `keras_stage`
        and `benchmarks` were imported from and the versions.
    """
    from benchmarks import scripts

    # The control is a second plain process.
    script_mode = "plain" if mode == "plain_again" else mode
    with decisions_logged() as decisions:
        record = scripts.one_script(name, script_mode, tiny)
    return {**record, "decisions": decisions, **_imported()}


def decisions_agree(runs):
    """How the staged processes of a script decided its calls.

    Returns:
        `{"sequences": [[[phase, staged], ...], ...], "counts": [n, ...],
        "same": bool}`: each distinct sequence of decisions, how many
        processes made it, and whether all made the same one
        (`benchmarks.decisions.agree`).
    """
    return agree(
        [[d["phase"], d["staged"]] for d in run.get("decisions", ())]
        for run in runs
    )


def _imported():
    """Where this process imported keras_stage and benchmarks from."""
    modules = {
        key: sys.modules.get(key)
        for key in ("keras_stage", "benchmarks", "keras", "tensorflow")
    }
    # The backend's own version, when it is not TensorFlow.
    keras = modules["keras"]
    backend = keras and keras.backend.backend()
    if backend in ("jax", "torch"):
        modules[backend] = sys.modules.get(backend)
    files = {
        f"{key}_file": getattr(modules[key], "__file__", None)
        for key in ("keras_stage", "benchmarks")
    }
    return {
        # Resolved: `package_path`'s folder links to the real checkout.
        **{k: v and os.path.realpath(v) for k, v in files.items()},
        "versions": {
            key: getattr(module, "__version__", None)
            for key, module in modules.items()
            if key != "benchmarks"
        },
        "keras_backend": backend,
    }


def mode_order(repetition):
    """The modes in the order repetition `repetition` runs them.

    Rotated by one per repetition: plain staged plain_again, then staged
    plain_again plain, ..., so no mode always runs first (after a
    previous process's exit) or last.
    """
    shift = repetition % len(MODES)
    return MODES[shift:] + MODES[:shift]


@contextlib.contextmanager
def package_path(package_root):
    """A folder whose only entry is `package_root`'s `keras_stage`.

    Put first on a child's `PYTHONPATH`, it makes `import keras_stage`
    find `package_root/keras_stage` and nothing else of `package_root`: a
    checkout's own `benchmarks` would otherwise shadow this one.
    """
    package = pathlib.Path(package_root).resolve() / "keras_stage"
    if not (package / "__init__.py").is_file():
        raise ValueError(
            f"Invalid value for `--package-root`. Expected a folder holding "
            f"the keras_stage package (keras_stage/__init__.py). Received: "
            f"{package_root!r}"
        )
    with tempfile.TemporaryDirectory(prefix="first_calls_") as folder:
        (pathlib.Path(folder) / "keras_stage").symlink_to(
            package, target_is_directory=True
        )
        yield folder


def child_environment(package_folder=None):
    """The environment of a child: this checkout on its path, quiet TF.

    `package_folder`: a `package_path` folder to import `keras_stage`
    from, ahead of this checkout's.
    """
    env = dict(os.environ, PYTHONPATH=str(ROOT), TF_CPP_MIN_LOG_LEVEL="2")
    if package_folder is not None:
        env["PYTHONPATH"] = os.pathsep.join([package_folder, str(ROOT)])
        # `python -m` puts its working folder (this checkout, holding a
        # keras_stage of its own) first on sys.path unless told not to.
        env["PYTHONSAFEPATH"] = "1"
    return env


def _tail(text, lines=20):
    """The last `lines` lines of a child's output, or "(none)"."""
    if isinstance(text, bytes):  # `TimeoutExpired` keeps bytes
        text = text.decode(errors="replace")
    return "\n".join((text or "").strip().splitlines()[-lines:]) or "(none)"


def run_child(arguments, env, timeout=TIMEOUT):
    """Runs `python -m benchmarks.first_calls ARGUMENTS`; its result.

    Returns:
        `(result, seconds)`: the child's result (the JSON after `MARKER`)
        and the whole process's wall time.

    Raises:
        ChildFailed: When the child runs out of time, exits with an error
            or prints no result; the message ends with its output's last
            lines.
    """
    command = [sys.executable, "-m", "benchmarks.first_calls", *arguments]
    started = time.perf_counter()
    try:
        done = subprocess.run(
            command,
            capture_output=True,
            text=True,
            cwd=ROOT,
            env=env,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired as error:
        raise ChildFailed(
            f"{' '.join(arguments)}: no result within {timeout} s (killed); "
            f"its last output:\n{_tail(error.stderr)}"
        ) from error
    seconds = time.perf_counter() - started
    results = [
        line[len(MARKER) :]
        for line in done.stdout.splitlines()
        if line.startswith(MARKER)
    ]
    if done.returncode != 0 or len(results) != 1:
        raise ChildFailed(
            f"{' '.join(arguments)}: exit status {done.returncode}, "
            f"{len(results)} results; its last output:\n"
            f"{_tail(done.stdout, 5)}\n{_tail(done.stderr)}"
        )
    return json.loads(results[0]), seconds


def run(processes, model_name, log=print, timeout=TIMEOUT, package_root=None):
    """The calls of `model_name`'s script, each mode in its own processes.

    `package_root`: a folder to import `keras_stage` from (see
    `package_path`), or None for this checkout's.
    """
    runs = {mode: [] for mode in MODES}
    with contextlib.ExitStack() as stack:
        folder = None
        if package_root is not None:
            folder = stack.enter_context(package_path(package_root))
        env = child_environment(folder)
        for repetition in range(processes):
            for mode in MODES:
                record, _ = run_child(
                    ["--child", mode, "--model", model_name], env, timeout
                )
                _check_imports(record, package_root)
                seconds = record["seconds"]
                seconds["total"] = sum(seconds[name] for name in CALLS)
                runs[mode].append(seconds)
                log(
                    f"{repetition + 1}/{processes} {mode}: "
                    + " ".join(f"{k} {v:.3f}s" for k, v in seconds.items())
                )
    summary = {}
    for name in (*CALLS, "total"):
        summary[name] = {
            "median_seconds": {
                mode: statistics.median(r[name] for r in runs[mode])
                for mode in MODES
            },
            "paired": {
                f"{mode}/plain": statistics.median(
                    r[name] / p[name]
                    for r, p in zip(runs[mode], runs["plain"], strict=True)
                )
                for mode in MODES[1:]
            },
        }
    return {"model": model_name, "runs": runs, "summary": summary}


def summarize_script(runs):
    """Per timed part: each mode's median seconds, the paired ratios.

    Args:
        runs: `{mode: [run of each repetition]}`, each run's `seconds` a
            dict of `PARTS` (a script times only the calls it makes).

    Returns:
        `{part: {"median_seconds": {mode: s}, "paired": {"staged/plain":
        r, "plain_again/plain": r}}}` for every part all runs timed; a
        paired ratio is the median over the repetitions of the ratio
        within one.
    """
    summary = {}
    for part in PARTS:
        values = {
            mode: [r["seconds"].get(part) for r in runs[mode]] for mode in MODES
        }
        if any(v is None for mode in MODES for v in values[mode]):
            continue
        summary[part] = {
            "median_seconds": {
                mode: statistics.median(values[mode]) for mode in MODES
            },
            "paired": {
                f"{mode}/plain": paired_ratio(values[mode], values["plain"])
                for mode in MODES[1:]
            },
        }
    return summary


def _checkout(folder, *paths):
    """The commit of `folder`'s checkout, and whether `paths` are edited."""
    status = git(
        "status",
        "--porcelain",
        "--untracked-files=no",
        "--",
        *paths,
        folder=folder,
    )
    return {
        "folder": str(folder),
        "git_commit": git("rev-parse", "HEAD", folder=folder),
        "git_dirty": None if status is None else bool(status),
    }


def _check_imports(record, package_root):
    """Raises `ChildFailed` if a child imported from the wrong checkout."""
    expected = {
        "keras_stage_file": pathlib.Path(package_root or ROOT) / "keras_stage",
        "benchmarks_file": ROOT / "benchmarks",
    }
    for key, folder in expected.items():
        found = record.get(key)
        if found is None:
            continue  # the script failed before importing it
        if not pathlib.Path(found).resolve().is_relative_to(folder.resolve()):
            raise ChildFailed(
                f"the child imported {key.split('_file')[0]} from {found}, "
                f"not from {folder}"
            )


def run_scripts(
    names,
    processes,
    log=print,
    tiny=False,
    timeout=TIMEOUT,
    package_root=None,
    save=None,
):
    """Times each script in `names`, each mode in its own processes.

    Args:
        names: Scripts of `SCRIPTS`, run one after the other.
        processes: Repetitions: each runs every mode once, in a fresh
            process, in `mode_order`.
        log: Called with a line after every process.
        tiny: Each script at a smoke test's size.
        timeout: Seconds a child may run before it is killed and its
            script counted as failed.
        package_root: A folder to import `keras_stage` from (see
            `package_path`), or None for this checkout's.
        save: Called with the results so far after each script, or None.

    Returns:
        The results: `config`, `environment`, and per script its `runs`
        and `summary` (`summarize_script`), or `skipped` (the reason) or
        `error` (the failure; its other processes were not run).
    """
    started = time.perf_counter()
    results = {
        "kind": "scripts",
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "config": {
            "scripts": list(names),
            "processes": processes,
            "modes": list(MODES),
            "tiny": tiny,
            "timeout_seconds": timeout,
            "package_root": package_root and str(package_root),
        },
        "timed": (
            "script: time.perf_counter from the script's model construction "
            "to its end, in the child (imports and data before); fit, "
            "evaluate, predict: the script's first call of each; process: "
            "the child's wall time in the parent (start-up, imports, data, "
            "script, exit). Paired ratios: medians over the repetitions of "
            "the ratio within one; plain_again is a second plain process."
        ),
        "environment": {
            "python": platform.python_version(),
            "platform": platform.platform(),
            "cpu_count": os.cpu_count(),
            # Results files rewritten by earlier runs change nothing timed.
            "checkout": _checkout(ROOT, ".", ":(exclude)benchmarks/results"),
            "package": _checkout(package_root or ROOT, "keras_stage"),
        },
        "scripts": {},
    }
    with contextlib.ExitStack() as stack:
        folder = None
        if package_root is not None:
            folder = stack.enter_context(package_path(package_root))
        env = child_environment(folder)
        for name in names:
            results["scripts"][name] = _run_script(
                name, processes, env, log, tiny, timeout, package_root
            )
            results["wall_seconds"] = time.perf_counter() - started
            if save is not None:
                save(results)
    return results


def _run_script(name, processes, env, log, tiny, timeout, package_root):
    """One script's section of `run_scripts`' results."""
    section = {"loadavg_before": list(os.getloadavg())}
    runs = {mode: [] for mode in MODES}
    arguments = ["--tiny"] if tiny else []
    try:
        for repetition in range(processes):
            for position, mode in enumerate(mode_order(repetition)):
                record, seconds = run_child(
                    ["--child-script", name, mode, *arguments], env, timeout
                )
                _check_imports(record, package_root)
                if "skipped" in record:
                    log(f"{name}: skipped, {record['skipped']}")
                    section["skipped"] = record["skipped"]
                    return section
                record["seconds"]["process"] = seconds
                record.update(repetition=repetition, position=position)
                runs[mode].append(record)
                log(
                    f"{name} {repetition + 1}/{processes} {mode}: "
                    + " ".join(
                        f"{part} {record['seconds'][part]:.3f}s"
                        for part in PARTS
                        if part in record["seconds"]
                    )
                )
    except ChildFailed as error:
        log(f"{name}: FAILED, {error}")
        section["error"] = str(error)
    section["loadavg_after"] = list(os.getloadavg())
    section["runs"] = runs
    if "error" not in section:
        section["summary"] = summarize_script(runs)
        section["decisions"] = decisions_agree(runs["staged"])
        plain = runs["plain"][0]
        section["keras_stage_file"] = plain["keras_stage_file"]
        section["versions"] = plain["versions"]
        section["keras_backend"] = plain.get("keras_backend")
    return section


def _ratio(value):
    return "-" if value is None else f"{value:.2f}"


def format_scripts_table(results):
    """The scripts' results as text: a row per script, one per call."""
    header = (
        f"{'script':20} {'part':16} {'plain s':>8} {'staged s':>9}"
        f" {'staged/plain':>13} {'control':>8} {'process staged/plain':>21}"
    )
    lines = [header]
    for name, section in results["scripts"].items():
        if "skipped" in section:
            lines.append(f"{name:20} skipped: {section['skipped']}")
            continue
        if "error" in section:
            first = section["error"].splitlines()[0]
            lines.append(f"{name:20} FAILED: {first}")
            continue
        summary = section["summary"]
        process = summary["process"]["paired"]["staged/plain"]
        for index, part in enumerate(p for p in PARTS if p in summary):
            if part == "process":
                continue
            medians = summary[part]["median_seconds"]
            paired = summary[part]["paired"]
            lines.append(
                f"{name if index == 0 else '':20} {part:16}"
                f" {medians['plain']:8.3f} {medians['staged']:9.3f}"
                f" {_ratio(paired['staged/plain']):>13}"
                f" {_ratio(paired['plain_again/plain']):>8}"
                + (f" {_ratio(process):>21}" if index == 0 else "")
            )
        decisions = section.get("decisions")
        if decisions is not None:
            calls = ", ".join(
                f"{phase} {'staged' if staged else 'unstaged'}"
                for phase, staged in (decisions["sequences"] or [[]])[0]
            )
            lines.append(
                f"{'':20} decisions: "
                + (
                    f"the same in all {sum(decisions['counts'])} staged "
                    f"processes ({calls or 'none'})"
                    if decisions["same"]
                    else f"DIFFER: {decisions['sequences']} in "
                    f"{decisions['counts']} processes"
                )
            )
    return "\n".join(lines)


def _names(parser, value):
    names = [n.strip() for n in value.split(",") if n.strip()]
    unknown = [n for n in names if n not in SCRIPTS]
    if unknown or not names:
        parser.error(f"--scripts: unknown {unknown}; choose from {SCRIPTS}")
    return names


def _write(results, out, name):
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}.json"
    path.write_text(json.dumps(results, indent=2) + "\n")
    return path


def parse_args(argv=None):
    """Parses the command line (see `--help`)."""
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.first_calls",
        description=__doc__.splitlines()[0],
    )
    parser.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    parser.add_argument(
        "--child-script",
        nargs=2,
        metavar=("NAME", "MODE"),
        help=argparse.SUPPRESS,
    )
    parser.add_argument(
        "--model",
        default="criteo",
        help="the model of the first-calls script (default criteo)",
    )
    parser.add_argument(
        "--scripts",
        nargs="?",
        const=",".join(SCRIPTS),
        help="time these whole scripts instead, comma-separated, from "
        f"{','.join(SCRIPTS)} (alone: all of them)",
    )
    parser.add_argument(
        "--processes",
        type=int,
        default=None,
        help=f"repetitions, each a fresh process per mode (default "
        f"{DEFAULT_PROCESSES}, {DEFAULT_SCRIPT_PROCESSES} with --scripts)",
    )
    parser.add_argument(
        "--tiny",
        action="store_true",
        help="with --scripts: every script at its smallest (a smoke run, "
        "not a measurement)",
    )
    parser.add_argument(
        "--package-root",
        type=pathlib.Path,
        metavar="DIR",
        help="import keras_stage from DIR/keras_stage (an older checkout, "
        "say); everything else, benchmarks included, from this checkout",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=TIMEOUT,
        help=f"seconds a child process may run (default {TIMEOUT:g})",
    )
    parser.add_argument(
        "--name",
        default=None,
        help="results file name (default first_calls, scripts with --scripts)",
    )
    parser.add_argument(
        "--out",
        type=pathlib.Path,
        default=RESULTS,
        help="output folder (default benchmarks/results/first_calls)",
    )
    args = parser.parse_args(argv)
    if args.scripts is not None:
        args.scripts = _names(parser, args.scripts)
    if args.processes is None:
        args.processes = (
            DEFAULT_SCRIPT_PROCESSES if args.scripts else DEFAULT_PROCESSES
        )
    if args.processes < 1:
        parser.error("--processes must be at least 1")
    if args.name is None:
        args.name = "scripts" if args.scripts else "first_calls"
    return args


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.child_script:
        name, mode = args.child_script
        record = one_script_process(name, mode, args.tiny)
        print(MARKER + json.dumps(record), flush=True)
        return 0
    if args.child:
        seconds = one_process(args.child, args.model)
        print(MARKER + json.dumps({"seconds": seconds, **_imported()}))
        return 0
    if args.scripts:
        return _main_scripts(args, argv)
    results = run(
        args.processes,
        args.model,
        timeout=args.timeout,
        package_root=args.package_root,
    )
    print("call          plain  staged  staged/plain  plain_again/plain")
    for name, figures in results["summary"].items():
        medians, paired = figures["median_seconds"], figures["paired"]
        print(
            f"{name:11} {medians['plain']:7.3f} {medians['staged']:7.3f}"
            f" {paired['staged/plain']:13.2f}"
            f" {paired['plain_again/plain']:18.2f}"
        )
    print(f"Wrote {_write(results, args.out, args.name)}")
    return 0


def _main_scripts(args, argv):
    results = run_scripts(
        args.scripts,
        args.processes,
        log=lambda line: print(line, flush=True),
        tiny=args.tiny,
        timeout=args.timeout,
        package_root=args.package_root,
        save=lambda results: _write(results, args.out, args.name),
    )
    results["argv"] = ["benchmarks.first_calls", *argv]
    path = _write(results, args.out, args.name)
    print()
    print(format_scripts_table(results))
    print(f"Wrote {path} ({results['wall_seconds']:.0f} s)")
    failed = [n for n, s in results["scripts"].items() if "error" in s]
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
