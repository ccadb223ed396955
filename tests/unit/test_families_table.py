"""The README's table of model families is the one tests/families.py makes from the per-family tests' own
parameter list (regenerate it with `python tests/families.py`)."""

import re

from conftest import REPO
from families import readme_table


def test_the_readme_table_of_families_is_generated_from_the_tests_parameter_list():
    readme = (REPO / "README.md").read_text()
    block = re.search(r"<!-- families table -->\n(.*?)\n<!-- end families table -->", readme, re.S)
    assert block is not None, "README lacks the families table markers"
    assert block.group(1) == readme_table(), "README's families table is stale: run python tests/families.py"
