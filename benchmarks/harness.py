"""The benchmark run: warm-up, interleaved repetitions, results and ratios.

This module owns the protocol. For each workload, in one process:

1. build every base mode (`benchmarks.modes.BASE_MODES`): models,
   compiled, and datasets (compute-bound preprocesses its batches here);
2. run `staged` for two untimed epochs (tracing, then a clean one) and
   build `staged-tuned` with the `num_threads`/`capacity` the
   PrefetchCallback verdict of the second suggests;
3. warm up: one untimed repetition of every mode, in the timed order.
   Warming up after every model is built matters: on TensorFlow 2.21 the
   first step of a traced model is slow again after *another* model has
   been traced (not a retrace; the tracing count stays 1), so
   a mode warmed up before the others were built would pay it in its
   first timed repetition;
4. run the timed repetitions interleaved, `plain expert staged
   staged-tuned compute-bound input-bound` then again, so drift in the
   machine's load hits every mode alike, with a full garbage collection
   (untimed) after each (see `_collect_garbage`);
5. summarise: median, min and max per mode of the whole calls' seconds
   and of the steps' steps/s, the limit (the slower of compute-bound and
   input-bound) and every mode's time as a ratio to plain, to expert and
   to the limit: of the medians, and paired (the median over the rounds
   of the ratio within each round, which cancels the machine's drift
   between rounds). The headline ratios (`ratio_to_plain`, ...) are of
   whole calls; the same ratios of the steps alone are beside them
   (`steps_ratio_to_plain`, ...).

A mode that raises is recorded with its error and left out of the later
repetitions; the other modes go on. Warnings raised while a mode runs are
recorded with it rather than printed.
"""

import gc
import time
import traceback
import warnings

import keras

from benchmarks import environment
from benchmarks.modes import BASE_MODES, MODE_ORDER, StagedMode
from benchmarks.paired import paired_ratio
from benchmarks.timing import TIMED, summarize
from benchmarks.workloads import WORKLOADS

SCHEMA_VERSION = 1
DEFAULT_REPS = 7
QUICK_REPS = 3


class _ModeRun:
    """A mode and what happened to it during the run."""

    def __init__(self, mode):
        self.mode = mode
        self.reps = []
        self.setup_seconds = None
        self.warm_up_seconds = None
        self.error = None
        self.warnings = {}

    def call(self, function):
        """Calls `function()`; records its warnings and an error, if any.

        Returns:
            Its result, or None if it raised (or the mode failed before).
        """
        if self.error is not None:
            return None
        with warnings.catch_warnings(record=True) as caught:
            # Also overrides an "error" filter (pytest's), so a warning is
            # recorded instead of failing the mode.
            warnings.simplefilter("always")
            try:
                return function()
            except Exception as e:  # noqa: BLE001 - reported, run goes on
                self.error = "".join(
                    traceback.format_exception_only(type(e), e)
                ).strip()
                self.traceback = traceback.format_exc()
                return None
            finally:
                for w in caught:
                    key = f"{w.category.__name__}: {w.message}"
                    self.warnings[key] = self.warnings.get(key, 0) + 1

    def settings(self):
        try:
            return self.mode.settings()
        except Exception as e:  # noqa: BLE001 - settings are informative
            return {"settings_error": repr(e)}


def _collect_garbage():
    """Runs the garbage collector now; returns the seconds it took.

    Called after every repetition, outside the timed windows. A finished
    `fit` leaves its iterators and pipelines in reference cycles; freed by
    an automatic collection, they would be freed at a random later time,
    inside another mode's timed window, where even a small generation-0
    collection can block in their native destructors for many steps.
    Collected here, that cost is recorded against the mode that left it
    (`cleanup_seconds`) and is timed in no mode.
    """
    started = time.perf_counter()
    gc.collect()
    return time.perf_counter() - started


def _run_rep(run):
    """One repetition of `run`'s mode, then its garbage; the record or None."""
    record = run.call(run.mode.run)
    cleanup = _collect_garbage()
    if record is not None:
        record["cleanup_seconds"] = cleanup
    return record


def _timed_call(run, function):
    """`run.call(function)`; returns the seconds it took (None on error)."""
    started = time.perf_counter()
    run.call(function)
    return None if run.error is not None else time.perf_counter() - started


def _tuned_mode(workload, staged_run, log, staged_options=None):
    """`staged-tuned` from an untimed epoch of `staged`, or None.

    Returns:
        `(mode, None)`, or `(None, {"error": ...})` if `staged` failed.
    """
    verdict = staged_run.call(staged_run.mode.calibrate)
    _collect_garbage()
    if verdict is None:
        return None, {"error": f"staged calibration failed: {staged_run.error}"}
    options = {
        **(staged_options or {}),
        "num_threads": int(verdict["suggested_num_threads"]),
        "capacity": int(verdict["suggested_capacity"]),
    }
    tuned_from = {
        "source": "PrefetchCallback.verdict of the second of two untimed "
        "staged epochs (the first one traces)",
        "verdict": verdict,
    }
    log(
        f"  staged-tuned: num_threads={options['num_threads']}, "
        f"capacity={options['capacity']} (staged verdict: "
        f"{'input' if verdict['input_bound'] else 'compute'}-bound)"
    )
    mode = StagedMode(
        workload, name="staged-tuned", options=options, tuned_from=tuned_from
    )
    return mode, None


def run_workload(workload, reps, log=print, staged_options=None):
    """Runs every mode of `workload`; returns its results section.

    Args:
        workload: A `benchmarks.workloads.Workload`.
        reps: Timed repetitions per mode.
        log: Called with progress lines.
        staged_options: `StagedInput` options of the staged modes, or None.

    Returns:
        A JSON-able dict: `info`, `load`, `modes` (see `_mode_result`),
        `limit`, `wall_seconds`.
    """
    before = environment.snapshot()
    started = time.perf_counter()
    log(
        f"{workload.name}: {workload.steps} steps of {workload.batch_size}, "
        f"{reps} reps"
    )
    workload.raw_data()  # generated (and written) before anything is timed
    runs = {}
    for cls in BASE_MODES:
        if cls is StagedMode and staged_options:
            mode = StagedMode(workload, options=staged_options)
        else:
            mode = cls(workload)
        run = runs[cls.name] = _ModeRun(mode)
        run.setup_seconds = _timed_call(run, run.mode.setup)
    _collect_garbage()
    staged = runs["staged"]
    _run_rep(staged)  # traces; calibrate() then runs a clean epoch
    tuned, tuned_error = _tuned_mode(workload, staged, log, staged_options)
    if tuned is not None:
        run = runs["staged-tuned"] = _ModeRun(tuned)
        run.setup_seconds = _timed_call(run, run.mode.setup)
    order = [name for name in MODE_ORDER if name in runs]
    for name in order:
        run = runs[name]
        run.warm_up_seconds = _timed_call(run, run.mode.run)
        _collect_garbage()
        _log_warm_up(log, name, run)
    for rep in range(reps):
        for name in order:
            record = _run_rep(runs[name])
            if record is not None:
                record["round"] = rep  # pairs it with the round's others
                runs[name].reps.append(record)
        log(
            f"  rep {rep + 1}/{reps}, steps/s of the whole call (of the "
            "steps): "
            + ", ".join(
                f"{name} {_call_rate(runs[name].reps[-1]):.1f} "
                f"({runs[name].reps[-1]['steps_per_second']:.1f})"
                for name in order
                if runs[name].error is None and runs[name].reps
            )
        )
    modes = {name: _mode_result(run) for name, run in runs.items()}
    if tuned is None:
        modes["staged-tuned"] = {
            "description": "not run",
            "error": tuned_error["error"],
        }
    for run in runs.values():
        run.call(run.mode.close)
    workload.close()
    result = {
        "info": workload.info(),
        "modes": {name: modes[name] for name in MODE_ORDER if name in modes},
        "wall_seconds": time.perf_counter() - started,
        "load": environment.load_between(before, environment.snapshot()),
    }
    add_ratios(result)
    return result


def _log_warm_up(log, name, run):
    if run.error is not None:
        log(f"  {name}: FAILED: {run.error}")
    else:
        log(
            f"  {name}: set up in {run.setup_seconds:.1f} s, warmed up in "
            f"{run.warm_up_seconds:.1f} s"
        )


def _call_rate(record):
    """Steps per second of a repetition's whole call."""
    return record["steps"] / record["call_seconds"]


def _mode_result(run):
    out = {"description": run.mode.description, "settings": run.settings()}
    if run.reps:
        # The whole calls: the headline.
        out["call_seconds"] = summarize([r["call_seconds"] for r in run.reps])
        out["call_seconds_per_step"] = summarize(
            [r["call_seconds"] / r["steps"] for r in run.reps]
        )
        # The steps alone.
        sps = [r["steps_per_second"] for r in run.reps]
        out["steps_per_second"] = summarize(sps)
        out["seconds_per_step"] = summarize([1 / v for v in sps])
        out["cores"] = summarize([r["cores"] for r in run.reps])
        out["cleanup_seconds"] = summarize(
            [r["cleanup_seconds"] for r in run.reps]
        )
        if "outside_seconds" in run.reps[0]:
            out["outside_seconds"] = summarize(
                [r["outside_seconds"] for r in run.reps]
            )
    out["setup_seconds"] = run.setup_seconds
    out["warm_up_seconds"] = run.warm_up_seconds
    out["reps"] = run.reps
    if run.warnings:
        out["warnings"] = [
            {"message": k, "count": v} for k, v in run.warnings.items()
        ]
    if run.error is not None:
        out["error"] = run.error
        out["traceback"] = run.traceback
    return out


def _median(modes, name, key):
    """The median of `modes[name][key]`, or None if the mode has none."""
    mode = modes.get(name)
    if not mode or "error" in mode or key not in mode:
        return None
    return mode[key]["median"]


def _call_speed(modes, name):
    """Steps/s of a mode's median whole call (1 / median s per step)."""
    seconds = _median(modes, name, "call_seconds_per_step")
    return None if seconds is None else 1 / seconds


def _steps_speed(modes, name):
    """A mode's median steps/s of the steps alone."""
    return _median(modes, name, "steps_per_second")


def _limit(modes, speed):
    """`(steps/s, bound_by, compute-bound's, input-bound's)` of the limit.

    The slower of compute-bound and input-bound by `speed(modes, name)`;
    the first two are None where either is missing.
    """
    compute = speed(modes, "compute-bound")
    inputs = speed(modes, "input-bound")
    if compute is None or inputs is None:
        return None, None, compute, inputs
    bound_by = "compute-bound" if compute <= inputs else "input-bound"
    return min(compute, inputs), bound_by, compute, inputs


def _inverse(value):
    return None if value is None else 1 / value


# The two kinds of ratio: (prefix of its keys, median steps/s of a mode,
# seconds per step of one repetition). Whole calls are the headline.
_KINDS = (
    ("", _call_speed, lambda rep: rep["call_seconds"] / rep["steps"]),
    ("steps_", _steps_speed, lambda rep: 1 / rep["steps_per_second"]),
)


def add_ratios(result):
    """Adds the limit and each mode's ratios to a workload's results.

    Every ratio is a time ratio (above 1: slower than the reference),
    computed twice:

    - of whole calls, the headline: `ratio_to_plain` is the mode's median
      seconds per step of its whole calls (`call_seconds_per_step`: the
      `fit` call, set-up and tear-down included; for `input-bound` making
      the iterator, the pass and dropping it) over plain's; likewise
      `ratio_to_expert` and `ratio_to_limit`, and `speedup_vs_plain` is
      plain's over the mode's. Their limit is the slower of
      `compute-bound` and `input-bound` by that median
      (`limit["call_seconds_per_step"]`, `limit["call_bound_by"]`).
    - of the steps alone (the first batch's beginning to the last one's
      end), with the prefix `steps_`: `steps_ratio_to_plain = plain's
      median steps/s / the mode's`, likewise `steps_ratio_to_expert`,
      `steps_ratio_to_limit` and `steps_speedup_vs_plain`, against the
      slower bound by median steps/s (`limit["steps_per_second"]`,
      `limit["bound_by"]`). These are what the unprefixed keys meant
      before whole calls became the headline.

    The `paired_` ratios (`steps_paired_` of the steps) compare the
    repetitions of one round (see `_paired`): `paired_ratio_to_plain` is
    the median over the rounds of the mode's time per step over plain's
    in the same round (the limit's: the slower of compute-bound and
    input-bound in that round), and `paired_speedup_vs_plain` the median
    of the inverse ratios. A single repetition's time moves with the
    machine's load, which moves every mode of a round alike: the
    paired ratio cancels that, where the ratio of medians takes each
    side's median from different rounds.

    A ratio is None when either side failed or lacks the times.
    """
    modes = result["modes"]
    limit, bound_by, compute, inputs = _limit(modes, _steps_speed)
    if limit is None:
        result["limit"] = None
    else:
        call, call_bound_by, call_compute, call_inputs = _limit(
            modes, _call_speed
        )
        result["limit"] = {
            # The steps alone (these keys' meaning is unchanged).
            "steps_per_second": limit,
            "seconds_per_step": 1 / limit,
            "bound_by": bound_by,
            "compute_bound_seconds_per_step": 1 / compute,
            "input_bound_seconds_per_step": 1 / inputs,
            # No overlap at all: each side in turn, each with every core.
            # When both sides keep every core busy (CPU-bound parsing on
            # few cores), overlapping them cannot do much better.
            "sequential_seconds_per_step": 1 / compute + 1 / inputs,
            # Whole calls: the limit of the headline ratios.
            "call_seconds_per_step": _inverse(call),
            "call_bound_by": call_bound_by,
            "compute_bound_call_seconds_per_step": _inverse(call_compute),
            "input_bound_call_seconds_per_step": _inverse(call_inputs),
            "sequential_call_seconds_per_step": (
                None if call is None else 1 / call_compute + 1 / call_inputs
            ),
        }
    for prefix, speed, rep_time in _KINDS:
        limit = _limit(modes, speed)[0]
        plain = speed(modes, "plain")
        expert = speed(modes, "expert")
        rounds = {name: _round_times(modes[name], rep_time) for name in modes}
        limit_rounds = _limit_rounds(rounds)
        for name in modes:
            sps = speed(modes, name)

            def ratio(reference, sps=sps):
                if sps is None or reference is None:
                    return None
                return reference / sps

            out = modes[name]
            out[f"{prefix}ratio_to_plain"] = ratio(plain)
            out[f"{prefix}ratio_to_expert"] = ratio(expert)
            out[f"{prefix}ratio_to_limit"] = ratio(limit)
            out[f"{prefix}speedup_vs_plain"] = (
                None if sps is None or plain is None else sps / plain
            )
            own = rounds[name]
            out[f"{prefix}paired_ratio_to_plain"] = _paired(
                own, rounds.get("plain")
            )
            out[f"{prefix}paired_ratio_to_expert"] = _paired(
                own, rounds.get("expert")
            )
            out[f"{prefix}paired_ratio_to_limit"] = _paired(own, limit_rounds)
            out[f"{prefix}paired_speedup_vs_plain"] = _paired(
                rounds.get("plain"), own
            )


def _round_times(mode, rep_time):
    """`{round: rep_time(rep)}` of a mode's repetitions, or None.

    None also when a repetition lacks the times `rep_time` reads (results
    written before whole calls were timed). Records without a round are
    numbered in order.
    """
    if "error" in mode or not mode.get("reps"):
        return None
    try:
        return {
            rep.get("round", i): rep_time(rep)
            for i, rep in enumerate(mode["reps"])
        }
    except KeyError:
        return None


def _limit_rounds(rounds):
    """The limit's time per step in each round both bounds ran."""
    compute, inputs = rounds.get("compute-bound"), rounds.get("input-bound")
    if compute is None or inputs is None:
        return None
    return {r: max(compute[r], inputs[r]) for r in compute if r in inputs}


def _paired(times, reference):
    """Median over the rounds both ran of `times / reference`, or None."""
    if times is None or reference is None:
        return None
    common = [r for r in times if r in reference]
    if not common:
        return None
    return paired_ratio(
        [times[r] for r in common], [reference[r] for r in common]
    )


def _remote_kwargs(read, latency):
    """The `remote` workload's own arguments."""
    kwargs = {"read": read}
    if latency is not None:
        kwargs["read_seconds"] = latency
    return kwargs


def run_benchmark(
    workloads,
    reps=None,
    steps=None,
    quick=False,
    trunk="light",
    batch_size=None,
    seed=0,
    data_dir=None,
    name="bench",
    argv=None,
    log=print,
    staged_options=None,
    remote_read="tf",
    remote_latency=None,
):
    """Runs `workloads` (names) and returns the whole results dict.

    Args:
        workloads: Workload names, keys of `benchmarks.workloads.WORKLOADS`.
        reps: Timed repetitions per mode; `None` for the default (7, or 3
            with `quick`, times the workload's `reps_factor`: 21 and 9 for
            `criteo`, `images` and `none`).
        steps: Batches per epoch for every workload; `None` for each
            workload's default (or its quick default with `quick`).
        quick: Use the reduced sizes of `make bench-quick`.
        trunk: Trunk width: "light", "heavy" or a multiplier.
        batch_size: Batch size for every workload; `None` for each
            workload's default.
        seed: Seed of data and weights.
        data_dir: Folder for files the workloads write (`images`); `None`
            for temporary folders.
        name: Name of the run, recorded in the results.
        argv: The command line, recorded in the results.
        log: Called with progress lines.
        staged_options: `StagedInput` options of the staged modes (e.g.
            `{"device": "cpu"}` to keep the buffer on the host of a GPU
            machine); `None` for the defaults.
        remote_read: How the `remote` workload emulates its read: `"tf"`
            or `"python"` (see `benchmarks.workloads.remote.RemoteRead`).
        remote_latency: Seconds of the `remote` workload's read per batch;
            `None` for its default (20 ms).

    Returns:
        A JSON-able dict (schema in benchmarks/README.md).
    """
    unknown = [w for w in workloads if w not in WORKLOADS]
    if unknown:
        raise ValueError(
            f"Unknown workload(s) {unknown}; choose from {list(WORKLOADS)}"
        )
    default_reps = reps is None
    if default_reps:
        reps = QUICK_REPS if quick else DEFAULT_REPS
    if reps < 1:
        raise ValueError(f"reps must be at least 1; got {reps}")
    env = environment.describe()
    before = environment.snapshot()
    started = time.perf_counter()
    log(
        f"keras_stage benchmarks '{name}': TensorFlow {env['tensorflow']}, "
        f"Keras {env['keras']}, {env['usable_cpus']} CPUs, load average "
        f"{before['loadavg'][0]:.2f}"
    )
    sections = {}
    for workload_name in workloads:
        cls = WORKLOADS[workload_name]
        workload = cls(
            steps=steps or (cls.quick_steps if quick else cls.default_steps),
            trunk=trunk,
            batch_size=batch_size,
            seed=seed,
            data_dir=data_dir,
            # Options only one workload has.
            **(
                _remote_kwargs(remote_read, remote_latency)
                if workload_name == "remote"
                else {}
            ),
        )
        try:
            sections[workload_name] = run_workload(
                workload,
                reps * cls.reps_factor if default_reps else reps,
                log=log,
                staged_options=staged_options,
            )
        finally:
            workload.close()
            # Free the workload's models and graphs before the next one.
            keras.backend.clear_session()
            gc.collect()
    return {
        "schema_version": SCHEMA_VERSION,
        "name": name,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "argv": list(argv) if argv is not None else None,
        "config": {
            "workloads": list(workloads),
            "reps": reps,
            "steps": steps,
            "quick": quick,
            "trunk": trunk,
            "batch_size": batch_size,
            "seed": seed,
            "staged_options": dict(staged_options or {}),
            "remote_read": remote_read,
            "remote_latency": remote_latency,
        },
        "timed": TIMED,
        "environment": env,
        "load": environment.load_between(before, environment.snapshot()),
        "wall_seconds": time.perf_counter() - started,
        "workloads": sections,
    }
