"""Can the output be written? Asked before any work, so a long tune never ends on a path
it cannot write.

    >>> import tempfile, pathlib
    >>> folder = pathlib.Path(tempfile.mkdtemp())
    >>> check_output(folder / "runs" / "tuned.yaml", suffixes=(".yaml", ".json")).name
    'tuned.yaml'
    >>> check_output(folder, suffixes=(".yaml",))  # doctest: +IGNORE_EXCEPTION_DETAIL
    Traceback (most recent call last):
    autofit.errors.BadInputError: ... is a folder

Missing folders on the way are fine (the writer creates them, as before), as long as
the nearest existing one is a folder this process may create files in. Whether it
may is asked of the file system itself: a probe file created and removed at once
(``os.access`` says yes to root on a read-only folder and cannot see a read-only
mount's every rule). An existing file is opened for appending, which changes
nothing. A link to no file yet is checked where it points: the write creates that file,
but not its folders. Nothing is left behind.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterable
from pathlib import Path

from autofit.errors import BadInputError

__all__ = ["check_output"]


def _nearest_existing(p: Path) -> Path:
    a = p.parent
    while not a.exists() and a != a.parent:
        a = a.parent
    return a


def _why_not(target: Path) -> str | None:
    """Why ``target`` cannot be written (None when it can)."""
    if target.is_dir():
        return f"{target} is a folder"
    if target.is_symlink() and not target.exists():  # a write creates the link's target
        dest = Path(os.path.realpath(target))
        if not dest.parent.is_dir():
            return (f"{target} is a link to {os.readlink(target)}, whose folder does not exist "
                    "(a link's folders are never created)")
        return _why_not(dest) if dest != target else f"{target} is a link that loops"
    if target.exists():
        if not target.is_file():
            return f"{target} is not a regular file"
        try:
            with open(target, "ab"):
                pass
        except OSError as e:
            return f"{target} cannot be written ({e.strerror or e})"
        return None
    folder = _nearest_existing(target)
    if not folder.is_dir():
        return f"{folder} is a file, not a folder"
    try:
        fd, probe = tempfile.mkstemp(prefix=".autofit-probe-", dir=folder)
    except OSError as e:
        return f"no file can be created in {folder} ({e.strerror or e})"
    os.close(fd)
    os.unlink(probe)
    return None


def check_output(path: str | Path, *, suffixes: Iterable[str] | None = None,
                 writes: Iterable[Path] | None = None, name: str = "",
                 fix: str = "choose another path") -> Path:
    """Raise ``BadInputError`` (one line) unless ``path`` can be written; return it as a Path.

    Args:
        path: the output the caller named.
        suffixes: the file name endings allowed (``None``: any).
        writes: the files actually written for ``path`` (default: ``path`` itself), e.g. a
            report's ``.png`` and ``.html`` beside it.
        name: how the caller named the path (``"-o"``, ``"path"``), for the message.
        fix: what the message tells the caller to do when a file cannot be written.
    """
    p = Path(path)
    label = f"{name} {p}" if name else str(p)
    allowed = tuple(s.lower() for s in suffixes) if suffixes is not None else None
    if p.is_dir():
        example = p / ("tuned" + allowed[0] if allowed else "report.html")
        raise BadInputError(f"{label} is a folder: give a file name, e.g. {example}")
    if allowed is not None and not p.name.lower().endswith(allowed):
        named = " or ".join(s for s in allowed if s != ".yml")  # .yml: .yaml's other spelling
        raise BadInputError(f"{label}: use a {named} file name")
    for target in (writes if writes is not None else [p]):
        why = _why_not(Path(target))
        if why is not None:
            raise BadInputError(f"cannot write {label}: {why}; {fix}")
    return p
