"""Start-up safety: file locks, race-free schema creation, and a quick probe of the tracking server.

Several processes may start on one study at once (two shells, a cluster job array). The first
moments of each are the racy ones:

- creating the Optuna schema: two processes create the same tables (PostgreSQL answers
  `UniqueViolation pg_type_typname_nsp_index`, SQLite `table ... already exists`). `create_schema`
  runs the creation under a file lock (processes of one machine) and retries on those errors
  (processes of several machines, which a file lock does not reach).
- creating the MLflow SQLite database: MLflow migrates a new database in a dozen steps, so a
  process killed halfway leaves it half-migrated (every later run fails) and two processes migrate
  it twice (`duplicate column name: step`). `build_mlflow_db` builds it aside, under a lock, and
  moves the finished file into place with one `os.replace`: the database is either absent or whole.
- an unreachable tracking server: MLflow retries HTTP for minutes before it fails.
  `probe_tracking_uri` asks once, with a short timeout, and fails at once with one line.

The locks are `fcntl.flock` locks, released by the kernel when their process dies, so a killed
process never leaves a lock behind (the lock files themselves stay; they are empty).
"""

from __future__ import annotations

import hashlib
import os
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, TypeVar

from ..errors import PhazeError
from .urls import redact

T = TypeVar("T")
PROBE_TIMEOUT_S = 5.0
# Errors that mean "another process created it first": retried (see `create_schema`).
RACE_MARKERS = ("already exists", "uniqueviolation", "duplicate", "unique constraint", "database is locked",
                "pg_type_typname_nsp_index")



def driver_url(url: str) -> str:
    """`postgresql://` with the driver that is installed.

    SQLAlchemy 2.1 maps a bare `postgresql://` to psycopg 3; we ship psycopg2, so name it unless
    psycopg 3 is there. Other URLs pass unchanged.
    """
    text = str(url)
    if text.startswith(("postgresql://", "postgres://")):
        import importlib.util

        if importlib.util.find_spec("psycopg") is None and importlib.util.find_spec("psycopg2") is not None:
            return "postgresql+psycopg2://" + text.split("://", 1)[1]
    return text

def lock_path_for(url: str, purpose: str) -> Path:
    """Where the lock of `purpose` ("schema", "mlflow", "reconcile") on the database `url` lives: beside
    a SQLite file, else in the temporary directory under a hash of the URL."""
    text = str(url)
    if text.startswith("sqlite:///"):
        path = Path(text[len("sqlite:///"):].split("?", 1)[0])
        return path.parent / f".{path.name}.{purpose}.lock"
    digest = hashlib.sha1(text.encode()).hexdigest()[:16]
    return Path(tempfile.gettempdir()) / f"phaze-{purpose}-{digest}.lock"


@contextmanager
def file_lock(path: str | os.PathLike, timeout_s: float = 600.0):
    """An exclusive lock on `path` (created if missing), held for the `with` block.

    Waits up to `timeout_s` (a PhazeError after that). Where `fcntl` is missing (not POSIX) it is a
    no-op: the retries in `create_schema` still apply.
    """
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX
        yield
        return
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise PhazeError(f"waited {timeout_s:.0f} s for the lock {path}; another process holds it") from None
                time.sleep(0.05)
        yield
    finally:
        os.close(fd)  # closing releases the lock


@contextmanager
def study_lock(url: str, storage, study: str, purpose: str):
    """Held by one process at a time for `purpose` on the study `study` in the storage `url`: a file
    lock (the processes of this machine) and, on PostgreSQL, an advisory lock on a connection of the
    storage's own engine (the processes of every machine). A read-then-write such as Optuna's
    `enqueue_trial(skip_if_exists=True)` is only atomic under it: processes starting together each
    read "absent" and each inserted. Both locks go with their process when it dies."""
    digest = hashlib.sha1(f"phaze_opt:{purpose}:{study}".encode()).digest()
    with file_lock(lock_path_for(url, f"{purpose}-{digest.hex()[:12]}")):
        engine = getattr(storage, "engine", None)
        if engine is None or engine.dialect.name != "postgresql":
            yield
            return
        from sqlalchemy import text

        key = int.from_bytes(digest[:8], "big", signed=True)  # PostgreSQL's advisory keys are bigint
        with engine.connect() as conn:
            conn.execute(text("SELECT pg_advisory_lock(:key)"), {"key": key})
            conn.commit()
            try:
                yield
            finally:  # a session-level lock outlives the transaction: released before the pool keeps the connection
                conn.execute(text("SELECT pg_advisory_unlock(:key)"), {"key": key})
                conn.commit()


def is_race(exc: BaseException) -> bool:
    text = f"{type(exc).__name__} {exc}".lower()
    return any(m in text for m in RACE_MARKERS)


def create_schema(create: Callable[[], T], url: str, attempts: int = 6) -> T:
    """`create()` (e.g. opening an Optuna RDBStorage, which creates its tables), under the URL's schema
    lock, retried when it loses a creation race to a process the lock does not reach."""
    delay = 0.2
    for attempt in range(attempts):
        try:
            with file_lock(lock_path_for(url, "schema")):
                return create()
        except Exception as exc:  # noqa: BLE001 - only creation races are retried
            if attempt + 1 == attempts or not is_race(exc):
                raise
            time.sleep(delay)
            delay *= 2
    raise AssertionError("unreachable")


def build_aside(db: Path, open_store: Callable[[str], object], purpose: str = "mlflow") -> None:
    """Create the SQLite database `db` if it does not exist (or is empty): build it aside
    (`.<name>.building-<pid>`), then move it into place. `open_store(uri)` opens (so creates and
    migrates) a store at a SQLite URI; an `engine` it returns is disposed of before the move.

    Used for the MLflow database and a new Optuna SQLite storage, whose schemas take many statements:
    a process killed halfway leaves only its aside file, removed by the next build.
    """
    if db.exists() and db.stat().st_size > 0:
        return
    db.parent.mkdir(parents=True, exist_ok=True)
    with file_lock(lock_path_for(f"sqlite:///{db}", purpose)):
        if db.exists() and db.stat().st_size > 0:
            return
        for stale in db.parent.glob(f".{db.name}.building-*"):
            stale.unlink(missing_ok=True)  # we hold the lock: its builder is dead
        aside = db.parent / f".{db.name}.building-{os.getpid()}"
        try:
            with _unsynced(aside):
                store = open_store(f"sqlite:///{aside}")
            engine = getattr(store, "engine", None)
            if engine is not None:
                engine.dispose()  # no connection may outlive the rename
            for suffix in ("-wal", "-shm", "-journal"):  # all in the main file once its connections closed
                Path(f"{aside}{suffix}").unlink(missing_ok=True)
            _fsync(aside)
            os.replace(aside, db)
        finally:
            aside.unlink(missing_ok=True)


@contextmanager
def _unsynced(path: Path):
    """SQLite connections opened meanwhile to `path` neither sync nor keep a journal on disk. For a
    database built aside only: one killed or cut by a power loss midway is never moved into place
    (the next build removes it), so the schema's hundreds of statements need no sync each (MLflow's
    migrations: 8 s on a loaded disk, 3 s unsynced); `build_aside` syncs the finished file once."""
    import sqlite3

    from sqlalchemy import event
    from sqlalchemy.engine import Engine

    target = os.path.realpath(path)

    def unsynced(dbapi_conn, _record):
        if not isinstance(dbapi_conn, sqlite3.Connection):
            return
        cur = dbapi_conn.cursor()
        if any(os.path.realpath(row[2]) == target for row in cur.execute("PRAGMA database_list") if row[2]):
            cur.execute("PRAGMA synchronous=OFF")
            cur.execute("PRAGMA journal_mode=MEMORY")
        cur.close()

    event.listen(Engine, "connect", unsynced)
    try:
        yield
    finally:
        event.remove(Engine, "connect", unsynced)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def build_mlflow_db(db: Path, open_store: Callable[[str], object]) -> None:
    build_aside(db, open_store, "mlflow")


def prebuild_optuna_sqlite(url: str, open_storage: Callable[[str], object]) -> None:
    """A new Optuna SQLite storage: its schema built aside (`build_aside`); other URLs pass."""
    text = str(url)
    if text.startswith("sqlite:///"):
        path = Path(text[len("sqlite:///"):].split("?", 1)[0])
        build_aside(path, open_storage, "schema")


def probe_tracking_uri(uri: str, timeout_s: float = PROBE_TIMEOUT_S) -> None:
    """One quick request to an http(s) tracking server's API, or a connection to a database server's
    port; a PhazeError at once when it does not answer, or answers with a server error (MLflow's
    client retries those for minutes). SQLite and files pass (opening them fails fast on its own)."""
    text = str(uri)
    if text.startswith(("postgresql", "postgres://", "mysql")):
        probe_database(text, timeout_s)
        return
    if not text.startswith(("http://", "https://")):
        return
    import urllib.error
    import urllib.request

    # the call MLflow makes first (a search of experiments), not just /health: a server whose
    # database is gone answers /health and fails every API call
    url = text.rstrip("/") + API_PROBE
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=_auth_headers()),  # noqa: S310 - the user's own server
                                    timeout=timeout_s):
            return
    except urllib.error.HTTPError as exc:
        if exc.code < 500:
            return  # it answered (authentication, an older API): MLflow reports a refusal at once
        raise PhazeError(f"--tracking-uri {redact(text)}: the MLflow server answers {exc.code} ({exc.reason}) to "
                         "its API; fix the server, or use --tracking-uri off") from None
    except Exception as exc:  # noqa: BLE001 - refused, timed out, no such host
        reason = getattr(exc, "reason", None) or exc or type(exc).__name__
        raise PhazeError(f"--tracking-uri {redact(text)}: no MLflow server answers within {timeout_s:g} s "
                         f"({reason}); start it, or use --tracking-uri off") from None


API_PROBE = "/api/2.0/mlflow/experiments/search?max_results=1"


def _auth_headers() -> dict:
    """The credentials MLflow's client sends (its MLFLOW_TRACKING_TOKEN, or USERNAME and PASSWORD)."""
    import base64

    token = os.environ.get("MLFLOW_TRACKING_TOKEN")
    if token:
        return {"Authorization": f"Bearer {token}"}
    user, password = os.environ.get("MLFLOW_TRACKING_USERNAME"), os.environ.get("MLFLOW_TRACKING_PASSWORD")
    if user and password:
        return {"Authorization": "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()}
    return {}


DEFAULT_PORTS = {"postgresql": 5432, "postgres": 5432, "mysql": 3306}


def probe_database(text: str, timeout_s: float = PROBE_TIMEOUT_S, option: str = "--tracking-uri") -> None:
    """A database server must accept a connection to its port and then a login to the URL's database
    (`SELECT 1`), all within about `timeout_s`; else a PhazeError, one line naming `option`, the flag
    that gave the URL. Without it the drivers took minutes: MLflow retries a failing engine for two
    minutes (a missing database: 114 s), and a port that answers but is not the database's server
    (another program) leaves the driver waiting for a reply that never comes (123 s)."""
    import socket
    from urllib.parse import urlparse

    start = time.monotonic()
    parsed = urlparse(text)
    scheme = parsed.scheme.split("+", 1)[0]
    try:
        host, port = parsed.hostname, parsed.port or DEFAULT_PORTS.get(scheme)
    except ValueError:
        raise PhazeError(f"{option} {redact(text)}: not a valid database URL") from None
    off = ", or use --tracking-uri off" if option == "--tracking-uri" else ""
    if host and port:  # else a local socket or a driver's own default: the login below still bounds it
        try:
            socket.create_connection((host, port), timeout=timeout_s).close()
        except OSError as exc:
            raise PhazeError(f"{option} {redact(text)}: no database server answers at {host}:{port} "
                             f"({exc.strerror or exc}); start it{off}") from None
    _probe_login(text, max(2.0, timeout_s - (time.monotonic() - start)), option)


def _probe_login(text: str, timeout_s: float, option: str) -> None:
    """Log in to the database of `text` and run `SELECT 1`, on a daemon thread given `timeout_s`
    (the drivers' own `connect_timeout` as well, for those that honour it)."""
    import threading

    outcome: list = []

    def login() -> None:
        try:
            import sqlalchemy
            from sqlalchemy.pool import NullPool

            url = driver_url(text)
            known = url.split(":", 1)[0].split("+", 1)[0] in DEFAULT_PORTS  # drivers that take connect_timeout
            engine = sqlalchemy.create_engine(url, poolclass=NullPool,
                                              connect_args={"connect_timeout": max(2, int(timeout_s))} if known else {})
            try:
                with engine.connect() as conn:
                    conn.execute(sqlalchemy.text("SELECT 1"))
            finally:
                engine.dispose()
            outcome.append(None)
        except Exception as exc:  # noqa: BLE001 - reported in one line below
            outcome.append(exc)

    thread = threading.Thread(target=login, name="database-probe", daemon=True)
    thread.start()
    thread.join(timeout_s + 1.0)
    if not outcome:
        raise PhazeError(f"{option} {redact(text)}: the server at that address did not log in within "
                         f"{timeout_s:.0f} s (not a database server of that kind?)")
    exc = outcome[0]
    if exc is not None:
        lines = [line.strip() for line in str(getattr(exc, "orig", None) or exc).splitlines() if line.strip()]
        raise PhazeError(f"{option} {redact(text)}: cannot log in: {' '.join(lines)[:300] or type(exc).__name__}")


OPTUNA_TABLES = {"studies", "study_directions", "trials", "version_info"}


def sqlite_read_uri(path: str | os.PathLike) -> str:
    """An SQLite URI (`file:...`) that reads the database at `path` and never writes it: `mode=ro`,
    or `immutable=1` where that cannot open it. A WAL database opened read-only needs its `-shm`
    file, which SQLite cannot create in a read-only folder (read-only media, another user's
    studies), so `mode=ro` fails there with "unable to open database file". Immutable skips the
    shared memory and the locks; what it misses is a `-wal` not yet folded back, which a
    read-only folder cannot be given anyway."""
    import sqlite3

    path = Path(path).resolve()
    for query in ("mode=ro", "immutable=1"):
        uri = f"file:{path}?{query}"
        try:
            con = sqlite3.connect(uri, uri=True, timeout=30)
            try:
                con.execute("SELECT count(*) FROM sqlite_master").fetchone()
                return uri
            finally:
                con.close()
        except sqlite3.OperationalError:
            continue
    return f"file:{path}?mode=ro"  # the error, if any, is the caller's to report


def check_sqlite_storage(url: str) -> None:
    """Refuse a SQLite file that holds another program's tables (an MLflow database, say): Optuna would
    add its tables to it or fail with a misleading version error. A missing or empty file passes."""
    text = str(url)
    if not text.startswith("sqlite:///"):
        return
    path = Path(text[len("sqlite:///"):].split("?", 1)[0])
    if not path.is_file() or path.stat().st_size == 0:
        return
    import sqlite3

    try:
        con = sqlite3.connect(sqlite_read_uri(path), uri=True, timeout=30)
        try:
            tables = {r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        finally:
            con.close()
    except sqlite3.DatabaseError as exc:
        raise PhazeError(f"--storage {text}: not an Optuna database ({exc})") from None
    if tables and not tables & OPTUNA_TABLES:
        shown = ", ".join(sorted(tables)[:5]) + (", ..." if len(tables) > 5 else "")
        raise PhazeError(f"--storage {text}: this SQLite file holds another program's tables ({shown}), not an "
                         "Optuna study; give a new file or an Optuna storage")
