"""The docs site builds with `mkdocs build --strict` (a broken link, anchor or nav entry fails it), every page in
docs/ is in its nav, and the README's links into docs/ lead to pages that exist."""

import re

import pytest
from conftest import REPO

mkdocs_config = pytest.importorskip("mkdocs.config", reason="mkdocs-material is in the test extra")


def _build(tmp_path, docs_dir=None):
    from mkdocs.commands.build import build

    options = {"site_dir": str(tmp_path / "site"), "strict": True}
    if docs_dir is not None:
        options["docs_dir"] = str(docs_dir)
    config = mkdocs_config.load_config(str(REPO / "mkdocs.yml"), **options)
    build(config)
    return tmp_path / "site"


def test_the_site_builds_strict_with_every_page(tmp_path):
    site = _build(tmp_path)
    for page in sorted((REPO / "docs").glob("*.md")):
        html = site / ("index.html" if page.stem == "index" else f"{page.stem}/index.html")
        assert html.is_file(), f"docs/{page.name} was not built into the site"


def test_a_broken_link_fails_the_strict_build(tmp_path):
    from mkdocs.exceptions import Abort

    docs = tmp_path / "docs"
    docs.mkdir()
    for page in (REPO / "docs").glob("*.md"):
        (docs / page.name).write_text(page.read_text())
    (docs / "report.md").write_text((docs / "report.md").read_text() + "\n[gone](no-such-page.md)\n")
    with pytest.raises(Abort):
        _build(tmp_path, docs)


def test_the_readme_links_into_docs_lead_to_pages_that_exist():
    readme = (REPO / "README.md").read_text()
    targets = re.findall(r"\]\((docs/[^)#]*)", readme)
    assert len(targets) > 10
    missing = [t for t in targets if not (REPO / t).exists()]
    assert not missing, f"README links to missing docs: {missing}"
    assert len(readme.splitlines()) <= 250, "the README is a front page: 250 lines at most"


# Every section the README had before its manuals moved into docs/ (the move kept each one whole; a one-off check
# found every line of the old README in README.md or docs/, bar rewritten links)
SECTIONS = [
    "Two commands on a fresh machine",
    "Commands",
    "Backends",
    "The native backend (`--backend native`)",
    "Recipes",
    "Model families",
    "Memory planning",
    "Memory scaling benchmark",
    "How the loop avoids recompilation",
    "Sequence packing (`data.packing`)",
    "Precompile and the compile cache",
    "Checkpoint migration",
    "Health checks and preflight",
    "Scale out: data parallel, elastic restart, SLURM, SageMaker",
    "Activation checkpointing and tensor parallel",
    "Lightning users",
    "Heterogeneous clusters: CPU data nodes feed the Trainium workers (Ray)",
    "Outputs",
    "Measured here",
    "Native vs XLA:CPU",
    "Known issues",
    "Not done yet",
]


def test_no_section_of_the_documentation_is_lost():
    pages = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    headings = {re.sub(r"^#+\s+", "", line) for page in pages for line in page.read_text().splitlines()}
    missing = [s for s in SECTIONS if s not in headings]
    assert not missing, f"sections no page holds: {missing}"
