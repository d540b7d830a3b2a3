"""The tests mirror the package: each module has its own test file.

`keras_stage/data/staging.py` is tested in `tests/data/staging_test.py`,
and so on; suites that cross modules (reliability, fuzz, benchmarks) have
folders of their own. Reads file names only.
"""

import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "keras_stage"
CROSS_CUTTING = ("reliability", "fuzz", "benchmarks", "jax")


def _modules():
    return sorted(
        path.relative_to(PACKAGE)
        for path in PACKAGE.rglob("*.py")
        if path.name != "__init__.py"
    )


def test_the_package_has_modules():
    assert pathlib.Path("data/staging.py") in _modules()


def test_every_module_has_its_own_test_file():
    missing = [
        str(module)
        for module in _modules()
        if not (
            ROOT / "tests" / module.parent / f"{module.stem}_test.py"
        ).is_file()
    ]
    assert not missing, (
        f"modules without a test file of their own: {missing}; add "
        "tests/<package path>/<module>_test.py for each"
    )


def test_cross_cutting_suites_have_their_own_folders():
    for name in CROSS_CUTTING:
        folder = ROOT / "tests" / name
        assert (folder / "__init__.py").is_file(), folder
        assert list(folder.glob("*_test.py")), folder


MODELS_API = ("model.py", "sequential.py", "staging_mixin.py", "model_state.py")
MODELS_FOLDERS = ("call", "data_adapters", "decision", "backends")


def test_models_folders_show_the_staged_call():
    models = PACKAGE / "models"
    for name in MODELS_FOLDERS:
        assert (models / name / "__init__.py").is_file(), models / name
    loose = sorted(
        path.name
        for path in models.glob("*.py")
        if path.name not in ("__init__.py", *MODELS_API)
    )
    assert not loose, (
        f"modules directly in keras_stage/models/: {loose}; only the model "
        f"API ({', '.join(MODELS_API)}) sits there. A new module goes in "
        "the folder of its part of the staged call: call/ (a call's "
        "lifetime), data_adapters/ (the data path, one file per input "
        "type), decision/ (whether a call or an epoch is staged) or "
        "backends/ (the backend's steps)"
    )


def test_only_the_backends_folder_asks_which_backend_runs():
    # Keras picks one trainer class per backend; keras_stage one `Backend`
    # per model (models/backends/), which everyone else asks instead.
    asks = ("graph_steps(", "backend.backend()", "config.backend()")
    found = [
        f"{path.relative_to(PACKAGE)}: {ask}"
        for path in PACKAGE.rglob("*.py")
        if path.parent != PACKAGE / "models" / "backends"
        for ask in asks
        if ask in path.read_text()
    ]
    assert not found, (
        f"backend asks outside keras_stage/models/backends/: {found}; ask "
        "the model's backend (`backends.for_model(model)`) instead"
    )
