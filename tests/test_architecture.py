"""The layout rules of ARCHITECTURE.md, checked on the source tree (no imports run).

* Imports point one way: no cycle among the project's modules (imports inside functions
  count), ``kvstore`` imports nothing of the engine plugin, the entrypoint, the LBs or the
  tools, ``lb`` imports only itself, and nothing outside ``kvstore/server`` and
  ``kvstore/cli`` imports those two.
* Composition, not mixins: no class has two or more of the project's own classes as bases.
* Comments that age well: no review tags, history or issue numbers in the packages, tools and tests.
* ``tools/`` and the tests import modules by package, never through ``sys.path`` edits.
* The README stays a quickstart.
"""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("kvstore", "entrypoint", "lb", "engine_plugin", "tools")
GENERATED = re.compile(r"_pb2(_grpc)?\.py$")


def _modules() -> dict[str, Path]:
    mods = {}
    for pkg in PACKAGES:
        for f in sorted((ROOT / pkg).rglob("*.py")):
            if GENERATED.search(f.name):
                continue
            parts = list(f.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            mods[".".join(parts)] = f
    return mods


MODULES = _modules()


def _imported(name: str, node: ast.Import | ast.ImportFrom, is_pkg: bool) -> list[str]:
    """The project modules one import statement names (the nearest enclosing module of each)."""
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        base = node.module or ""
        if node.level:
            pkg = name.split(".")
            if not is_pkg:
                pkg = pkg[:-1]
            pkg = pkg[: len(pkg) - (node.level - 1)]
            base = ".".join(pkg + ([base] if base else []))
        names = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
    found = []
    for n in names:
        while n and n not in MODULES:
            n = n.rpartition(".")[0]
        if n:
            found.append(n)
    return found


def _import_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = defaultdict(set)
    for name, path in MODULES.items():
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for target in _imported(name, node, path.name == "__init__.py"):
                    # A package's own submodules importing it (or it them) is not a cycle
                    # between modules with separate jobs: skip parent links.
                    if target != name and not name.startswith(target + "."):
                        graph[name].add(target)
    return graph


GRAPH = _import_graph()


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    counter = 0
    for root in sorted(MODULES):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.get(root, ()))))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                comp = []
                while True:
                    top = stack.pop()
                    on_stack.discard(top)
                    comp.append(top)
                    if top == node:
                        break
                if len(comp) > 1:
                    found.append(sorted(comp))
    return found


def test_no_import_cycles():
    assert _cycles(GRAPH) == []


def _in(name: str, pkg: str) -> bool:
    return name == pkg or name.startswith(pkg + ".")


def test_imports_point_one_way():
    wrong = []
    for src, targets in GRAPH.items():
        for dst in targets:
            if _in(src, "kvstore") and not _in(dst, "kvstore"):
                wrong.append(f"{src} -> {dst} (kvstore imports only itself)")
            if _in(src, "lb") and not _in(dst, "lb"):
                wrong.append(f"{src} -> {dst} (lb imports only itself)")
            inner = _in(src, "kvstore.server") or _in(src, "kvstore.cli")
            if (_in(dst, "kvstore.server") or _in(dst, "kvstore.cli")) and not inner:
                wrong.append(f"{src} -> {dst} (only kvstore.server and kvstore.cli import those)")
            if _in(src, "engine_plugin") and (_in(dst, "entrypoint") or _in(dst, "lb") or _in(dst, "tools")):
                wrong.append(f"{src} -> {dst} (the plugin imports only kvstore and itself)")
            if not _in(src, "tools") and _in(dst, "tools"):
                wrong.append(f"{src} -> {dst} (nothing in the packages imports the tools)")
    assert sorted(wrong) == []


def _project_classes() -> dict[str, set[str]]:
    """Class name -> the modules defining it (names are matched by their last part)."""
    classes: dict[str, set[str]] = defaultdict(set)
    for name, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                classes[node.name].add(name)
    return classes


def test_no_class_is_assembled_from_several_project_classes():
    classes = _project_classes()
    errors = {"KVStoreError", "LBError", "LBInputError"}  # exception families: a kind and a builtin
    assembled = []
    for name, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ClassDef):
                continue
            own = []
            for base in node.bases:
                last = base.attr if isinstance(base, ast.Attribute) else getattr(base, "id", None)
                if last in classes and last not in errors:
                    own.append(last)
            if len(own) >= 2:
                assembled.append(f"{name}.{node.name}({', '.join(own)})")
    assert assembled == []


DIARY = re.compile(
    r"\((QA|review)\b|\bQA:|\bit used to\b|\bused to (be|return|raise|live|take)\b"
    r"|\b[Ii]ssue #?\d+|\(#\d+\)|\bolder daemons?\b|\bTODO\b|\bFIXME\b|\bXXX\b"
)


def test_no_diary_lines_in_code():
    tests = [f for f in sorted((ROOT / "tests").rglob("*.py")) if f != Path(__file__).resolve()]
    found = []
    for path in [*MODULES.values(), *tests]:
        for no, line in enumerate(path.read_text().splitlines(), 1):
            if DIARY.search(line):
                found.append(f"{path.relative_to(ROOT)}:{no}: {line.strip()}")
    assert found == []


@pytest.mark.parametrize("folder", ["tools", "tests"])
def test_no_sys_path_edits(folder):
    edits = []
    for f in sorted((ROOT / folder).rglob("*.py")):
        if f == Path(__file__).resolve():
            continue
        for no, line in enumerate(f.read_text().splitlines(), 1):
            if "sys.path.insert" in line or "sys.path.append" in line:
                edits.append(f"{f.relative_to(ROOT)}:{no}")
    assert edits == []


def test_readme_is_a_quickstart():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 200, f"README.md has {len(lines)} lines; reference detail goes under docs/"
