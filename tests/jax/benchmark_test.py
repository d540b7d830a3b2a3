"""benchmarks/jax_backend.py runs, at its smallest, on the JAX backend."""

import pytest

pytestmark = pytest.mark.timeout(300)


def test_the_quick_run_compares_staged_with_the_hand_split_pipeline():
    # Imported here: collected (and skipped) on TensorFlow too.
    from benchmarks import jax_backend

    lines = []
    results = jax_backend.run(rounds=1, quick=True, log=lines.append)
    assert set(results["workloads"]) == {"tabular", "criteo"}
    for workload in results["workloads"].values():
        # Plain Keras cannot fit string inputs on JAX: recorded, not timed.
        assert not workload["plain"]["possible"]
        assert workload["weight_check"]["max_abs_difference"] <= 1e-6
        assert "staged_input" in workload["staged_plan"]["staged_layers"][0]
    assert "staged/expert" in jax_backend.format_table(results)


def test_repeated_calls_are_timed_in_both_modes():
    from benchmarks import jax_calls

    lines = []
    results = jax_calls.run("tabular", "evaluate", 3, 2, log=lines.append)
    assert len(lines) == 1 and "evaluate x3" in lines[0]
    for mode in ("staged", "expert"):
        assert len(results[mode]) == 3
        assert all(value > 0 for value in results[mode])
    warm = jax_calls.WARM_UP
    assert results["summary"]["staged_ms"] == pytest.approx(
        1000 * results["staged"][warm]
    )
