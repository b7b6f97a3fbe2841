"""The package's shape, checked: imports point down the layers, no import cycles, click only in
the CLI, torch only inside functions.

Read with ``ast.walk``, so an import inside a function counts like one at the top (that is how
the old ``sources`` <-> ``ziparchive`` cycle hid). The layers, bottom first, and what each owns,
are in docs/architecture.md ("Architecture").
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest
from conftest import ROOT, parsed

#: the package's source, read with ast: CI runs these in one pass (pyproject's engine_independent)
pytestmark = pytest.mark.engine_independent

PACKAGE = ROOT / "ckptfix"

#: bottom first: a module may import from its own layer or any layer before it in this list
LAYERS = [
    "errors",
    "native",
    "fileio",
    "model",
    "pickling",
    "formats",
    "transforms",
    "analysis",
    "pipeline",
    "batch",
    "api",
    "cli",
    "__main__",
]


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path, me: str | None = None) -> list[tuple[int, str]]:
    """(line, imported ckptfix module) for every import in the file, function-level ones too.
    ``from X import name`` counts as importing ``X.name`` when that is a module. ``me``: the
    file's module name, when it is not under the package (the self-test's probe)."""
    me = me or _module_name(path)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    found = []
    for node in ast.walk(parsed(path)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if a.name.split(".")[0] == "ckptfix"]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "ckptfix":
                continue
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                is_module = (PACKAGE.parent / sub.replace(".", "/")).with_suffix(".py").exists() or (
                    PACKAGE.parent / sub.replace(".", "/") / "__init__.py"
                ).exists()
                found.append((node.lineno, sub if is_module else target))
    return found


def _layer(module: str) -> int | None:
    """Index in LAYERS of a ckptfix module; None for the package root (``__version__`` and the
    lazy public names, which import nothing when the package is imported)."""
    parts = module.split(".")
    if len(parts) == 1:
        return None
    return LAYERS.index(parts[1])


@functools.cache
def _graph() -> dict[str, list[tuple[int, str]]]:
    """Module -> its imports (built once: three tests read it; none changes it)."""
    return {_module_name(p): _imports(p) for p in sorted(PACKAGE.rglob("*.py"))}


def test_every_module_has_a_layer() -> None:
    unplaced = [m for m in _graph() if "." in m and m.split(".")[1] not in LAYERS]
    assert not unplaced, f"modules outside the layer list (add their package to LAYERS): {unplaced}"


def _upward(graph: dict[str, list[tuple[int, str]]]) -> list[str]:
    upward = []
    for module, imports in graph.items():
        mine = _layer(module)
        for line, target in imports:
            theirs = _layer(target)
            if mine is not None and theirs is not None and theirs > mine:
                upward.append(f"{module}:{line} imports {target} ({LAYERS[mine]} -> {LAYERS[theirs]})")
    return upward


def test_imports_only_point_down() -> None:
    upward = _upward(_graph())
    assert not upward, "imports that point up the layers:\n" + "\n".join(upward)


def test_no_import_cycles() -> None:
    modules = _graph_modules()
    graph = {m: sorted({t for _, t in imports if t in modules}) for m, imports in _graph().items()}
    # iterative DFS with colours: grey on the stack, black done
    colour: dict[str, int] = {}
    for start in graph:
        if colour.get(start):
            continue
        stack = [(start, iter(graph[start]))]
        colour[start] = 1
        path = [start]
        while stack:
            node, children = stack[-1]
            for child in children:
                if child == node:
                    continue
                if colour.get(child) == 1:
                    cycle = path[path.index(child) :] + [child]
                    pytest.fail("import cycle: " + " -> ".join(cycle))
                if not colour.get(child):
                    colour[child] = 1
                    path.append(child)
                    stack.append((child, iter(graph[child])))
                    break
            else:
                colour[node] = 2
                stack.pop()
                path.pop()


def _graph_modules() -> set[str]:
    return {_module_name(p) for p in PACKAGE.rglob("*.py")} - {"ckptfix"}


def _top_level_names(node: ast.AST) -> list[str]:
    """The absolute module names an import statement names (relative imports name ckptfix's own)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if isinstance(node, ast.ImportFrom) and not node.level:
        return [node.module or ""]
    return []


def test_only_the_cli_knows_click() -> None:
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if _module_name(path).startswith("ckptfix.cli"):
            continue
        for node in ast.walk(parsed(path)):
            names = _top_level_names(node)
            offenders += [f"{path.relative_to(PACKAGE)}:{node.lineno}" for n in names if n.split(".")[0] == "click"]
    assert not offenders, f"click imported below the CLI: {offenders}"


def test_torch_is_imported_only_inside_functions() -> None:
    """``ckptfix inspect`` and the byte-moving commands never import torch: no module does at
    import time (the e2e test that runs them checks ``sys.modules`` too)."""
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in parsed(path).body:
            names = _top_level_names(node)
            offenders += [f"{path.relative_to(PACKAGE)}:{node.lineno}" for n in names if n.split(".")[0] == "torch"]
    assert not offenders, f"torch imported at module level: {offenders}"


def test_the_layer_test_sees_function_level_imports(tmp_path: Path) -> None:
    """The check itself: an import inside a function is found, with its line, and reported."""
    probe = tmp_path / "probe.py"
    probe.write_text("def f():\n    from ..pipeline import convert\n    return convert\n")
    imports = _imports(probe, "ckptfix.fileio.probe")
    assert imports == [(2, "ckptfix.pipeline")]
    assert _upward({"ckptfix.fileio.probe": imports}) == [
        "ckptfix.fileio.probe:2 imports ckptfix.pipeline (fileio -> pipeline)"
    ]
