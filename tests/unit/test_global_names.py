"""Global names and --allow-global patterns, checked by the library (the command line's handling
of them: tests/cli/test_cli_safety.py)."""

from __future__ import annotations

from typing import Any

import pytest

from ckptfix.errors import UsageError
from ckptfix.pickling.names import (
    check_global_patterns,
    global_pattern_problem,
    is_dotted_identifier,
    is_global_pattern,
)


@pytest.mark.parametrize(
    "name",
    [
        "os",
        "os.path",
        "torch._utils._rebuild_tensor_v2",
        "collections.OrderedDict",
        "Outer.Inner",
        "_codecs",
        "numpy.core.multiarray.scalar",
        "a1.b2",
        "class",
    ],
)
def test_dotted_identifiers_accepted(name: str) -> None:
    assert is_dotted_identifier(name)


@pytest.mark.parametrize(
    "name",
    [
        "",
        ".",
        "a.",
        ".a",
        "a..b",
        "a b",
        "a\nb",
        "os.system\nGLOBAL",
        "a\x00",
        "a\tb",
        "1a",
        "a.1b",
        "a-b",
        "a/b",
        "é",
        "numpy.*",
        "a\rb",
        "\x1b[31m",
        "torch.\u200bTensor",
        None,
        b"os.path",
    ],
)
def test_non_identifiers_refused(name: Any) -> None:
    assert not is_dotted_identifier(name)


@pytest.mark.parametrize(
    "pattern",
    [
        "numpy.*",
        "argparse.Namespace",
        "*",
        "*.*",
        "pathlib.*Path",
        "mod.Conf[AB]",
        "mod.v?",
        "a.b[!c-d]e",
        "_private.x",
    ],
)
def test_glob_patterns_accepted(pattern: str) -> None:
    assert is_global_pattern(pattern) and global_pattern_problem(pattern) is None
    check_global_patterns([pattern])


@pytest.mark.parametrize(
    "pattern",
    [
        "",
        "os.system\nGLOBAL",
        "numpy.*\n",
        "a b",
        "a\x00b",
        "\x00",
        ".a",
        "a.",
        "a..b",
        ".",
        "*.",
        "1abc",
        "é.x",
        "a.[.]",
        "x[]",
        "x[",
        "x]",
        "a/b",
        "a\tb",
        "a;b",
        "os.system\x1b[2K",
    ],
)
def test_bad_glob_patterns_refused(pattern: str) -> None:
    assert not is_global_pattern(pattern)
    with pytest.raises(UsageError) as info:
        check_global_patterns(["numpy.*", pattern])
    message = str(info.value)
    assert "\n" not in message and repr(pattern) in message


def test_the_writer_checks_the_name_it_writes_not_its_cache() -> None:
    """``Global.full`` caches ``module.name``; a record changed behind the frozen dataclass's
    back (``object.__setattr__``) kept a dotted ``full`` while its module held newlines -- opcodes
    the writer then wrote (``posix.system('id')``). The check now covers what is written."""
    from ckptfix.errors import BadInputError
    from ckptfix.model.refs import Global
    from ckptfix.pickling import writer

    tampered = Global("torch", "float32")
    object.__setattr__(tampered, "module", "posix\nsystem\n(X\x02\x00\x00\x00idtR0ctorch")
    for dumps in (writer.dumps, writer.dumps_python):
        with pytest.raises(BadInputError, match="not a Python name"):
            dumps({"x": tampered})
