"""`benchmarks.subclass_models`: the paired summary and a smoke run."""

import pytest

from benchmarks import subclass_models


def test_ratios_pair_each_round_with_the_reference():
    seconds = {
        "staged": [1.0, 3.0, 2.0],
        "reference": [2.0, 2.0, 2.0],
        "reference_again": [2.0, 1.0, 4.0],
    }
    summary = subclass_models.summarize(seconds)
    assert summary["staged/reference"] == 1.0  # median of 0.5, 1.5, 1.0
    assert summary["reference_again/reference"] == 1.0
    assert summary["median_seconds"]["staged"] == 2.0
    table = subclass_models.format_table(
        {"backend": "jax", "models": {"dlrm": summary}}
    )
    assert "hand split s" in table and "dlrm" in table


def test_unknown_models_are_refused():
    with pytest.raises(SystemExit):
        subclass_models.parse_args(["--models", "nope"])


@pytest.mark.long
@pytest.mark.timeout(300)
def test_a_quick_run_times_every_mode(tmp_path):
    results = subclass_models.main(
        ["--quick", "--models", "retrieval", "--out", str(tmp_path)]
    )
    seconds = results["models"]["retrieval"]["seconds"]
    assert set(seconds) == set(subclass_models.MODES)
    assert all(len(v) == 2 and min(v) > 0 for v in seconds.values())
    assert (tmp_path / f"{results['backend']}.json").exists()
