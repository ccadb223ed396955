"""The package's shape, checked from its source: import layering without cycles, file and function sizes."""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "neurontrain"
MAX_FILE_LINES = 400
MAX_FUNCTION_LINES = 60


def _modules() -> dict[str, ast.Module]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = ast.parse(path.read_text(), filename=str(path))
    return out


def _imported(node: ast.Import | ast.ImportFrom, module: str) -> list[str]:
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if node.level:  # relative import: resolve against the importing module's package
        base = module.split(".")[: -node.level] if not module.endswith("__init__") else module.split(".")
        return [".".join(base + ([node.module] if node.module else []))]
    return [node.module or ""]


def _module_level_edges(modules: dict[str, ast.Module]) -> dict[str, set[str]]:
    """module -> project modules it imports at module level (`from pkg import mod` counts as pkg.mod)."""
    edges: dict[str, set[str]] = defaultdict(set)
    for name, tree in modules.items():
        for node in tree.body:
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            for target in _imported(node, name):
                if not target.startswith("neurontrain"):
                    continue
                names = [f"{target}.{a.name}" for a in node.names] if isinstance(node, ast.ImportFrom) else []
                edges[name].update(n for n in names if n in modules)
                if not any(n in modules for n in names) and target in modules:
                    edges[name].add(target)
    return edges


def _unit(module: str) -> str:
    """The folder a module belongs to (neurontrain.loop.trainer -> loop); a top-level module is its own unit."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_module_level_imports_form_no_cycle_between_folders_or_modules():
    edges = _module_level_edges(_modules())
    assert _cycle(edges) is None, f"import cycle between modules: {' -> '.join(_cycle(edges))}"
    folders: dict[str, set[str]] = defaultdict(set)
    for src, targets in edges.items():
        folders[_unit(src)].update(_unit(t) for t in targets if _unit(t) != _unit(src))
    assert _cycle(folders) is None, f"import cycle between folders: {' -> '.join(_cycle(folders))}"


def test_no_function_level_import_of_the_package_itself():
    """Project modules are imported at module level; only optional heavy third-party dependencies stay lazy."""
    found = []
    for name, tree in _modules().items():
        top = {id(n) for n in tree.body}
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)) and id(node) not in top:
                if any(t.startswith("neurontrain") for t in _imported(node, name)):
                    found.append(f"{name}:{node.lineno}")
    assert not found, f"function-level imports of neurontrain modules: {found}"


def test_files_and_functions_stay_small():
    too_long = []
    for path in sorted(PACKAGE.rglob("*.py")):
        text = path.read_text()
        if len(text.splitlines()) > MAX_FILE_LINES:
            too_long.append(f"{path.name}: {len(text.splitlines())} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    too_long.append(f"{path.relative_to(PACKAGE)}:{node.lineno} {node.name}: {length} lines")
    assert not too_long, "over the size limits: " + "; ".join(too_long)


def test_the_checks_catch_what_they_check():
    """The cycle finder finds a planted cycle (so a pass above is not vacuous)."""
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None
    assert _unit("neurontrain.loop.trainer") == "loop" and _unit("neurontrain.errors") == "errors"
    edges = _module_level_edges(_modules())
    assert "neurontrain.errors" in edges["neurontrain.compile.store"]


def test_test_modules_have_unique_basenames():
    """pytest imports tests/unit and tests/integration as one flat namespace (no __init__.py): two test files of
    the same name stop collection of the whole suite."""
    tests = PACKAGE.parent / "tests"
    names = [p.name for p in tests.rglob("test_*.py")]
    assert sorted({n for n in names if names.count(n) > 1}) == []


ARCHITECTURE = PACKAGE.parent / "docs" / "architecture.md"


def _layer_rows() -> list[tuple[list[str], str]]:
    """docs/architecture.md's layer table, top row first: (the units a row names, the row's description)."""
    rows = []
    for line in ARCHITECTURE.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")] if line.startswith("| `") else []
        if len(cells) == 2:
            units = [name.rstrip("/").removesuffix(".py") for name in re.findall(r"`([^`]+)`", cells[0])]
            rows.append((units, cells[1]))
    return rows


def _layers() -> dict[str, int]:
    return {unit: i for i, (units, _) in enumerate(_layer_rows()) for unit in units}


def _units() -> set[str]:
    """The package's folders and top-level modules (its `__init__.py` excepted)."""
    return {_unit(name) for name in _modules() if name != "neurontrain"}


def test_no_layer_imports_a_layer_below_it():
    """A module imports modules of its own row of docs/architecture.md or of a row above it, never below."""
    layers = _layers()
    found = []
    for src, targets in _module_level_edges(_modules()).items():
        for target in targets:
            if target != "neurontrain" and layers[_unit(target)] > layers[_unit(src)]:
                found.append(f"{src} -> {target}")
    assert not found, f"imports of a lower layer of docs/architecture.md: {found}"


def test_the_architecture_page_has_a_row_for_every_folder_and_module():
    assert sorted(_units() - set(_layers())) == []
    assert sorted(set(_layers()) - _units()) == [], "rows for folders or modules that do not exist"


def test_every_file_the_architecture_page_names_exists():
    """A file a row names lies in that row's folder (or a folder below it); a path is relative to the package
    or the repository."""
    missing = []
    text = ARCHITECTURE.read_text()
    rows = _layer_rows()
    for units, description in rows:
        folder = PACKAGE / units[0] if (PACKAGE / units[0]).is_dir() else PACKAGE
        for name in re.findall(r"`([\w/]+\.py)", description):
            if "/" not in name and not any(p.parent.is_relative_to(folder) for p in PACKAGE.rglob(name)):
                missing.append(f"{units[0]}: {name}")
    for path in re.findall(r"`([\w]+/[\w/]+\.py)", text):
        if not (PACKAGE / path).is_file() and not (PACKAGE.parent / path).is_file():
            missing.append(path)
    assert not missing, f"docs/architecture.md names files that do not exist: {missing}"


def test_the_layer_checks_catch_what_they_check():
    """The parser finds the rows (so the passes above are not vacuous)."""
    layers = _layers()
    assert layers["errors"] == 0 and layers["backends"] < layers["plan"] < layers["loop"] < layers["cli"]
