"""The demo's environment pins what the primary environment pins.

`make demo` builds `.venv-demo` from `requirements/demo.txt` alone (the
demo's imports: TensorFlow, Keras, NumPy), so that a first run does not
install the test, lint and docs tools. It must run the versions `.venv`
tests: each of its pins is the primary environment's.
"""

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
REQUIREMENTS = ROOT / "requirements"


def _pins(name):
    """`{normalized package: version}` of a requirements file's `==` pins."""
    pins = {}
    for line in (REQUIREMENTS / name).read_text().splitlines():
        match = re.match(r"^([A-Za-z0-9_.\-\[\]]+)==(\S+)$", line.strip())
        if match:
            package = re.sub(r"\[.*\]", "", match.group(1))
            pins[re.sub(r"[-_.]+", "-", package).lower()] = match.group(2)
    return pins


def test_the_demo_pins_are_the_primary_environment_s():
    primary = _pins("primary-constraints.txt")
    for name in ("demo.txt", "demo-constraints.txt"):
        pins = _pins(name)
        assert pins, name
        differ = {
            package: (version, primary.get(package))
            for package, version in pins.items()
            if primary.get(package) != version
        }
        assert not differ, (
            f"requirements/{name} pins these packages unlike "
            f"requirements/primary-constraints.txt (demo, primary): {differ}. "
            "Rebuild the demo's constraints from a venv built with the "
            "primary constraints (see requirements/demo-constraints.txt)."
        )


def test_the_demo_installs_no_development_tools():
    pins = _pins("demo-constraints.txt")
    for tool in ("pytest", "ruff", "mkdocs", "hypothesis", "matplotlib"):
        assert tool not in pins, tool
    for needed in ("tensorflow-cpu", "keras", "numpy"):
        assert needed in _pins("demo.txt"), needed


def test_the_torch_environment_pins_the_cpu_build_beside_the_primary():
    # An open range, or a release newer than the one on this machine's
    # disk, makes pip download a CUDA build of torch of several GB.
    for name in ("torch.txt", "torch-constraints.txt"):
        pins = _pins(name)
        assert pins["torch"] == "2.13.0", (name, pins.get("torch"))
        for package in ("tensorflow-cpu", "keras", "numpy"):
            primary = _pins("primary-constraints.txt")[package]
            assert pins.get(package) == primary, (name, package)
    setup = (ROOT / "setup.cfg").read_text()
    assert re.search(r"^torch =\n    torch>=2\.13,<2\.14$", setup, re.M)
