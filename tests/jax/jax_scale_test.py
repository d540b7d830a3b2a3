"""benchmarks/jax_scale.py runs, at its smallest, in every configuration.

One round of the `--quick` sizes: one process with one device, one with
two host devices and two `jax.distributed` processes, each in child
processes, the three configurations started together (`concurrent`: their
children's start-up and jit compilation overlap). No wall-clock
assertion: the staged and hand splits train the same weights in each
configuration, and every figure, the steady state's too, is a positive
number.
"""

import pytest

# Three configurations (four processes at once), each tracing six models,
# on 2 shared cores.
pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def results():
    # Imported here: collected (and skipped) on TensorFlow too.
    from benchmarks import jax_scale

    lines = []
    out = jax_scale.run(rounds=1, quick=True, log=lines.append, concurrent=True)
    out["lines"] = lines
    return out


def test_every_configuration_ran(results):
    from benchmarks import jax_scale

    configs = results["configs"]
    assert set(configs) == set(jax_scale.CONFIGS)
    for name, section in configs.items():
        assert "error" not in section, section.get("error")
        assert section["wall_seconds"] > 0
        processes, devices = jax_scale.CONFIGS[name]
        runs = section["processes"]
        assert [run["process_id"] for run in runs] == list(range(processes))
        for run in runs:
            assert run["process_count"] == processes
            assert len(run["devices"]) == processes * devices
            assert (run["distribution"] is None) == (name == "1x1")
            assert set(run["workloads"]) == {"criteo", "dcn"}
            assert run["steady_epochs"] == jax_scale.QUICK_STEADY_EPOCHS
            for workload in run["workloads"].values():
                assert workload["steady"]["epochs"] == run["steady_epochs"]
                for mode in workload["steady"]["modes"].values():
                    assert len(mode["rounds"]) == 1


def test_staged_and_hand_train_the_same_weights_in_each_configuration(
    results,
):
    # The stage and every preprocessing layer (criteo: Normalization and
    # 26 Hashing; dcn: 6 lookups) run staged.
    staged = {"criteo": 28, "dcn": 7}
    for section in results["configs"].values():
        for run in section["processes"]:
            for name, workload in run["workloads"].items():
                check = workload["weight_check"]
                assert check["staged_vs_hand"] <= 1e-6
                assert check["hand2_vs_hand"] <= 1e-6
                layers = workload["staged_layers"]
                assert layers[0].startswith("staged_input")
                assert len(layers) == staged[name], layers


def test_the_figures_are_positive_numbers(results):
    from benchmarks import jax_scale

    for section in results["configs"].values():
        for cell in section["summary"].values():
            # The whole fit(epochs=2) calls and the steady state's.
            for figures in (cell, cell["steady"]):
                assert figures["staged/hand"] > 0
                assert figures["hand2/hand"] > 0
                assert all(
                    v > 0 for v in figures["examples_per_second"].values()
                )
                # The calls' phases: epochs after the first (2 and more
                # epochs a call), and what came before them.
                later = figures["after_first_epoch"]
                assert later["staged/hand"] > 0 and later["hand2/hand"] > 0
                assert set(figures["setup_and_first_epoch_ms"]) == {
                    "staged",
                    "hand",
                    "hand2",
                }
                assert all(
                    v > 0 for v in figures["setup_and_first_epoch_ms"].values()
                )
    table = jax_scale.format_table(results)
    assert "staged/hand" in table and "hand2/hand" in table
    # A row per configuration, workload and fit, and the concurrent note.
    rows = [
        line for line in table.splitlines() if line[:3] in jax_scale.CONFIGS
    ]
    assert len(rows) == 2 * 2 * len(jax_scale.CONFIGS), table
    assert "ran at once" in table


def test_configs_names_the_configurations_to_run(capsys):
    from benchmarks import jax_scale

    assert jax_scale.parse_args([]).configs == tuple(jax_scale.CONFIGS)
    assert jax_scale.parse_args(["--configs", "1x1,2x1"]).configs == (
        "1x1",
        "2x1",
    )
    with pytest.raises(SystemExit):
        jax_scale.parse_args(["--configs", "1x1,3x3"])
    assert (
        "--configs must name some of 1x1, 1x2, 2x1" in capsys.readouterr().err
    )
