"""Plumbing every cache shares: where the on-disk caches live, and a bounded in-memory memo.

`cache_root()` is `$PHAZE_OPT_CACHE`, else `.cache/phaze_opt` in the project folder (beside the
package) of a clone, else the user's cache folder; the workload graphs (`workload/graphs.py`) and the solved schedules
(`solve/schedule/cache.py`) each keep a folder under it.

`signature(payload)` signs what a cache writes with a random key of the cache folder (`signing.key`,
made once, readable by its owner only), so a file edited by hand or by another program is not
trusted: its numbers (bytes, FLOPs, units) would otherwise decide a design's throughput unseen.

`BoundedMemo` is a least-recently-used mapping for the in-process memos (layer graphs, schedule
records, per-layer costs and energies). A long study or sweep visits tens of thousands of designs;
an unbounded dict would keep every one of them. A memo only saves work that the disk caches below
it (or a re-computation) would give back identically, so its bound trades time, never results.
"""

from __future__ import annotations

import hashlib
import hmac
import json
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


def write_atomic(path: Path, data: str | bytes, replace: bool = True) -> bool:
    """Write a cache file whole or not at all: written beside its place and renamed into it, so a
    concurrent reader or a kill never leaves half a file. False when the disk refused (read-only,
    full): a cache that cannot be written only costs the work again next time. `replace=False`
    keeps a file already at `path` (the first of several writers wins) and returns False."""
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=path.suffix)  # mode 0600
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode("utf-8") if isinstance(data, str) else data)
        if replace:
            os.replace(tmp, path)
            tmp = None
        else:
            os.link(tmp, path)  # the file beside it goes below
    except OSError:
        return False
    finally:
        if tmp is not None:  # a full disk (or an interrupt) left part of a file: never keep it
            try:
                os.unlink(tmp)
            except OSError:
                pass
    return True


KEY_BYTES = 32
_KEYS: dict[Path, bytes] = {}


def _signing_key() -> bytes | None:
    """The cache folder's key, made the first time (the first process to link its file in wins, so
    processes starting together agree); None when it can be neither read nor made (a read-only
    folder): then nothing read from the cache is trusted."""
    path = cache_root() / "signing.key"
    if path in _KEYS:
        return _KEYS[path]
    for _ in range(2):
        try:
            key = path.read_bytes()
        except FileNotFoundError:
            key = b""
        except OSError:
            return None
        if len(key) == KEY_BYTES:
            _KEYS[path] = key
            return key
        # a new key; a damaged one is replaced (every file signed with it is traced again anyway),
        # a missing one made by whichever process links its file in first, so processes agree
        if not write_atomic(path, os.urandom(KEY_BYTES), replace=bool(key)) and not path.is_file():
            return None
    return None


def signature(payload) -> str | None:
    """The HMAC-SHA256 of a JSON-able `payload` (serialised canonically, so it survives a round trip
    through a file) under the cache folder's key; None when there is no key to sign with."""
    key = _signing_key()
    if key is None:
        return None
    text = json.dumps(payload, sort_keys=True, separators=(",", ":"), allow_nan=False)
    return hmac.new(key, text.encode("utf-8"), hashlib.sha256).hexdigest()


def signed(payload, mark) -> bool:
    """Whether `mark` is this cache folder's signature of `payload`."""
    expected = signature(payload)
    return expected is not None and isinstance(mark, str) and hmac.compare_digest(expected, mark)


class BoundedMemo(Generic[V]):
    """A dict-like memo that keeps the `maxsize` most recently used entries.

    Offers the dict operations the memos use (`get`, `[]`, `[]=`, `in`, `len`, `clear`, `items`), so a
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

    def items(self) -> list[tuple[Hashable, V]]:
        """The entries, least recently used first (a copy: safe to keep while the memo changes)."""
        return list(self._data.items())
