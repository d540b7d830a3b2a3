"""The torch backend's benchmarks run, at their smallest, on torch.

What is checked is the results' structure and that the staged and the hand
split trained the same weights, never their speed.
"""

import pytest

pytestmark = pytest.mark.timeout(600)


def test_the_quick_run_compares_staged_with_the_hand_split_and_itself():
    from benchmarks import jax_backend

    results = jax_backend.run(rounds=1, quick=True, log=lambda line: None)
    assert results["family"] == "torch_backend"
    assert results["environment"]["torch"].startswith("2.")
    assert set(results["workloads"]) == {"tabular", "criteo"}
    for workload in results["workloads"].values():
        # Plain Keras cannot fit string inputs on torch: recorded.
        assert not workload["plain"]["possible"]
        assert workload["weight_check"]["max_abs_difference"] <= 1e-6
        assert "staged_input" in workload["staged_plan"]["staged_layers"][0]
        assert set(workload["modes"]) == set(jax_backend.MODES)
        assert set(workload["paired_ratios"]) == {
            "staged/expert",
            "expert_again/expert",
        }
        for ratios in workload["paired_ratios"].values():
            assert set(ratios) == {"seconds", "steps_seconds"}
            assert all(ratio > 0 for ratio in ratios.values())
    table = jax_backend.format_table(results)
    assert "staged/expert" in table and "impossible on torch" in table


@pytest.mark.slow
def test_a_split_script_runs_each_mode_in_a_fresh_torch_process():
    from benchmarks import first_calls

    results = first_calls.run_scripts(
        ["tabular_split"], 1, log=lambda line: None, tiny=True
    )
    section = results["scripts"]["tabular_split"]
    assert "error" not in section, section.get("error")
    assert section["keras_backend"] == "torch"
    assert section["versions"]["torch"].startswith("2.")
    for mode in first_calls.MODES:
        (run,) = section["runs"][mode]
        assert set(run["seconds"]) == {
            "script",
            "fit",
            "evaluate",
            "predict",
            "process",
        }
    assert set(section["summary"]["script"]["paired"]) == {
        "staged/plain",
        "plain_again/plain",
    }
