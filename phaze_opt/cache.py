"""Plumbing every cache shares: where the on-disk caches live, and a bounded in-memory memo.

`cache_root()` is `$PHAZE_OPT_CACHE`, else `.cache/phaze_opt` in the project folder (beside the
package) of a clone, else the user's cache folder; the workload graphs (`workload/graphs.py`) and the solved schedules
(`solve/schedule/cache.py`) each keep a folder under it.

`BoundedMemo` is a least-recently-used mapping for the in-process memos (layer graphs, schedule
records, per-layer costs and energies). A long study or sweep visits tens of thousands of designs;
an unbounded dict would keep every one of them. A memo only saves work that the disk caches below
it (or a re-computation) would give back identically, so its bound trades time, never results.
"""

from __future__ import annotations

import os
import tempfile
from collections import OrderedDict
from pathlib import Path
from typing import Generic, Hashable, TypeVar

_PROJECT = Path(__file__).resolve().parent.parent

V = TypeVar("V")


def cache_root() -> Path:
    """`$PHAZE_OPT_CACHE`, else `.cache/phaze_opt` in the project folder of a clone, else (an installed
    wheel, whose parent folder is site-packages) the user's cache folder, `$XDG_CACHE_HOME/phaze_opt`."""
    env = os.environ.get("PHAZE_OPT_CACHE")
    if env:
        return Path(env)
    if (_PROJECT / "pyproject.toml").is_file():
        return _PROJECT / ".cache" / "phaze_opt"
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "phaze_opt"


def write_atomic(path: Path, text: str) -> bool:
    """Write a cache file whole or not at all: written beside its place and renamed into it, so a
    concurrent reader or a kill never leaves half a file. False when the disk refused (read-only,
    full): a cache that cannot be written only costs the work again next time."""
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=path.suffix)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
        tmp = None
    except OSError:
        return False
    finally:
        if tmp is not None:  # a full disk (or an interrupt) left part of a file: never keep it
            try:
                os.unlink(tmp)
            except OSError:
                pass
    return True


class BoundedMemo(Generic[V]):
    """A dict-like memo that keeps the `maxsize` most recently used entries.

    Offers the dict operations the memos use (`get`, `[]`, `[]=`, `in`, `len`, `clear`), so a
    plain dict can stand in for it (tests swap in an empty one).
    """

    def __init__(self, maxsize: int):
        if maxsize < 1:
            raise ValueError(f"BoundedMemo: maxsize must be at least 1, got {maxsize}")
        self.maxsize = int(maxsize)
        self._data: OrderedDict = OrderedDict()

    def get(self, key: Hashable, default=None):
        try:
            value = self._data[key]
        except KeyError:
            return default
        self._data.move_to_end(key)
        return value

    def __getitem__(self, key: Hashable) -> V:
        value = self._data[key]
        self._data.move_to_end(key)
        return value

    def __setitem__(self, key: Hashable, value: V) -> None:
        self._data[key] = value
        self._data.move_to_end(key)
        while len(self._data) > self.maxsize:
            self._data.popitem(last=False)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._data

    def __len__(self) -> int:
        return len(self._data)

    def clear(self) -> None:
        self._data.clear()
