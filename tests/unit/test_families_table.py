"""The table of model families, on the README and on the docs' Model families page, is the one tests/families.py
makes from the per-family tests' own parameter list (regenerate it with `python tests/families.py`)."""

import re

import pytest
from conftest import REPO
from families import readme_table


@pytest.mark.parametrize("page", ["README.md", "docs/model-families.md"])
def test_the_table_of_families_is_generated_from_the_tests_parameter_list(page):
    text = (REPO / page).read_text()
    block = re.search(r"<!-- families table -->\n(.*?)\n<!-- end families table -->", text, re.S)
    assert block is not None, f"{page} lacks the families table markers"
    assert block.group(1) == readme_table(), f"{page}'s families table is stale: run python tests/families.py"
