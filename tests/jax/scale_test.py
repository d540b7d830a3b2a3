"""`benchmarks.scenarios.scale`: its cases, their processes, a smoke run.

The processes' environments and the one-device case run here; every
configuration in its own processes (two host devices, two processes joined
by `jax.distributed`) is a long test.
"""

import argparse

import pytest

pytestmark = pytest.mark.timeout(300)


def _args(*argv):
    # Imported here: collected (and skipped) on TensorFlow too.
    from benchmarks import __main__ as cli

    return cli.parse(["scale", *argv])


def test_the_cases_are_each_workload_in_each_configuration():
    scale, args = _args("--configs", "1x1,2x1")
    assert scale.modes == ("expert", "staged", "expert_again")
    assert scale.cases(args) == [
        "criteo_columns@1x1",
        "dcn@1x1",
        "criteo_columns@2x1",
        "dcn@2x1",
    ]
    _, args = _args("--configs", "1x1,3x3")
    with pytest.raises(SystemExit, match="3x3"):
        scale.cases(args)


def test_each_configuration_has_its_devices_and_processes(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    scale, args = _args("--quick")
    (one,) = scale.case_processes("dcn@1x1", args)
    (two,) = scale.case_processes("dcn@1x2", args)
    assert one["XLA_FLAGS"].split()[0] == f"{_device_flag()}=1"
    assert two["XLA_FLAGS"].split()[0] == f"{_device_flag()}=2"
    assert "--xla_backend_optimization_level=0" in two["XLA_FLAGS"]
    assert not any(key.startswith("KERAS_DISTRIBUTION") for key in two)
    first, second = scale.case_processes("dcn@2x1", args)
    assert first["XLA_FLAGS"] == second["XLA_FLAGS"] == one["XLA_FLAGS"]
    # One coordinator, a process id each, gloo collectives on the CPU.
    address = first["KERAS_DISTRIBUTION_JOB_ADDRESSES"]
    assert address.startswith("127.0.0.1:")
    assert second["KERAS_DISTRIBUTION_JOB_ADDRESSES"] == address
    assert first["KERAS_DISTRIBUTION_PROCESS_ID"] == "0"
    assert second["KERAS_DISTRIBUTION_PROCESS_ID"] == "1"
    assert first["KERAS_DISTRIBUTION_NUM_PROCESSES"] == "2"
    assert first["JAX_CPU_COLLECTIVES_IMPLEMENTATION"] == "gloo"


def _device_flag():
    from benchmarks.scenarios import scale

    return scale.DEVICES


def test_the_one_device_case_trains_the_same_weights_on_whole_batches():
    import keras

    from benchmarks import runner
    from benchmarks.modes import MODES
    from benchmarks.scenarios import scale

    scenario = scale.Scale()
    scenario.epochs = 1
    args = argparse.Namespace(quick=True, steps=2)
    expert, staged = (
        scenario.setup("criteo_columns@1x1", MODES[name], args)
        for name in ("expert", "staged")
    )
    assert keras.distribution.distribution() is None  # one device
    assert staged["max_dw"] <= 1e-6
    assert staged["data"].element_spec[1].shape[0] == 256  # drop_remainder
    layers = staged["built"].model.get_stage_plan().staged_layers
    assert {"dense_norm", "C1_hash", "C26_hash"} <= set(layers)
    trial = runner.timed(scenario, staged, staged=True)
    assert trial["metrics"]["seconds"] > 0


@pytest.mark.long
@pytest.mark.timeout(900)
def test_every_configuration_runs_in_its_own_processes():
    from benchmarks import records, runner

    scale, args = _args("--quick", "--rounds", "1", "--workloads", "dcn")
    rows = runner.run(scale, args, log=lambda line: None)
    cases = ["dcn@1x1", "dcn@1x2", "dcn@2x1"]
    assert sorted({row["workload"] for row in rows}) == cases
    # A run's setup raises when the modes' weights differ after one fit.
    summaries = records.summarize(rows, scale.reference, scale.control)
    for summary in summaries:
        assert set(summary["median"]) == set(scale.modes)
        assert summary["ratio"]["staged"] > 0 and summary["control"] > 0
