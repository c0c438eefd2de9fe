"""Output paths checked before long work: a file where a folder must be."""

from __future__ import annotations

from pathlib import Path


def file_in_the_way(path: str | Path) -> Path | None:
    """The nearest existing ancestor of `path` when it is not a directory (so
    neither `path` nor its missing parent folders can be created), else None.
    mkdir would fail on it only later, with a bare "[Errno 17] File exists"
    or "[Errno 20] Not a directory"."""
    for ancestor in Path(path).absolute().parents:
        if ancestor.exists():
            return None if ancestor.is_dir() else ancestor
    return None
