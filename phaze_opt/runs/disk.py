"""A full disk during a study: one line naming the path and the space it needs, nothing half-written.

Every file a study writes (its summary, Pareto plot, the exhaustive sweep's points file, a worker's
spooled `placement.json`, an MLflow artifact) is written whole beside its place and moved into it
(`write_whole`): a write the disk refuses leaves no part of a file. A database that runs out of
room keeps its last committed transaction (each is atomic); its error becomes `DiskFull` too,
naming the database (`search.session.disk_full`; the tracking store names its own). The CLI prints
that one line (exit status 1); the next start of the same command resumes the study and reconciles
whatever the stop left open.
"""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
import threading
from pathlib import Path

from ..errors import PhazeError

# SQLite in WAL mode appends each transaction's pages to its -wal file and folds them into the
# database at a checkpoint, by default once the log holds 1000 pages (PRAGMA wal_autocheckpoint,
# sqlite.org/wal.html "Automatic Checkpoint") of 4096 bytes (the default page size,
# sqlite.org/pragma.html#pragma_page_size): room for that log, and as much for the database to grow.
DATABASE_HEADROOM_BYTES = 2 * 1000 * 4096
FULL_ERRNOS = {errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC), errno.EFBIG}  # EFBIG: the file-size limit
# The drivers' words for it: SQLite's SQLITE_FULL, PostgreSQL's disk_full (53100, "could not extend
# file ... No space left on device"), MySQL's "The table is full" / errno 28.
FULL_MARKERS = ("database or disk is full", "no space left on device", "could not extend file",
                "disk quota exceeded", "errno 28", "table is full", "file too large")
# What SQLite says when a write meets the file-size limit (`ulimit -f`; Python ignores SIGXFSZ, so the
# write fails with EFBIG and SQLite reports SQLITE_IOERR_WRITE): read as the limit only under one.
LIMIT_MARKERS = ("disk i/o error",)


def file_size_limit() -> int | None:
    """This process's file-size limit in bytes (`ulimit -f`), or None when there is none."""
    try:
        import resource
    except ImportError:  # pragma: no cover - not POSIX
        return None
    soft = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    return None if soft == resource.RLIM_INFINITY else int(soft)


def free_bytes(path: str | os.PathLike) -> int | None:
    """Free bytes on the file system that holds `path` (or would: its nearest existing folder)."""
    p = Path(path).absolute()
    for candidate in (p, *p.parents):
        if candidate.exists():
            try:
                return shutil.disk_usage(candidate).free
            except OSError:
                return None
    return None


def _size(n: int | None) -> str:
    if n is None:
        return "an unknown amount"
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} bytes"


class DiskFull(PhazeError):
    """No room left for `path`: it needs about `needed` bytes free. One line; the CLI exits 1."""

    exit_status = 1

    def __init__(self, path: str | os.PathLike, needed: int, free: int | None = None):
        self.path, self.needed = str(path), int(needed)
        self.free = free_bytes(path) if free is None else free
        limit = file_size_limit()
        if limit is not None and (self.free is None or self.free >= self.needed):  # room, but a capped file
            super().__init__(f"a write to {self.path} exceeds this process's file-size limit (ulimit -f: "
                             f"{_size(limit)}); raise it and run the same command again (a study resumes "
                             "where it stopped)")
            return
        super().__init__(f"no space left on the device of {self.path}: it needs about {_size(self.needed)} free, "
                         f"{_size(self.free)} is; free some space and run the same command again (a study "
                         "resumes where it stopped)")

    def __reduce__(self):  # a worker's DiskFull reaches the parent whole
        return (type(self), (self.path, self.needed, self.free))


def is_full(exc: BaseException | None) -> bool:
    """Whether `exc`, or an error it wraps (cause, context, a driver's `orig`), says the disk is full."""
    seen: set[int] = set()
    stack = [exc]
    while stack:
        e = stack.pop()
        if e is None or id(e) in seen or len(seen) > 50:
            continue
        seen.add(id(e))
        if isinstance(e, DiskFull):
            return True
        if isinstance(e, OSError) and e.errno in FULL_ERRNOS:
            return True
        text = str(e).lower()
        if any(m in text for m in FULL_MARKERS):
            return True
        if any(m in text for m in LIMIT_MARKERS) and file_size_limit() is not None:
            return True
        stack += [e.__cause__, e.__context__, getattr(e, "orig", None)]
    return False


def write_whole(path: str | os.PathLike, data: bytes | str) -> Path:
    """Write `data` to `path` whole or not at all: beside it (`.<name>.*.partial`), then renamed into
    place; a failed write removes its partial file. A full disk is `DiskFull(path, len(data))`."""
    path = Path(path)
    raw = data.encode("utf-8") if isinstance(data, str) else bytes(data)
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".partial")
        with os.fdopen(fd, "wb") as f:
            f.write(raw)
        os.replace(tmp, path)
        tmp = None
    except OSError as exc:
        if is_full(exc):
            raise DiskFull(path, len(raw)) from None
        raise
    finally:
        if tmp is not None:
            try:
                os.unlink(tmp)
            except OSError:
                pass
    return path


def quiet_full_threads() -> None:
    """Drop the traceback of a library's background thread (Optuna's heartbeat) that met a full disk
    or the file-size limit: the process's own next write meets it too and says so in one line, which
    the thread's traceback would only bury. Other errors in threads print as Python prints them."""
    hook = threading.excepthook
    if getattr(hook, "phaze_full_quiet", False):
        return

    def quiet(args) -> None:
        if is_full(args.exc_value):
            return
        hook(args)

    quiet.phaze_full_quiet = True
    threading.excepthook = quiet
