"""constraints.txt is the lock of the set CI verified (scripts/lock, moved forward by scripts/check-newest): it
agrees with pyproject.toml's ranges, and the environment the suite runs in holds exactly its versions."""

import sys
import tomllib
from importlib import metadata

from conftest import REPO
from packaging.requirements import Requirement

sys.path.insert(0, str(REPO / "scripts"))
from lockfile import changed_pins, freeze_matches, lift_upper_bounds, normalize, read_pins  # noqa: E402

LOCK = read_pins((REPO / "constraints.txt").read_text())


def _project_requirements() -> list[Requirement]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    texts = project["dependencies"] + extras["xla"] + extras["test"]
    return [Requirement(t) for t in texts if not t.startswith("neurontrain")]


def test_every_direct_dependency_is_locked_within_its_range():
    for req in _project_requirements():
        name = normalize(req.name)
        assert name in LOCK, f"{req.name} is not in constraints.txt: run scripts/lock"
        assert req.specifier.contains(LOCK[name], prereleases=True), f"{req}: locked at {LOCK[name]}"


def test_this_environment_holds_the_locked_versions():
    # the version import finds first on sys.path (vendored copies elsewhere, setuptools' own, do not count)
    names = {normalize(d.metadata["Name"]) for d in metadata.distributions()}
    installed = {name: metadata.version(name) for name in names}
    assert freeze_matches(LOCK, installed) == []
    assert {"torch", "torch-xla", "transformers", "kernels"} <= set(LOCK)  # transitive packages are pinned too


def test_read_pins_and_compare():
    text = "# header\nFoo_Bar==1.2 ; sys_platform == 'linux'\n    # via x\nbaz[extra]==3.0\n"
    pins = read_pins(text + "qux==2 ; python_version<'3.12'\nqux==3 ; python_version>='3.12'\n")
    assert pins == {"foo-bar": "1.2", "baz": "3.0", "qux": "2"}
    assert changed_pins(pins, {"foo-bar": "1.3", "baz": "3.0", "new": "1"}) == [
        ("foo-bar", "1.2", "1.3"),
        ("new", None, "1"),
        ("qux", "2", None),
    ]
    assert freeze_matches({"a": "1", "b": "2"}, {"a": "1", "b": "3", "c": "9"}) == ["b: locked 2, installed 3"]


def test_lift_upper_bounds_keeps_lower_bounds_markers_and_the_kept():
    lifted = lift_upper_bounds(
        ["transformers>=5.0,<=5.25.0", "torch>=2.9.0,<2.10", "ray[data]==2.60.0", "x<2; python_version<'3.12'"],
        keep=["torch"],
    )
    assert [str(Requirement(t).specifier) for t in lifted] == [">=5.0", "<2.10,>=2.9.0", "", ""]
    assert Requirement(lifted[2]).extras == {"data"} and Requirement(lifted[3]).marker is not None
