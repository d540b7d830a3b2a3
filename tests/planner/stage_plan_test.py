"""Tests for keras_stage/planner/stage_plan.py: the plan as users see it.

Plans are built by hand here, so each field, size and line of the summary
is checked on its own; what the planner puts in them is
tests/planner/planner_test.py's.
"""

import json

import pytest

from keras_stage import StagePlan
from keras_stage.planner.stage_plan import BoundaryTensor


def _plan(**overrides):
    fields = dict(
        model_name="tabular",
        staged_layers=["stage", "lookup", "shared"],
        trunk_layers=["shared", "embed", "head"],
        reasons={
            "shared": "called in the trunk too",
            "embed": "has trainable weights",
            "head": "has trainable weights",
        },
        boundary=[
            BoundaryTensor("lookup", "int64", (None, 3)),
            BoundaryTensor("shared", "float32", (None, 2)),
        ],
        layer_types={"lookup": "StringLookup", "embed": "Embedding"},
        cut_reason="after 'shared', the longest prefix",
        candidate_cuts=[(None, None), ("lookup", 24)],
    )
    fields.update(overrides)
    return StagePlan(**fields)


def _summary(plan, **kwargs):
    lines = []
    plan.summary(print_fn=lines.append, **kwargs)
    return lines


# -- BoundaryTensor ---------------------------------------------------------


@pytest.mark.parametrize(
    "dtype, shape, per_example, per_batch",
    [
        ("float32", (None, 4), 16, None),
        ("float32", (8, 4), 16, 128),
        ("int64", (2, 3, 5), 120, 240),
        ("bool", (None,), 1, None),
        ("uint8", (None, 2, None), None, None),  # unknown inner dimension
        ("string", (8, 4), None, None),  # no fixed size
    ],
)
def test_boundary_tensor_sizes(dtype, shape, per_example, per_batch):
    tensor = BoundaryTensor("t", dtype, shape)
    assert tensor.bytes_per_example == per_example
    assert tensor.bytes_per_batch == per_batch


@pytest.mark.parametrize("kind", ["sparse", "ragged"])
def test_sparse_and_ragged_tensors_have_no_static_size(kind):
    tensor = BoundaryTensor("t", "float32", (8, 4), kind=kind)
    assert tensor.bytes_per_example is None
    assert tensor.bytes_per_batch is None


def test_boundary_tensor_config_equality_and_repr():
    tensor = BoundaryTensor("ids", "int64", [None, 3], kind="ragged")
    assert tensor.shape == (None, 3)  # a list is kept as a tuple
    config = tensor.get_config()
    assert config == {
        "name": "ids",
        "dtype": "int64",
        "shape": (None, 3),
        "kind": "ragged",
    }
    assert BoundaryTensor.from_config(config) == tensor
    assert tensor != BoundaryTensor("ids", "int64", (None, 3))  # dense
    assert tensor != config
    assert repr(tensor) == (
        "BoundaryTensor(name='ids', dtype='int64', shape=(None, 3), "
        "kind='ragged')"
    )


# -- StagePlan fields -------------------------------------------------------


def test_plan_copies_what_it_is_given():
    staged, reasons = ["stage"], {"head": "has trainable weights"}
    plan = StagePlan("m", staged, ["head"], reasons, [])
    staged.append("later")
    reasons["late"] = "x"
    assert plan.staged_layers == ["stage"]
    assert plan.reasons == {"head": "has trainable weights"}


def test_plan_defaults():
    plan = StagePlan("m", [], [], {}, [])
    assert plan.automatic is False
    assert plan.note == ""
    assert plan.layer_types == {}
    assert plan.cut_reason == ""
    assert plan.candidate_cuts == []


def test_candidate_cuts_are_tuples_whatever_they_were_given_as():
    plan = _plan(candidate_cuts=[[None, 8], ["lookup", None]])
    assert plan.candidate_cuts == [(None, 8), ("lookup", None)]


def test_plan_sizes_add_up_the_boundary():
    assert _plan().bytes_per_example == 3 * 8 + 2 * 4
    assert _plan().bytes_per_batch is None  # batch size set by the data
    static = [
        BoundaryTensor("a", "int64", (4, 3)),
        BoundaryTensor("b", "float32", (4, 2)),
    ]
    assert _plan(boundary=static).bytes_per_batch == 4 * (3 * 8 + 2 * 4)


def test_plan_sizes_are_none_when_not_static():
    assert _plan(boundary=[]).bytes_per_example is None
    unsized = _plan(
        boundary=[
            BoundaryTensor("a", "int64", (4, 3)),
            BoundaryTensor("s", "string", (4,)),
        ]
    )
    assert unsized.bytes_per_example is None
    assert unsized.bytes_per_batch is None


def test_plan_config_names_every_field_and_survives_json():
    plan = _plan(automatic=True, note="why not")
    config = plan.get_config()
    assert set(config) == {
        "model_name",
        "staged_layers",
        "trunk_layers",
        "reasons",
        "boundary",
        "automatic",
        "note",
        "layer_types",
        "cut_reason",
        "candidate_cuts",
    }
    restored = StagePlan.from_config(json.loads(json.dumps(config)))
    assert restored == plan
    assert restored.boundary[0] == BoundaryTensor("lookup", "int64", (None, 3))
    assert restored.automatic is True and restored.note == "why not"


def test_from_config_leaves_the_config_it_reads_alone():
    config = _plan().get_config()
    StagePlan.from_config(config)
    assert isinstance(config["boundary"][0], dict)


def test_plans_differ_by_any_field():
    assert _plan() == _plan()
    assert _plan() != _plan(trunk_layers=["head"])
    assert _plan() != _plan(layer_types={})
    assert _plan() != _plan().get_config()


def test_plan_repr_names_the_layers_and_the_cut():
    assert repr(_plan()) == (
        "StagePlan(model_name='tabular', "
        "staged_layers=['stage', 'lookup', 'shared'], "
        "trunk_layers=['shared', 'embed', 'head'], "
        "boundary=['lookup', 'shared'])"
    )


# -- summary ----------------------------------------------------------------


def test_summary_lists_each_layer_once_with_where_it_runs():
    lines = _summary(_plan())
    assert lines[0] == 'Stage plan: "tabular"'
    assert lines[2].split() == [
        "Layer",
        "(type)",
        "Runs",
        "in",
        "Why",
        "not",
        "staged",
    ]
    layer_rows = lines[4 : lines.index(lines[1], 4)]
    rows = {line.split()[0]: line for line in layer_rows}
    assert list(rows) == ["stage", "lookup", "shared", "embed", "head"]
    assert rows["stage"].split()[1] == "stage"
    assert rows["lookup"].split()[:3] == ["lookup", "(StringLookup)", "stage"]
    assert rows["shared"].split()[1] == "both"
    assert rows["shared"].endswith("called in the trunk too")
    assert rows["embed"].split()[:3] == ["embed", "(Embedding)", "trunk"]


def test_summary_tables_and_footer():
    text = "\n".join(_summary(_plan()))
    assert "Layer (type)" in text and "Why not staged" in text
    assert "Cut tensor" in text and "Bytes/example" in text
    assert " Staged layers: 3  Trunk layers: 3  Cut: 2 tensors, 32 " in text
    assert "(bytes/batch: 32 x batch\n   size)" in text  # wrapped, indented
    assert " Why this cut: after 'shared', the longest prefix" in text
    assert "inputs ?, lookup 24" in text  # the model inputs, no static size


def test_summary_marks_sparse_and_unsized_cut_tensors():
    plan = _plan(
        boundary=[
            BoundaryTensor("ids", "int64", (None, None), kind="sparse"),
            BoundaryTensor("big", "float32", (None, 1000)),
        ]
    )
    lines = _summary(plan)
    ids = next(line for line in lines if line.startswith("ids "))
    big = next(line for line in lines if line.startswith("big "))
    assert "int64 (sparse)" in ids and ids.endswith("?")
    assert big.endswith("4,000")
    assert any("size not static" in line for line in lines)


def test_summary_of_a_static_batch_gives_bytes_per_batch():
    plan = _plan(boundary=[BoundaryTensor("x", "float32", (8, 4))])
    assert any(
        "16 bytes/example, 128 bytes/batch" in line for line in _summary(plan)
    )


def test_summary_says_why_nothing_or_everything_is_planned():
    lines = _summary(
        _plan(
            note="Model 'sub' is subclassed: nothing could be planned.",
            automatic=True,
            cut_reason="",
            candidate_cuts=[],
        )
    )
    assert lines[1] == "Model 'sub' is subclassed: nothing could be planned."
    assert lines[2].startswith("No StagedInput: the stage starts at the model")
    text = "\n".join(lines)
    assert "Why this cut" not in text and "Candidate cuts" not in text


@pytest.mark.parametrize("width", [98, 140])
def test_summary_keeps_to_its_line_length(width):
    long_name = "a_layer_with_a_name_much_longer_than_its_column_" * 2
    plan = _plan(
        trunk_layers=[long_name],
        reasons={long_name: "has trainable weights " * 8},
        cut_reason="a long reason " * 20,
    )
    lines = _summary(plan, line_length=width)
    assert max(len(line) for line in lines) <= width
    assert any("…" in line for line in lines)  # cut, not wrapped
    assert sum("a long reason" in line for line in lines) > 1  # wrapped


def test_summary_prints_by_default(capsys):
    _plan().summary()
    assert capsys.readouterr().out.startswith('Stage plan: "tabular"\n')
