"""Tests of stage options: every validation message, and what is accepted.

Also the table itself (`OPTIONS`): `StageOptions` is drawn from it, and so
are the option tables of the docs. That the entry points' signatures and
docstrings agree with it is pinned in tests/api_test.py.
"""

import pathlib
import re

import pytest
import tensorflow as tf
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from keras_stage.data import AUTO, StageOptions, stage
from keras_stage.data.options import OPTIONS, usable_cpus

DATASET = tf.data.Dataset.range(5)


def _invalid(name, value):
    """The start of the house-style message for `name=value`."""
    return (
        re.escape(f"Invalid value for argument `{name}`")
        + ".*"
        + re.escape(f"Received: {name}={value!r}")
    )


# -- one test per message ----------------------------------------------------


@pytest.mark.parametrize("value", [0, -1, "fast", True, 1.5, None])
def test_capacity_rejected(value):
    with pytest.raises(ValueError, match=_invalid("capacity", value)) as info:
        StageOptions(capacity=value)
    assert 'Expected a positive int or "auto"' in str(info.value)


@pytest.mark.parametrize("value", [0, -3, "many", False, 2.0])
def test_num_threads_rejected(value):
    with pytest.raises(
        ValueError, match=_invalid("num_threads", value)
    ) as info:
        StageOptions(num_threads=value)
    assert 'Expected a positive int or "auto"' in str(info.value)


@pytest.mark.parametrize("value", [0, -1, 0.0, "x", True, float("nan")])
def test_timeout_rejected(value):
    with pytest.raises(ValueError, match=_invalid("timeout", value)) as info:
        StageOptions(timeout=value)
    assert "Expected a positive number of seconds or None" in str(info.value)


@pytest.mark.parametrize("value", [0, -2, 1.5, "4", True])
def test_thread_pool_size_rejected(value):
    with pytest.raises(
        ValueError, match=_invalid("thread_pool_size", value)
    ) as info:
        StageOptions(thread_pool_size=value)
    assert "Expected a positive int or None" in str(info.value)


def test_thread_pool_smaller_than_num_threads_rejected():
    with pytest.raises(
        ValueError,
        match=re.escape(
            "Invalid value for argument `thread_pool_size`: a pool of 2 "
            "threads cannot run num_threads=4 producers at once. Use "
            "thread_pool_size >= 4 or leave it None. "
            "Received: thread_pool_size=2"
        ),
    ):
        StageOptions(num_threads=4, thread_pool_size=2)


@pytest.mark.parametrize("value", ["yes", 1, None])
def test_deterministic_rejected(value):
    with pytest.raises(
        ValueError,
        match=re.escape(
            "Invalid value for argument `deterministic`. Expected True or "
            f"False. Received: deterministic={value!r}"
        ),
    ):
        StageOptions(deterministic=value)


@pytest.mark.parametrize("value", ["banana", "/GPU", 0, None, "gpu:-1"])
def test_device_rejected(value):
    with pytest.raises(
        ValueError,
        match=re.escape("Invalid value for argument `device`. Expected ")
        + r".*"
        + re.escape(f"Received: device={value!r}"),
    ):
        StageOptions(device=value)


@pytest.mark.parametrize("value", [-1, 1.0, "1", True])
def test_stream_rejected(value):
    with pytest.raises(
        ValueError,
        match=re.escape(
            "Invalid value for argument `stream`. Expected None or a "
            "non-negative int (a stream made by "
            f"keras_stage.configure_streams). Received: stream={value!r}"
        ),
    ):
        StageOptions(stream=value)


@pytest.mark.parametrize("value", ["yes", 1, 0, None, "AUTO"])
def test_pack_transfer_rejected(value):
    with pytest.raises(
        ValueError,
        match=re.escape(
            'Invalid value for argument `pack_transfer`. Expected "auto", '
            f"True or False. Received: pack_transfer={value!r}"
        ),
    ):
        StageOptions(pack_transfer=value)


def test_device_options_are_kept():
    options = StageOptions(device="/GPU:1", stream=2, pack_transfer=False)
    config = options.get_config()
    assert (config["device"], config["stream"]) == ("/GPU:1", 2)
    assert config["pack_transfer"] is False


@pytest.mark.parametrize("value", ["", 3, b"bytes"])
def test_name_rejected(value):
    with pytest.raises(
        ValueError,
        match=re.escape(
            "Invalid value for argument `name`. Expected a non-empty string "
            f"or None. Received: name={value!r}"
        ),
    ):
        StageOptions(name=value)


@pytest.mark.parametrize("value", ["my stage", "1st", "a/b", "x-y"])
def test_name_that_tf_data_rejects_is_rejected_up_front(value):
    # tf.data names its transformations after the stage; a name it refuses
    # must get the stage's own message when the options are made (in
    # StagedInput too), not a tf.data error when the pipeline is built.
    with pytest.raises(ValueError, match=_invalid("name", value)):
        StageOptions(name=value)
    with pytest.raises(ValueError, match=_invalid("name", value)):
        stage(DATASET, name=value)


@pytest.mark.parametrize(
    "argument", ["closed_exception_types", "ignored_exception_types"]
)
@pytest.mark.parametrize(
    "value", ["InvalidArgumentError", 3, {tf.errors.NotFoundError}]
)
def test_exception_types_not_a_tuple_rejected(argument, value):
    with pytest.raises(
        TypeError,
        match=re.escape(
            f"Invalid value for argument `{argument}`. Expected a tuple of "
            "exception classes, e.g. (tf.errors.InvalidArgumentError,). "
            f"Received: {argument}={value!r}"
        ),
    ):
        StageOptions(**{argument: value})


@pytest.mark.parametrize(
    "argument", ["closed_exception_types", "ignored_exception_types"]
)
@pytest.mark.parametrize(
    "bad_item",
    [
        int,
        "NotFoundError",
        tf.errors.NotFoundError(None, None, "x"),
        KeyboardInterrupt,
    ],
)
def test_exception_types_item_not_an_exception_class_rejected(
    argument, bad_item
):
    value = (tf.errors.DataLossError, bad_item)
    with pytest.raises(
        TypeError,
        match=re.escape(
            f"Invalid value for argument `{argument}`. Every item must be an "
            "exception class such as tf.errors.DataLossError. "
            f"Received: {argument}={value!r} (bad item: {bad_item!r})"
        ),
    ):
        StageOptions(**{argument: value})


def test_type_both_closed_and_ignored_rejected():
    with pytest.raises(
        ValueError,
        match=re.escape(
            "An exception type cannot be both closed and ignored. Remove "
            "['DataLossError', 'OutOfRangeError'] from "
            "`closed_exception_types` or from `ignored_exception_types`."
        ),
    ):
        StageOptions(
            closed_exception_types=(
                tf.errors.OutOfRangeError,
                tf.errors.DataLossError,
            ),
            ignored_exception_types=[
                tf.errors.DataLossError,
                tf.errors.InvalidArgumentError,
                tf.errors.OutOfRangeError,
            ],
        )


def test_ignoring_the_default_closed_type_rejected():
    with pytest.raises(ValueError, match="OutOfRangeError"):
        stage(DATASET, ignored_exception_types=(tf.errors.OutOfRangeError,))


@pytest.mark.parametrize("value", [[0, 1, 2], None, "data.csv", DATASET.batch])
def test_stage_dataset_not_a_dataset_rejected(value):
    with pytest.raises(
        TypeError,
        match=re.escape(
            "Invalid value for argument `dataset`. Expected a "
            "tf.data.Dataset; wrap arrays with "
            "tf.data.Dataset.from_tensor_slices and generators with "
            "tf.data.Dataset.from_generator. "
        )
        + re.escape(f"Received: dataset={value!r}"),
    ):
        stage(value)


@pytest.mark.parametrize("value", [3, "tf.identity", [tf.identity]])
def test_stage_fn_not_callable_rejected(value):
    with pytest.raises(
        TypeError,
        match=re.escape(
            "Invalid value for argument `fn`. Expected a callable of one "
            f"element or None. Received: fn={value!r}"
        ),
    ):
        stage(DATASET, value)


@pytest.mark.parametrize(
    "kwargs, argument",
    [
        ({"capacity": 0}, "capacity"),
        ({"num_threads": -1}, "num_threads"),
        ({"timeout": "x"}, "timeout"),
        ({"thread_pool_size": 0}, "thread_pool_size"),
        ({"num_threads": 3, "thread_pool_size": 2}, "thread_pool_size"),
        ({"deterministic": "yes"}, "deterministic"),
        ({"name": ""}, "name"),
    ],
)
def test_stage_reports_option_errors_like_stage_options(kwargs, argument):
    with pytest.raises(ValueError) as from_options:
        StageOptions(**kwargs)
    with pytest.raises(ValueError) as from_stage:
        stage(DATASET, **kwargs)
    assert str(from_stage.value) == str(from_options.value)
    assert f"`{argument}`" in str(from_stage.value)


# -- accepted values ---------------------------------------------------------


def test_defaults():
    options = StageOptions()
    assert options.get_config() == {
        "capacity": AUTO,
        "num_threads": AUTO,
        "closed_exception_types": (tf.errors.OutOfRangeError,),
        "ignored_exception_types": (),
        "timeout": 300.0,
        "thread_pool_size": None,
        "deterministic": True,
        "name": None,
        "device": AUTO,
        "stream": None,
        "pack_transfer": AUTO,
        "service": None,
        "processing_mode": "distributed_epoch",
        "worker_timeout": 10.0,
    }


def test_accepted_values_are_normalised():
    options = StageOptions(
        capacity=3,
        num_threads=2,
        closed_exception_types=tf.errors.DataLossError,
        ignored_exception_types=[tf.errors.InvalidArgumentError],
        timeout=2,
        thread_pool_size=2,
        deterministic=False,
        name="parse",
    )
    assert options.closed_exception_types == (tf.errors.DataLossError,)
    assert options.ignored_exception_types == (tf.errors.InvalidArgumentError,)
    assert options.timeout == 2.0 and isinstance(options.timeout, float)
    assert StageOptions(timeout=None).timeout is None
    rebuilt = StageOptions(**options.get_config())
    assert rebuilt.get_config() == options.get_config()
    assert repr(options).startswith("StageOptions(capacity=3, num_threads=2")


def test_empty_policies_accepted():
    options = StageOptions(
        closed_exception_types=(), ignored_exception_types=()
    )
    assert options.closed_exception_types == ()
    assert options.ignored_exception_types == ()


def test_resolved_pool_size():
    cpus = usable_cpus()
    assert StageOptions(thread_pool_size=5).resolved_pool_size() == 5
    assert StageOptions(num_threads=1).resolved_pool_size() == max(1, cpus)
    # IO-bound stages need N real threads even with fewer cores.
    assert StageOptions(num_threads=64).resolved_pool_size() == 64
    assert StageOptions().resolved_pool_size() >= max(16, cpus)


def test_auto_pool_lets_autotune_exceed_the_cores():
    staged = stage(DATASET)
    options = staged.options()
    pool = staged.stage_options.resolved_pool_size()
    assert options.threading.private_threadpool_size == pool
    assert pool > usable_cpus()
    fixed = stage(DATASET, num_threads=3, thread_pool_size=7).options()
    assert fixed.threading.private_threadpool_size == 7


# -- the table ---------------------------------------------------------------


def test_stage_options_hold_the_table():
    assert list(StageOptions().get_config()) == [o.name for o in OPTIONS]
    assert StageOptions().get_config() == {o.name: o.default for o in OPTIONS}


@pytest.mark.parametrize("option", OPTIONS, ids=lambda o: o.name)
def test_every_default_passes_its_own_check_unchanged(option):
    assert option.check(option.default) == option.default


DOCS = pathlib.Path(__file__).resolve().parents[2] / "docs"


def _stated_defaults(text):
    """`(option, default)` per row of tables whose 2nd column is Default."""
    header = None
    for line in text.splitlines():
        if not line.startswith("|"):
            header = None
            continue
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if header is None:
            header = cells
        elif header[1:2] == ["Default"]:
            name, default = (re.fullmatch("`(.*)`", c) for c in cells[:2])
            if name and default:
                yield name.group(1), default.group(1)


def test_option_tables_in_the_docs_give_the_tables_defaults():
    # A docs table that states the options' defaults must state the ones the
    # code has.
    defaults = {o.name: o.default_code for o in OPTIONS}
    stated = [
        (page.name, name, default)
        for page in DOCS.rglob("*.md")
        for name, default in _stated_defaults(page.read_text())
        if name in defaults
    ]
    wrong = [row for row in stated if row[2] != defaults[row[1]]]
    assert not wrong, (
        f"Docs tables with stale defaults (page, option, default): {wrong}; "
        f"the defaults are {defaults}"
    )


# -- property test over combinations ----------------------------------------

_BAD = object()  # marks an argument drawn from its invalid values

_ARGUMENTS = {
    "capacity": (
        st.sampled_from([AUTO, 1, 2, 7]),
        st.sampled_from([0, -1, "fast", True, 1.0]),
    ),
    "num_threads": (
        st.sampled_from([AUTO, 1, 3, 8]),
        st.sampled_from([0, -2, "many", False, 2.5]),
    ),
    "timeout": (
        # Valid timeouts stay far above any fetch of five elements.
        st.sampled_from([None, 30, 60.0, 300.0]),
        st.sampled_from([0, -1.0, "x", True]),
    ),
    "thread_pool_size": (
        st.sampled_from([None, 8, 16]),
        st.sampled_from([0, -1, "8", 1.5]),
    ),
    "deterministic": (
        st.sampled_from([True, False]),
        st.sampled_from(["yes", 0, None]),
    ),
    "name": (
        st.sampled_from([None, "prop", "stage_x"]),
        st.sampled_from([7, b"stage"]),
    ),
    "ignored_exception_types": (
        st.sampled_from([(), (tf.errors.InvalidArgumentError,)]),
        st.sampled_from([(tf.errors.OutOfRangeError,), (int,), "oops"]),
    ),
}


@st.composite
def _combinations(draw):
    kwargs, invalid = {}, set()
    for argument, (valid, bad) in _ARGUMENTS.items():
        if draw(st.booleans()):
            continue  # left to its default
        if draw(st.integers(0, 4)) == 0:
            kwargs[argument] = draw(bad)
            invalid.add(argument)
        else:
            kwargs[argument] = draw(valid)
    return kwargs, invalid


# 10 drawn combinations in `make test`, the sweep of 30 in `make test-long`
# (both derandomized: the same combinations every run).
@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "examples", [10, pytest.param(30, marks=pytest.mark.long)]
)
def test_option_combinations(examples):
    @settings(
        max_examples=examples,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=[HealthCheck.function_scoped_fixture],
    )
    @given(_combinations())
    def check(combination):
        kwargs, invalid = combination
        if invalid:
            with pytest.raises((ValueError, TypeError)) as info:
                stage(DATASET, lambda x: x * 10, **kwargs)
            message = str(info.value)
            named = {a for a in invalid if f"`{a}`" in message}
            assert named, f"{message!r} names none of {sorted(invalid)}"
            return
        staged = stage(DATASET, lambda x: x * 10, **kwargs)
        try:
            assert sorted(int(x) for x in staged) == [0, 10, 20, 30, 40]
            if kwargs.get("deterministic", True):
                assert [int(x) for x in staged] == [0, 10, 20, 30, 40]
        finally:
            staged.close()

    check()
