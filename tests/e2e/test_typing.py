"""The package's types, as users' type checkers see them: the lazy public names have real types
(``__init__``'s TYPE_CHECKING block matches its ``_EXPORTS`` table), and a user's script against
the public API passes ``mypy --strict`` (``tests/typing/check_api.py``)."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

import ckptfix

REPO = Path(__file__).resolve().parents[2]
INIT = REPO / "ckptfix" / "__init__.py"

#: static checks (ast, importlib, mypy: no checkpoint is read): CI runs them in one pass (pyproject)
pytestmark = pytest.mark.engine_independent


def _exports_table(tree: ast.Module) -> dict[str, str]:
    for node in tree.body:
        if isinstance(node, ast.Assign) and [t.id for t in node.targets if isinstance(t, ast.Name)] == ["_EXPORTS"]:
            table = ast.literal_eval(node.value)
            assert isinstance(table, dict)
            return table
    raise AssertionError("no _EXPORTS table in ckptfix/__init__.py")


def _type_checking_imports(tree: ast.Module) -> dict[str, str]:
    """name -> module (relative to the package) of every import under ``if TYPE_CHECKING:``."""
    found: dict[str, str] = {}
    blocks = [n for n in tree.body if isinstance(n, ast.If) and ast.unparse(n.test) == "TYPE_CHECKING"]
    assert len(blocks) == 1, "expected one `if TYPE_CHECKING:` block in ckptfix/__init__.py"
    for node in blocks[0].body:
        assert isinstance(node, ast.ImportFrom) and node.level == 1 and node.module, ast.unparse(node)
        for alias in node.names:
            assert alias.asname is None, f"{alias.name} is imported under another name"
            assert alias.name not in found, f"{alias.name} is imported twice"
            found[alias.name] = node.module
    return found


def test_type_checking_imports_name_what_exports_name() -> None:
    tree = ast.parse(INIT.read_text())
    exports, imports = _exports_table(tree), _type_checking_imports(tree)
    assert imports == exports
    assert set(ckptfix.__all__) == set(exports) | {"__version__"}


def test_every_exported_name_resolves() -> None:
    for name, module in ckptfix._EXPORTS.items():
        value = getattr(ckptfix, name)
        assert value is getattr(importlib.import_module(f"ckptfix.{module}"), name)
        assert getattr(value, "__module__", None) == f"ckptfix.{module}", name  # defined there, not re-exported
    with pytest.raises(AttributeError):
        ckptfix.no_such_name  # noqa: B018


def test_py_typed_ships_with_the_package() -> None:
    assert (REPO / "ckptfix" / "py.typed").is_file()
    try:
        import tomllib
    except ImportError:  # Python 3.10
        pytest.skip("tomllib needs Python 3.11")
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert "py.typed" in project["tool"]["setuptools"]["package-data"]["ckptfix"]


def test_the_public_api_type_checks() -> None:
    """``mypy --strict`` on a user's script: the public functions' parameter and return types
    as documented, and the calls they must refuse refused. Runs from the repository root, so
    mypy reads this checkout's ``ckptfix`` and its ``[tool.mypy]`` settings."""
    if importlib.util.find_spec("mypy") is None:
        pytest.skip("mypy is not installed (it is in the test extra: pip install -e '.[test]')")
    proc = subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "tests/typing/check_api.py"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.startswith("Success: no issues found"), proc.stdout
