"""Shared by the bad-input tests: recipes with one value changed, and the check of a one-line usage error."""

import copy

import yaml
from conftest import RECIPES

BASE = yaml.safe_load((RECIPES / "tiny-bert-classification.yaml").read_text())
DELETE = object()


def mutate(path: str, value) -> str:
    """The tiny BERT recipe as YAML with the value at the dotted `path` replaced (DELETE: removed)."""
    recipe = copy.deepcopy(BASE)
    node = recipe
    keys = path.split(".")
    for key in keys[:-1]:
        node = node.setdefault(key, {})
    if value is DELETE:
        del node[keys[-1]]
    else:
        node[keys[-1]] = value
    return yaml.safe_dump(recipe)


def assert_one_line_usage_error(result, expected: str) -> None:
    """Exit 2 and exactly one `neurontrain: error:` line on stderr holding `expected`, no traceback."""
    assert result.returncode == 2, (result.returncode, result.stderr[-2000:])
    lines = [line for line in result.stderr.splitlines() if line.strip() and "Warning" not in line]
    assert len(lines) == 1, result.stderr
    assert "Traceback" not in result.stderr
    assert lines[0].startswith("neurontrain: error:")
    assert expected in lines[0], lines[0]
