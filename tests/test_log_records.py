"""No tfscale log record keeps an exception object (static: `ast`, no TensorFlow import).

A `LogRecord` lives as long as its handlers keep it: pytest's log capture keeps every record
of a test, and so does a `logging.handlers.MemoryHandler` or a user's list handler. A record
whose args hold an exception holds its traceback, the traceback every frame it passed,
and a frame of a refused `model.fit` its epoch iterator with tf.data's threads. In
tests/test_hostile_backup.py, 50 fits refused by a tampered backup kept 547 threads and 49
live distributed iterators this way (`"... (%s)", e` in `_backup_store.load_newest`), and a
later test in the same worker stalled past its 240 s limit (CI of stop 40). Log the
message (`str(e)`), never the exception; no `exc_info` either.
"""

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent / "tfscale"
_LOG_METHODS = {"debug", "info", "warning", "warn", "error", "exception", "critical", "log"}


def _kept_exceptions(source, filename="<source>"):
    """`file:line: ...` for each logging call that would keep an exception in its record."""
    found = []
    tree = ast.parse(source, filename)
    for handler in ast.walk(tree):
        if not isinstance(handler, ast.ExceptHandler):
            continue
        for node in ast.walk(handler):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
                continue
            if node.func.attr not in _LOG_METHODS:
                continue
            names = [a.id for a in node.args[1:] if isinstance(a, ast.Name)]
            if handler.name and handler.name in names:
                found.append(f"{filename}:{node.lineno}: the exception `{handler.name}` is a log argument")
            if node.func.attr == "exception":
                found.append(f"{filename}:{node.lineno}: `.exception()` keeps exc_info")
    for node in ast.walk(tree):
        if isinstance(node, ast.keyword) and node.arg in ("exc_info", "stack_info"):
            found.append(f"{filename}:{node.value.lineno}: `{node.arg}=` keeps frames")
    return found


def test_no_tfscale_log_record_keeps_an_exception():
    found = []
    for path in sorted(ROOT.rglob("*.py")):
        found += _kept_exceptions(path.read_text(), str(path.relative_to(ROOT.parent)))
    assert found == []


@pytest.mark.parametrize(
    "source, expected",
    [
        ("try:\n    f()\nexcept OSError as e:\n    _log.warning('x %s', e)\n", "`e` is a log argument"),
        ("try:\n    f()\nexcept OSError as err:\n    log.info('%s %s', p, err)\n", "`err` is a log argument"),
        ("try:\n    f()\nexcept OSError:\n    _log.exception('x')\n", ".exception()"),
        ("_log.warning('x', exc_info=True)\n", "exc_info="),
    ],
)
def test_checker_names_the_kept_exception(source, expected):
    assert any(expected in line for line in _kept_exceptions(source))


def test_checker_passes_the_message_alone():
    assert _kept_exceptions("try:\n    f()\nexcept OSError as e:\n    _log.warning('x %s', str(e))\n") == []
