"""The engine's boundaries: no Keras in `keras_stage/data/`, and the one
private TensorFlow symbol it relies on (`keras_stage._compat`)."""

import ast
import pathlib

import tensorflow as tf

import keras_stage.data
from keras_stage import _compat
from keras_stage.data import stage

DATA_DIR = pathlib.Path(keras_stage.data.__file__).parent


def _called_name(call):
    func = call.func
    if isinstance(func, ast.Attribute):
        return func.attr
    return getattr(func, "id", None)


def _imported_modules(path):
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve inside keras_stage.data
                yield node.lineno, f"keras_stage.data.{node.module or ''}"
            else:
                yield node.lineno, node.module
                for alias in node.names:
                    yield node.lineno, f"{node.module}.{alias.name}"
        elif isinstance(node, ast.Call) and _called_name(node) in (
            "__import__",
            "import_module",
        ):
            for arg in node.args:
                if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                    yield node.lineno, arg.value


def _is_keras(module):
    parts = module.split(".")
    return (
        parts[0] in ("keras", "tf_keras")
        or module.startswith("tensorflow.keras")
        or module.startswith("tensorflow.python.keras")
        # Upward imports into the Keras-facing layers of keras_stage.
        or module.startswith(
            (
                "keras_stage.layers",
                "keras_stage.callbacks",
                "keras_stage.models",
            )
        )
    )


def test_engine_sources_exist():
    names = {p.name for p in DATA_DIR.glob("*.py")}
    assert {"__init__.py", "staging.py", "options.py", "runner.py"} <= names


def test_engine_never_imports_keras():
    offenders = []
    for path in sorted(DATA_DIR.rglob("*.py")):
        for lineno, module in _imported_modules(path):
            if _is_keras(module):
                offenders.append(f"{path.name}:{lineno} imports {module}")
    assert not offenders, (
        "keras_stage/data/ is the Keras-free engine; found "
        + "; ".join(offenders)
    )


def test_engine_uses_tf_keras_attribute_nowhere():
    # `tf.keras` reaches Keras without an import statement.
    offenders = []
    for path in sorted(DATA_DIR.rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and node.attr == "keras"
                and isinstance(node.value, ast.Name)
                and node.value.id in ("tf", "tensorflow")
            ):
                offenders.append(f"{path.name}:{node.lineno}")
    assert not offenders, f"tf.keras used in the engine at {offenders}"


def test_import_checker_sees_keras_imports(tmp_path):
    # Guard against a checker that can never fail.
    sample = tmp_path / "sample.py"
    sample.write_text(
        "import keras\n"
        "from keras import layers\n"
        "from tensorflow import keras as k\n"
        "import keras_stage.layers\n"
        "importlib.import_module('keras.src')\n"
        "import tensorflow as tf\n"
    )
    found = [(n, _is_keras(m)) for n, m in _imported_modules(sample)]
    flagged = {n for n, keras in found if keras}
    assert flagged == {1, 2, 3, 4, 5}, found


def test_dataset_variant_still_private_attribute():
    dataset = tf.data.Dataset.range(3)
    assert hasattr(dataset, "_variant_tensor"), (
        f"TensorFlow {tf.__version__} no longer gives tf.data.Dataset a "
        "`_variant_tensor`: keras_stage._compat.dataset_variant (used to "
        "build StagedDataset) must be updated for this release."
    )
    variant = _compat.dataset_variant(dataset)
    assert variant is dataset._variant_tensor
    assert variant.dtype == tf.variant, (
        f"`_variant_tensor` is a {variant.dtype} in TensorFlow "
        f"{tf.__version__}, not a variant: update _compat.dataset_variant."
    )


def test_dataset_variant_builds_an_equivalent_dataset():
    # What StagedDataset does with it: a Dataset subclass over the variant
    # of another dataset must iterate like that dataset.
    staged = stage(tf.data.Dataset.range(4), lambda x: x + 1, timeout=None)
    assert staged._variant_tensor is _compat.dataset_variant(staged.pipeline)
    assert [int(x) for x in staged] == [1, 2, 3, 4]
    assert [int(x) for x in staged.map(lambda x: -x)] == [-1, -2, -3, -4]
