"""The machine a benchmark ran on: versions, CPUs, and how loaded it was.

This module owns everything recorded to judge whether two results files
are comparable: library versions, the repository's commit, CPU counts, and
for each workload the load average before and after, the steal time of a
virtual machine (`/proc/stat`, when available) and how much CPU time other
processes used while it ran.
"""

import os
import platform
import subprocess
import time

import keras
import numpy as np
import tensorflow as tf

import keras_stage

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# /proc/stat counts in USER_HZ ticks.
_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def git(*args, folder=_ROOT):
    """`git args` run in `folder`: its output, or None if git failed."""
    try:
        return subprocess.run(
            ["git", *args],
            cwd=folder,
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None


def describe():
    """Versions, CPUs and the repository state, as a JSON-able dict."""
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:
        usable = os.cpu_count()
    # Results files rewritten by earlier runs do not change what is measured.
    status = git(
        "status",
        "--porcelain",
        "--untracked-files=no",
        "--",
        ".",
        ":(exclude)benchmarks/results",
    )
    threading = tf.config.threading
    return {
        "python": platform.python_version(),
        "tensorflow": tf.__version__,
        "keras": keras.__version__,
        "keras_stage": keras_stage.__version__,
        "numpy": np.__version__,
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "usable_cpus": usable,
        "gpus": len(tf.config.list_physical_devices("GPU")),
        # 0 means TensorFlow's default (one per core).
        "tf_inter_op_threads": threading.get_inter_op_parallelism_threads(),
        "tf_intra_op_threads": threading.get_intra_op_parallelism_threads(),
        "git_commit": git("rev-parse", "HEAD"),
        # keras_stage is edited while benchmarks run; a dirty tree means the
        # commit alone does not say which engine was measured.
        "git_dirty": None if status is None else bool(status),
    }


def _cpu_ticks():
    """The aggregate `cpu` line of /proc/stat as a dict, or None."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
    except OSError:
        return None
    names = ("user", "nice", "system", "idle", "iowait", "irq", "softirq")
    names += ("steal",)
    if not fields or fields[0] != "cpu":
        return None
    values = [int(v) for v in fields[1 : 1 + len(names)]]
    return dict(zip(names, values, strict=False))


def snapshot():
    """The machine's load now; pass two of them to `load_between`."""
    times = os.times()
    return {
        "wall": time.perf_counter(),
        "loadavg": list(os.getloadavg()),
        "ticks": _cpu_ticks(),
        "own_cpu_seconds": times.user + times.system,
    }


def load_between(before, after):
    """How loaded the machine was between two `snapshot`s.

    Returns:
        A dict: `loadavg_before`/`loadavg_after` (1, 5, 15 minutes),
        `wall_seconds`, and from /proc/stat when available:
        `steal_fraction` (of all CPU time; a busy VM host shows here),
        `busy_fraction` (non-idle CPU time over all CPUs) and
        `other_cpu_seconds` (CPU time used by other processes: busy time
        minus this process's own).
    """
    out = {
        "loadavg_before": before["loadavg"],
        "loadavg_after": after["loadavg"],
        "wall_seconds": after["wall"] - before["wall"],
    }
    if before["ticks"] is None or after["ticks"] is None:
        return out
    delta = {k: after["ticks"][k] - before["ticks"][k] for k in after["ticks"]}
    total = sum(delta.values())
    if total <= 0:
        return out
    idle = delta["idle"] + delta.get("iowait", 0)
    busy_seconds = (total - idle - delta.get("steal", 0)) / _TICKS
    own = after["own_cpu_seconds"] - before["own_cpu_seconds"]
    out["steal_fraction"] = delta.get("steal", 0) / total
    out["busy_fraction"] = (total - idle) / total
    out["other_cpu_seconds"] = max(0.0, busy_seconds - own)
    return out
