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
