"""benchmarks.decisions: what keras_stage decided, as the benchmarks keep it."""

import logging

from benchmarks import decisions, regimes


def _decided(*calls):
    return [{"phase": p, "staged": s, "why": "-"} for p, s in calls]


def test_compact_counts_runs_of_equal_decisions_in_order():
    calls = _decided(
        ("train", True),
        ("train", False),
        ("train", False),
        ("test", False),
        ("train", False),
    )
    assert decisions.compact(calls) == (
        "train staged, train unstaged x2, test unstaged, train unstaged"
    )
    assert decisions.compact([]) == ""


def test_the_logged_lines_become_one_compact_line():
    logger = logging.getLogger("keras_stage")
    with decisions.decisions_logged() as logged:
        logger.info("Model 'm': train is staged: nothing is measured yet.")
        logger.info(
            "Model 'm': train runs the whole model in Keras's step, "
            "unstaged: it cannot repay its set-up."
        )
    assert decisions.compact(logged) == "train staged, train unstaged"


def test_agree_counts_each_distinct_sequence():
    assert decisions.agree(["a", "a"]) == {
        "sequences": ["a"],
        "counts": [2],
        "same": True,
    }
    assert decisions.agree(["a", "b", "a"]) == {
        "sequences": ["a", "b"],
        "counts": [2, 1],
        "same": False,
    }
    assert decisions.agree([])["same"]


def test_a_regime_says_whether_its_rounds_decided_alike():
    line = regimes._decisions_line
    assert regimes.decisions_summary(["b", "a", "a"]) == {
        "sequences": ["b", "a"],
        "counts": [1, 2],
        "same": False,
        "same_after_first": True,
    }
    assert line(regimes.decisions_summary(["train unstaged"] * 3)) == (
        "the same in all 3 rounds (train unstaged)"
    )
    assert line(
        regimes.decisions_summary(
            ["train staged", "train unstaged", "train unstaged"]
        )
    ) == ("round 1: train staged; rounds 2-3: train unstaged")
    assert line(regimes.decisions_summary(["a", "b", "a", "c"])) == (
        "DIFFER: 2 rounds: a; 1 rounds: b; 1 rounds: c"
    )
    assert (
        line(regimes.decisions_summary(["", ""]))
        == "the same in all 2 rounds (none)"
    )
