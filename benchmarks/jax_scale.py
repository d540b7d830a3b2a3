"""keras_stage on JAX over one device, two devices and two processes.

`KERAS_BACKEND=jax python -m benchmarks.jax_scale [--rounds N] [--quick]
[--concurrent] [--configs 1x1,1x2,2x1] [--out PATH]` (in the `.venv-jax`
environment) times whole `fit` calls of two models with string features in
the model, in three configurations (or those `--configs` names), each in
fresh child processes (JAX's devices are fixed
when it starts):

- `1x1`: one process, one CPU device, no distribution;
- `1x2`: one process with two host devices
  (`XLA_FLAGS=--xla_force_host_platform_device_count=2`) under
  `keras.distribution.DataParallel(devices=jax.devices())`: Keras lays
  each global batch out over both devices;
- `2x1`: two processes joined by `jax.distributed.initialize` on loopback
  (gloo collectives), one CPU device each, under the same `DataParallel`
  over both: Keras shards the dataset per process (`rebatch` to half the
  global batch, then `shard`, so each process reads every batch and keeps
  its half) and the gradients meet in collectives.

The workloads (`benchmarks.jax_scale_fits`): `criteo`, the Criteo-like
model of `benchmarks.jax_backend` (13 numeric columns through
`Normalization`, 26 string columns through `Hashing`), and `dcn`, the
shape of keras.io's "Ranking with Deep and Cross Networks" (integer and
string ids through `IntegerLookup`/`StringLookup`, embeddings, a cross
layer, an MLP) in plain Keras.

In every configuration each process runs three modes side by side, from
the same seed (equal initial weights), on the same data as a
`tf.data.Dataset` batched with the global batch size:

- `staged`: keras_stage's three lines (`StagedInput()` on the inputs,
  `keras_stage.Model`, `compile(..., smart_stage=True)`), fed
  `Dataset.from_tensor_slices((x, y)).batch(B)`;
- `hand`: the same split by hand: `from_tensor_slices((x, y)).batch(B,
  drop_remainder=True).map(preprocess, num_parallel_calls=AUTOTUNE)
  .prefetch(AUTOTUNE)` and a numeric `keras.Model` of the trunk
  (`drop_remainder`: with a map after a batch of unknown size Keras cannot
  find the global batch size it shards by; every run is whole batches);
- `hand2`: a second, identical hand split: the control.

Each mode fits once untimed (tracing, jit), after which the largest
difference of trunk weights, staged against hand and hand2 against hand,
is recorded. Then each round times one whole `fit(dataset, epochs=2)` per
mode (set-up, the dataset's construction and tear-down included; model
building and compile outside), in an order rotated per round, with an
untimed `gc.collect()` after each; then, for the steady state, one whole
`fit(dataset, epochs=E)` per mode in the same order, E per configuration
(`STEADY_EPOCHS`: 10 on one device, 4 on two devices or processes; 3 with
`--quick`), so that the call's set-up is spread over more epochs. Examples
per second are the examples a fit trains (rows x epochs, across all
processes) over its seconds. The ratios staged/hand and hand2/hand are of
seconds (above 1: slower than `hand`), paired: the median over the rounds
of the ratio within a round, for each kind of fit. With two processes
both time the same fits; the table gives process 0's figures, the JSON
both. On 2 cores more devices or processes add no compute: this reports
what is measured. Results: a table, and
`benchmarks/results/jax_scale.json`.

`--quick` (a smoke run, not a measurement) shares a JAX compilation cache
among the children, in a temporary directory, compiles at XLA's lowest
optimization level (`QUICK_XLA_FLAGS`) and leaves out the `gc.collect()`
after each fit; `--concurrent` starts every configuration's children at
once (its figures then share the cores). `tests/jax/jax_scale_test.py`
runs both.
"""

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time

SCHEMA_VERSION = 1
DEFAULT_ROUNDS = 5
QUICK_ROUNDS = 1
DEFAULT_OUT = os.path.join(
    os.path.dirname(os.path.abspath(__file__)), "results", "jax_scale.json"
)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Configuration: (processes, devices per process).
CONFIGS = {"1x1": (1, 1), "1x2": (1, 2), "2x1": (2, 1)}
DEVICE_FLAG = "--xla_force_host_platform_device_count"
# A smoke run's children compile at XLA's lowest optimization level: most
# of their CPU time is compiling steps that then run a few batches.
QUICK_XLA_FLAGS = (
    "--xla_backend_optimization_level=0",
    "--xla_llvm_disable_expensive_passes=true",
)
# A child's bound, by size: a stuck collective must not hang the run.
CHILD_TIMEOUT = {True: 300, False: 1200}
# The epochs of the steady-state fits, per configuration: enough that the
# hand split's fit lasts some seconds on 2 cores (its 2-epoch fit takes
# 0.4-0.7 s on one device, 0.7-1.4 s on two, 2-6 s in two processes).
STEADY_EPOCHS = {"1x1": 10, "1x2": 4, "2x1": 4}
QUICK_STEADY_EPOCHS = 3

TIMED = (
    "One measurement is a whole model.fit(dataset, epochs=2) call, timed "
    "with time.perf_counter in each process: set-up (the dataset built "
    "inside the call), steps and tear-down; model building and compile "
    "outside. One untimed fit per mode first. Modes rotated per round; "
    "gc.collect() untimed after each fit. examples/s = rows x epochs "
    "(global) / seconds; medians over the rounds. Ratios are of seconds "
    "(above 1: slower than hand), paired: the median over rounds of the "
    "ratio within a round. The steady state: in each round, after those, "
    "one whole model.fit(dataset, epochs=E) call per mode (E per "
    "configuration, `steady_epochs`), timed and paired the same way: the "
    "call's set-up spread over E epochs. Each call's phases, from a "
    "callback (the same in every mode): its set-up (to the first step's "
    "start), its first epoch, the epochs after it, paired the same way "
    "(after 1st epoch), and the medians of set-up + first epoch in ms."
)


# -- a child process -------------------------------------------------------


def steady_epochs(config, quick):
    """The epochs of `config`'s steady-state fits."""
    return QUICK_STEADY_EPOCHS if quick else STEADY_EPOCHS[config]


def child_main(config, process_id, port, rounds, quick):
    """One process of `config`: prints `RESULT {json}` with its figures."""
    import jax

    processes, devices = CONFIGS[config]
    if processes > 1:
        # Before anything else touches JAX's backends.
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(
            coordinator_address=f"127.0.0.1:{port}",
            num_processes=processes,
            process_id=process_id,
        )
    import keras

    from benchmarks import jax_scale_fits

    found = jax.device_count()
    if found != processes * devices or jax.process_count() != processes:
        raise RuntimeError(
            f"Configuration {config} expects {processes} process(es) with "
            f"{devices} device(s) each; JAX has {jax.process_count()} "
            f"process(es) and {found} device(s)"
        )
    if found > 1:
        keras.distribution.set_distribution(
            keras.distribution.DataParallel(devices=jax.devices())
        )
    result = {
        "config": config,
        "process_id": process_id,
        "process_count": jax.process_count(),
        "devices": [str(device) for device in jax.devices()],
        "distribution": None
        if found == 1
        else "DataParallel(devices=jax.devices())",
        "jax": jax.__version__,
        "workloads": {},
    }
    result["steady_epochs"] = steady_epochs(config, quick)
    for name, workload in jax_scale_fits.WORKLOADS.items():
        rows = workload.quick_rows if quick else workload.rows
        result["workloads"][name] = jax_scale_fits.run_workload(
            workload,
            rows,
            rounds,
            log=lambda line: print(
                f"[{config} p{process_id}] {line}", file=sys.stderr, flush=True
            ),
            steady_epochs=result["steady_epochs"],
            # A smoke run's fits are not measured: no collection after each.
            collect=not quick,
        )
    print("RESULT " + json.dumps(result), flush=True)


# -- the parent ------------------------------------------------------------


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child_env(devices, compile_cache=None, quick=False):
    env = {**os.environ, "KERAS_BACKEND": "jax"}
    if compile_cache is not None:
        # JAX's persistent cache, every compilation written: a mode's
        # step identical to another's (hand2's to hand's) is read back.
        env["JAX_COMPILATION_CACHE_DIR"] = compile_cache
        env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    flags = [
        flag
        for flag in env.get("XLA_FLAGS", "").split()
        if not flag.startswith(DEVICE_FLAG)
    ]
    if devices > 1:
        flags.append(f"{DEVICE_FLAG}={devices}")
    if quick:
        flags.extend(QUICK_XLA_FLAGS)
    env["XLA_FLAGS"] = " ".join(flags)
    return env


def _parse_result(stdout):
    lines = [line for line in stdout.splitlines() if line.startswith("RESULT ")]
    return json.loads(lines[-1][len("RESULT ") :]) if lines else None


def start_config(config, rounds, quick, compile_cache=None):
    """Starts `config`'s child processes; `finish_config` waits for them.

    `compile_cache`: a directory for JAX's persistent compilation cache,
    shared by the children (a smoke run's: `run`), or None.
    """
    processes, devices = CONFIGS[config]
    port = str(_free_port())
    command = [sys.executable, "-m", "benchmarks.jax_scale", "--child", config]
    command += ["--rounds", str(rounds), "--port", port]
    command += ["--quick"] if quick else []
    # Files, not pipes: a child never blocks on a full pipe while the
    # parent waits for another.
    logs = [
        (tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+"))
        for _ in range(processes)
    ]
    children = [
        subprocess.Popen(
            [*command, "--process-id", str(index)],
            stdout=stdout,
            stderr=stderr,
            text=True,
            env=_child_env(devices, compile_cache, quick),
            cwd=ROOT,
        )
        for index, (stdout, stderr) in enumerate(logs)
    ]
    return {
        "config": config,
        "quick": quick,
        "children": children,
        "logs": logs,
        "started": time.monotonic(),
        "deadline": time.monotonic() + CHILD_TIMEOUT[quick],
    }


def finish_config(started, log=print):
    """Waits for `start_config`'s children, bounded in time; their results.

    Returns:
        `{"processes": [each process's result]}`, or `{"error": ...}` with
        the failed children's output when one failed or timed out.
    """
    config, quick = started["config"], started["quick"]
    children, logs = started["children"], started["logs"]
    try:
        # Until all end, one fails (the others would wait for it in a
        # collective) or time runs out.
        while time.monotonic() < started["deadline"]:
            codes = [child.poll() for child in children]
            if None not in codes or any(code for code in codes):
                break
            time.sleep(0.5)
    finally:
        for child in children:
            if child.poll() is None:
                child.kill()
            child.wait()
    results, errors = [], []
    for index, (child, (stdout, stderr)) in enumerate(
        zip(children, logs, strict=True)
    ):
        stdout.seek(0)
        stderr.seek(0)
        out, err = stdout.read(), stderr.read()
        stdout.close()
        stderr.close()
        for line in err.splitlines():
            if line.startswith(f"[{config} p"):
                log(line)
        result = _parse_result(out)
        if child.returncode != 0 or result is None:
            errors.append(
                f"process {index}: exit {child.returncode} (negative: killed "
                f"at the {CHILD_TIMEOUT[quick]} s bound or after another "
                f"process failed)\n{err[-4000:]}"
            )
        else:
            results.append(result)
    # From the start to the last child's end (or its kill).
    wall = time.monotonic() - started["started"]
    if errors:
        return {"error": "\n".join(errors), "wall_seconds": wall}
    return {"processes": results, "wall_seconds": wall}


def run_config(config, rounds, quick, log=print, compile_cache=None):
    """`config`'s child processes, started together and bounded in time.

    Returns:
        What `finish_config` returns.
    """
    return finish_config(
        start_config(config, rounds, quick, compile_cache), log
    )


def _kill(started):
    for child in started["children"]:
        if child.poll() is None:
            child.kill()
            child.wait()


def _cell(section):
    """The examples per second and paired ratios of a set of fits."""
    return {
        "examples_per_second": {
            mode: figures["examples_per_second_median"]
            for mode, figures in section["modes"].items()
        },
        "staged/hand": section["paired_ratios"]["staged/hand"],
        "hand2/hand": section["paired_ratios"]["hand2/hand"],
        # The calls' epochs after their first, and what came before.
        **section["phases"],
    }


def summarize(processes):
    """`{workload: figures}` of process 0, the table's cells.

    The whole `fit(epochs=2)` calls' figures, and under `steady` those of
    the steady-state fits (`epochs` each).
    """
    first = processes[0]["workloads"]
    cells = {}
    for name, section in first.items():
        cell = {
            **_cell(section),
            "max_abs_weight_difference": max(
                run["workloads"][name]["weight_check"]["staged_vs_hand"]
                for run in processes
            ),
            "control_max_abs_weight_difference": max(
                run["workloads"][name]["weight_check"]["hand2_vs_hand"]
                for run in processes
            ),
        }
        if "steady" in section:
            cell["steady"] = {
                "epochs": section["steady"]["epochs"],
                **_cell(section["steady"]),
            }
        cells[name] = cell
    return cells


def run(
    rounds,
    quick,
    log=print,
    argv=None,
    configs=tuple(CONFIGS),
    concurrent=False,
):
    """Runs every configuration; returns the results as a dict.

    `concurrent`: every configuration's processes at once, for a smoke run
    (`--quick`): its figures then time configurations that share the
    cores, and each section's `load` is the whole run's. With `quick` the
    children share a JAX compilation cache in a temporary directory (the
    untimed fits compile less; a measurement compiles every step itself).
    """
    from benchmarks import environment, jax_scale_fits

    started = time.perf_counter()
    results = {
        "schema_version": SCHEMA_VERSION,
        # For benchmarks.history.
        "family": "jax_scale",
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "argv": argv,
        "config": {
            "configs": {
                name: {"processes": p, "devices_per_process": d}
                for name, (p, d) in CONFIGS.items()
                if name in configs
            },
            "workloads": list(jax_scale_fits.WORKLOADS),
            "modes": list(jax_scale_fits.MODES),
            "rounds": rounds,
            "quick": quick,
            "concurrent": concurrent,
            "compile_cache": quick,
            "xla_flags": list(QUICK_XLA_FLAGS) if quick else [],
            "epochs": jax_scale_fits.EPOCHS,
            "steady_epochs": {
                name: steady_epochs(name, quick) for name in configs
            },
            "seed": jax_scale_fits.SEED,
        },
        "timed": TIMED,
        "environment": {
            **environment.describe(),
            "keras_backend": "jax",
        },
        "configs": {},
    }
    with tempfile.TemporaryDirectory(prefix="jax_scale_cache") as cache:
        _run_configs(
            results,
            rounds,
            quick,
            log,
            configs,
            concurrent,
            compile_cache=cache if quick else None,
        )
    results["wall_seconds"] = time.perf_counter() - started
    return results


def _run_configs(
    results, rounds, quick, log, configs, concurrent, compile_cache
):
    """`run`'s configurations, their sections into `results["configs"]`."""
    from benchmarks import environment

    sections = {}
    if concurrent:
        log(f"{', '.join(configs)}: starting together")
        before = environment.snapshot()
        started_configs = []
        try:
            for config in configs:
                started_configs.append(
                    start_config(config, rounds, quick, compile_cache)
                )
            for one in started_configs:
                sections[one["config"]] = finish_config(one, log)
        finally:
            for one in started_configs:
                _kill(one)
        load = environment.load_between(before, environment.snapshot())
        for section in sections.values():
            section["load"] = load
    for config in configs:
        if concurrent:
            section = sections[config]
        else:
            log(f"{config}: starting")
            before = environment.snapshot()
            section = run_config(config, rounds, quick, log, compile_cache)
            section["load"] = environment.load_between(
                before, environment.snapshot()
            )
        if "processes" in section:
            section["summary"] = summarize(section["processes"])
        else:
            log(f"{config}: FAILED\n{section['error']}")
        results["configs"][config] = section


def format_table(results):
    """The results as text: a row per configuration, workload and fit.

    For each configuration and workload, the whole `fit(epochs=2)` calls
    and below them the steady-state fits (their epochs in `epochs`).
    """
    lines = [
        f"{'config':6} {'workload':8} {'batch':>5} {'epochs':>6}"
        f" {'examples/s: staged':>18} {'hand':>8} {'hand2':>8}"
        f" {'staged/hand':>11} {'hand2/hand':>10} {'max |dw|':>8}"
        f" {'after 1st epoch':>15} {'(control)':>9}"
        f" {'set-up + 1st epoch ms: staged':>29} {'hand':>5}"
    ]
    notes = []
    for config, section in results["configs"].items():
        if "summary" not in section:
            lines.append(f"{config:6} failed: see the JSON's error")
            continue
        workloads = section["processes"][0]["workloads"]
        for name, cell in section["summary"].items():
            fits = [(workloads[name]["epochs"], cell)]
            if "steady" in cell:
                fits.append((cell["steady"]["epochs"], cell["steady"]))
            for epochs, figures in fits:
                eps = figures["examples_per_second"]
                later = figures["after_first_epoch"]
                first = figures["setup_and_first_epoch_ms"]
                lines.append(
                    f"{config:6} {name:8} {workloads[name]['batch_size']:5d}"
                    f" {epochs:6d}"
                    f" {eps['staged']:18.0f} {eps['hand']:8.0f}"
                    f" {eps['hand2']:8.0f}"
                    f" {figures['staged/hand']:11.3f}"
                    f" {figures['hand2/hand']:10.3f}"
                    f" {cell['max_abs_weight_difference']:8.1e}"
                    f" {later['staged/hand']:15.3f}"
                    f" {'(' + format(later['hand2/hand'], '.3f') + ')':>9}"
                    f" {first['staged']:29.0f} {first['hand']:5.0f}"
                )
    ran = [s for s in results["configs"].values() if "processes" in s]
    for name, section in (
        ran[0]["processes"][0]["workloads"] if ran else {}
    ).items():
        notes.append(f"{name}: {section['description']}")
    config = results["config"]
    return "\n".join(
        lines
        + [
            f"(whole fit(epochs=N) calls, medians of {config['rounds']} "
            f"rounds, process 0's: N={config['epochs']}, then the steady "
            "state's longer fits in the same rounds; staged/hand and the "
            "control hand2/hand: paired ratios of seconds, above 1 slower; "
            "max |dw|: staged against hand after the untimed fit, the "
            "largest over the processes; after 1st epoch: the same ratios "
            "of the calls' epochs after their first; set-up + 1st epoch: "
            "medians, from the call to the end of its first epoch)"
        ]
        + (
            ["(the configurations ran at once: their figures share the cores)"]
            if config.get("concurrent")
            else []
        )
        + notes
    )


def parse_args(argv=None):
    """Parses the command line (see `--help`)."""
    parser = argparse.ArgumentParser(
        prog="KERAS_BACKEND=jax python -m benchmarks.jax_scale",
        description=(
            "Time whole fit calls on Keras's JAX backend in one process with "
            "one device, one process with two host devices and two "
            "processes: keras_stage's SmartStage against the hand split "
            "and the hand split against itself (the control), in examples "
            "per second and paired ratios."
        ),
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=None,
        help=f"timed rounds (default {DEFAULT_ROUNDS}, {QUICK_ROUNDS} with "
        "--quick)",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="tiny sizes and one round, a shared compilation cache, XLA's "
        "lowest optimization level, no gc.collect() after each fit: a smoke "
        "run, not a measurement",
    )
    parser.add_argument(
        "--concurrent",
        action="store_true",
        help="start every configuration's processes at once (a faster "
        "smoke run with --quick; the figures then share the cores)",
    )
    parser.add_argument(
        "--configs",
        default=",".join(CONFIGS),
        help=f"comma-separated configurations to run (default: all, "
        f"{','.join(CONFIGS)})",
    )
    parser.add_argument(
        "--out",
        default=DEFAULT_OUT,
        help="results file (default: benchmarks/results/jax_scale.json)",
    )
    # How the parent starts its children.
    parser.add_argument("--child", choices=CONFIGS, help=argparse.SUPPRESS)
    parser.add_argument("--process-id", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--port", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.rounds is None:
        args.rounds = QUICK_ROUNDS if args.quick else DEFAULT_ROUNDS
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    args.configs = tuple(c for c in args.configs.split(",") if c)
    unknown = [c for c in args.configs if c not in CONFIGS]
    if unknown or not args.configs:
        parser.error(
            f"--configs must name some of {', '.join(CONFIGS)}; "
            f"received {args.configs or 'none'}"
        )
    if os.environ.get("KERAS_BACKEND") != "jax":
        parser.error(
            "Keras must run on the JAX backend: run with KERAS_BACKEND=jax "
            "(in .venv-jax: make venv-jax)"
        )
    return args


def main(argv=None):
    """Runs the configurations, prints the table, writes the JSON.

    Returns 1 when a configuration failed (its error is in the JSON).
    """
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.child:
        os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
        child_main(
            args.child, args.process_id, args.port, args.rounds, args.quick
        )
        return 0
    results = run(
        args.rounds,
        args.quick,
        log=lambda line: print(line, flush=True),
        argv=["benchmarks.jax_scale", *argv],
        configs=args.configs,
        concurrent=args.concurrent,
    )
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=2)
        f.write("\n")
    print()
    print(format_table(results))
    print(f"\nWrote {args.out} ({results['wall_seconds']:.0f} s)")
    failed = [c for c, s in results["configs"].items() if "error" in s]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
