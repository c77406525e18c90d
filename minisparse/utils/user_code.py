"""Errors raised in a user's own code (a compression rule's score_batch, a reward
function), said in one line that names the user's file and line.

A traceback through the engine, torch and the grader is 60 lines of which the user wrote
one; the line that matters is the innermost frame of the user's own files, which is
whatever file is neither in minisparse nor in Python's or an installed package's.
"""
from __future__ import annotations

import sys
import sysconfig
import traceback
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1]  # minisparse/
# Python's own modules and installed packages (site-packages, dist-packages)
LIBRARIES = tuple(Path(p).resolve() for p in {sysconfig.get_paths()[k] for k in
                                             ("stdlib", "platstdlib", "purelib", "platlib")})


class UserCodeError(RuntimeError):
    """A user's rule or reward raised or returned what cannot be used: the message is one
    line naming it, the exception and, where known, the user's file:line."""


def _is_users(filename: str) -> bool:
    if filename.startswith("<"):  # <string>, <frozen ...>: no file of the user's
        return False
    path = Path(filename).resolve()
    if path.is_relative_to(PACKAGE) or any(path.is_relative_to(lib) for lib in LIBRARIES):
        return False
    return not {"site-packages", "dist-packages"} & set(path.parts)


def _short(filename: str) -> str:
    """A path under the working directory relative to it, others as they are."""
    path = Path(filename).resolve()
    try:
        return str(path.relative_to(Path.cwd().resolve()))
    except ValueError:
        return filename


def user_location(exc: BaseException) -> str | None:
    """'file:line' of the innermost frame of exc's traceback in the user's own files;
    None when every frame is minisparse's or a library's."""
    for frame in reversed(traceback.extract_tb(exc.__traceback__)):
        if _is_users(frame.filename):
            return f"{_short(frame.filename)}:{frame.lineno}"
    return None


def raised(exc: BaseException) -> str:
    """'ZeroDivisionError: division by zero (at my_rules.py:12)': the exception's type,
    the first line of its message and the user's line, for a one-line error."""
    lines = str(exc).strip().splitlines()
    text = f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__
    where = user_location(exc)
    return f"{text} (at {where})" if where else text


def print_error(exc: BaseException, prefix: str = "error", verbose: bool = False) -> None:
    """The one line on stderr; the whole traceback before it when `verbose`."""
    if verbose:
        traceback.print_exception(exc)
    print(f"{prefix}: {exc}", file=sys.stderr, flush=True)

