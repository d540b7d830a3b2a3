"""`StagePlan`: what SmartStage stages in a model, and why the rest is not
(`planner.py` fills it in, `Model.stage_summary()` prints it)."""

import math
import textwrap


class BoundaryTensor:
    """A tensor that crosses the cut, from the stage to the trunk.

    Attributes:
        name: The producing layer's name (`[i]` for its i-th output, `@k`
            for its k-th call), or the model input's name.
        dtype: The dtype's name, from a trace (e.g. `"int64"`).
        shape: The shape, a tuple (`None`: unknown); the first is the batch.
        kind: `"dense"`, `"sparse"` or `"ragged"`.
        bytes_per_example: Bytes of one example, or `None` if not static.
        bytes_per_batch: Bytes of one batch, or `None` if not static.
    """

    def __init__(self, name, dtype, shape, kind="dense"):
        self.name = name
        self.dtype = dtype
        self.shape = tuple(shape)
        self.kind = kind

    @property
    def bytes_per_example(self):
        if self.kind != "dense" or self.dtype == "string":
            return None
        if any(d is None for d in self.shape[1:]):
            return None
        import tensorflow as tf

        return math.prod(self.shape[1:]) * tf.as_dtype(self.dtype).size

    @property
    def bytes_per_batch(self):
        per_example = self.bytes_per_example
        if per_example is None or not self.shape or self.shape[0] is None:
            return None
        return per_example * self.shape[0]

    def get_config(self):
        return {
            "name": self.name,
            "dtype": self.dtype,
            "shape": self.shape,
            "kind": self.kind,
        }

    @classmethod
    def from_config(cls, config):
        return cls(**config)

    def __eq__(self, other):
        return (
            isinstance(other, BoundaryTensor)
            and self.get_config() == other.get_config()
        )

    def __repr__(self):
        return (
            f"BoundaryTensor(name={self.name!r}, dtype={self.dtype!r}, "
            f"shape={self.shape}, kind={self.kind!r})"
        )


class StagePlan:
    """Which layers of a model SmartStage runs in the stage, and why not.

    Returned by `keras_stage.Model.get_stage_plan()`. The staged layers run
    in the staging pipeline, the trunk layers in the train step; a shared
    layer called on both sides is in both lists.

    Attributes:
        model_name: The planned model's name.
        staged_layers: Names of the staged layers, in topological order
            (the `StagedInput` first; input layers are not listed).
        trunk_layers: Names of the trunk layers, in topological order.
        reasons: For every trunk layer, a short reason it is not staged.
        boundary: The `BoundaryTensor`s crossing the cut, in the order the
            stage hands them to the trunk.
        automatic: Whether the model has no `StagedInput`.
        note: Why nothing could be planned, or `""`.
        layer_types: The class name of every planned layer, by name.
        cut_reason: Why the cut is where it is, or `""`.
        candidate_cuts: The cuts weighed, `(after_layer_name,
            bytes_per_example)` after each staged call of the longest
            prefix, in order; the first name is the `StagedInput` or `None`
            (the model inputs). A size is `None` when not static.

    Example:

    >>> import keras, keras_stage
    >>> inputs = keras.Input(shape=(), dtype="string")
    >>> x = keras_stage.layers.StagedInput(name="stage")(inputs)
    >>> x = keras.layers.Hashing(num_bins=100, name="hash")(x)
    >>> x = keras.layers.Embedding(100, 4, name="emb")(x)
    >>> outputs = keras.layers.Dense(1, name="head")(x)
    >>> model = keras_stage.Model(inputs, outputs)
    >>> model.compile(optimizer="adam", loss="mse", smart_stage=True)
    >>> plan = model.get_stage_plan()
    >>> plan.trunk_layers
    ['emb', 'head']
    >>> plan.reasons["head"]
    'has trainable weights'
    >>> [(t.dtype, t.shape) for t in plan.boundary]
    [('int64', (None,))]
    >>> plan.candidate_cuts  # strings have no static size
    [('stage', None), ('hash', 8)]
    """

    def __init__(
        self,
        model_name,
        staged_layers,
        trunk_layers,
        reasons,
        boundary,
        automatic=False,
        note="",
        layer_types=None,
        cut_reason="",
        candidate_cuts=None,
    ):
        self.model_name = model_name
        # A subclass planned once its input specs are known (`plan_model`).
        self.pending = False
        self.staged_layers = list(staged_layers)
        self.trunk_layers = list(trunk_layers)
        self.reasons = dict(reasons)
        self.boundary = list(boundary)
        self.automatic = automatic
        self.note = note
        self.layer_types = dict(layer_types or {})
        self.cut_reason = cut_reason
        # Tuples, whether given tuples or the lists of a JSON config.
        self.candidate_cuts = [
            (name, size) for name, size in candidate_cuts or []
        ]

    @property
    def bytes_per_example(self):
        """Bytes crossing the cut per example, or `None` if not static."""
        sizes = [t.bytes_per_example for t in self.boundary]
        if not sizes or any(s is None for s in sizes):
            return None
        return sum(sizes)

    @property
    def bytes_per_batch(self):
        """Bytes crossing the cut per batch, or `None` if not static."""
        sizes = [t.bytes_per_batch for t in self.boundary]
        if not sizes or any(s is None for s in sizes):
            return None
        return sum(sizes)

    def get_config(self):
        return {
            "model_name": self.model_name,
            "staged_layers": self.staged_layers,
            "trunk_layers": self.trunk_layers,
            "reasons": self.reasons,
            "boundary": [t.get_config() for t in self.boundary],
            "automatic": self.automatic,
            "note": self.note,
            "layer_types": self.layer_types,
            "cut_reason": self.cut_reason,
            "candidate_cuts": [list(c) for c in self.candidate_cuts],
        }

    @classmethod
    def from_config(cls, config):
        """The plan `get_config` described (after JSON too)."""
        config = dict(config)
        config["boundary"] = [
            BoundaryTensor.from_config(t) for t in config["boundary"]
        ]
        return cls(**config)

    def __eq__(self, other):
        return (
            isinstance(other, StagePlan)
            and self.get_config() == other.get_config()
        )

    def __repr__(self):
        return (
            f"StagePlan(model_name={self.model_name!r}, "
            f"staged_layers={self.staged_layers}, "
            f"trunk_layers={self.trunk_layers}, "
            f"boundary={[t.name for t in self.boundary]})"
        )

    def summary(self, print_fn=None, line_length=None):
        """Prints the plan as a table, in the look of `model.summary()`.

        Args:
            print_fn: Called with each line; defaults to `print`.
            line_length: Total width of the tables. Defaults to 98.
        """
        print_fn = print_fn or print
        width = line_length or 98
        for line in _render(self, width):
            print_fn(line)


def _table(headers, rows, widths):
    def fit(text, size):
        text = str(text)
        return text if len(text) <= size else text[: size - 1] + "…"

    def line(cells):
        return " ".join(
            fit(c, w).ljust(w) for c, w in zip(cells, widths, strict=True)
        ).rstrip()

    total = sum(widths) + len(widths) - 1
    out = ["━" * total, line(headers), "━" * total]
    out += [line(r) for r in rows]
    out.append("━" * total)
    return out


def _render(plan, width):
    lines = [f'Stage plan: "{plan.model_name}"']
    if plan.note:
        lines.append(plan.note)
    if plan.automatic:
        lines.append(
            "No StagedInput: the stage starts at the model inputs with "
            "default options."
        )
    layer_width = max(24, width * 3 // 10)
    where_width = 7
    reason_width = max(20, width - layer_width - where_width - 2)
    rows = []
    for name in dict.fromkeys(plan.staged_layers + plan.trunk_layers):
        staged = name in plan.staged_layers
        trunk = name in plan.trunk_layers
        where = "both" if staged and trunk else "stage" if staged else "trunk"
        kind = plan.layer_types.get(name)
        label = f"{name} ({kind})" if kind else name
        rows.append((label, where, plan.reasons.get(name, "")))
    lines += _table(
        ("Layer (type)", "Runs in", "Why not staged"),
        rows,
        (layer_width, where_width, reason_width),
    )
    rows = []
    for t in plan.boundary:
        size = t.bytes_per_example
        rows.append(
            (
                t.name,
                t.dtype if t.kind == "dense" else f"{t.dtype} ({t.kind})",
                str(t.shape),
                "?" if size is None else f"{size:,}",
            )
        )
    cut_width = max(24, width * 3 // 10)
    lines += _table(
        ("Cut tensor", "Dtype", "Shape", "Bytes/example"),
        rows,
        (cut_width, 18, max(16, width - cut_width - 18 - 16 - 3), 16),
    )
    footer = [
        f"Staged layers: {len(plan.staged_layers)}"
        f"  Trunk layers: {len(plan.trunk_layers)}"
        f"  Cut: {len(plan.boundary)} tensors, {_cut_size(plan)}"
    ]
    if plan.cut_reason:
        footer.append(f"Why this cut: {plan.cut_reason}")
    if plan.candidate_cuts:
        cuts = ", ".join(
            f"{'inputs' if name is None else name} "
            + ("?" if size is None else f"{size:,}")
            for name, size in plan.candidate_cuts
        )
        footer.append(f"Candidate cuts (after layer, bytes/example): {cuts}")
    # Wrapped to the table's width, like Keras's summary footer.
    for text in footer:
        lines.extend(
            textwrap.wrap(
                text,
                width,
                initial_indent=" ",
                subsequent_indent="   ",
                break_on_hyphens=False,
            )
        )
    return lines


def _cut_size(plan):
    per_example = plan.bytes_per_example
    if per_example is None:
        return "size not static"
    per_batch = plan.bytes_per_batch
    if per_batch is None:
        # The batch size is set by the data, after planning.
        return (
            f"{per_example:,} bytes/example (bytes/batch: {per_example:,} "
            "x batch size)"
        )
    return f"{per_example:,} bytes/example, {per_batch:,} bytes/batch"
