"""A throwaway PostgreSQL server on 127.0.0.1, in a temporary folder, stopped and removed at the end.

Shared by the distributed-mode tests (tests/test_study_postgres.py) and the crash storm of several
processes on one PostgreSQL study (tests/fault_injection.py --postgres). The server trusts local
logins (it listens on loopback only and lives as long as one test run) and runs with fsync off:
nothing in it must survive the machine. No tests here.
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
from contextlib import contextmanager
from typing import Iterator


def pg_binary(name: str) -> str | None:
    """`name` (initdb, pg_ctl) on PATH, else from Debian's newest /usr/lib/postgresql/<major>/bin."""
    found = shutil.which(name)
    if found:
        return found
    candidates = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"),
                        key=lambda p: int(p.split("/")[4]) if p.split("/")[4].isdigit() else 0)
    return candidates[-1] if candidates else None


def available() -> bool:
    return bool(pg_binary("initdb") and pg_binary("pg_ctl"))


def required() -> None:
    """In a test: fail with a hint when PostgreSQL is missing (`make test` installs it), or skip where
    PHAZE_OPT_SKIP_POSTGRES=1 says the machine cannot have it."""
    import pytest

    if available():
        return
    if os.environ.get("PHAZE_OPT_SKIP_POSTGRES") == "1":
        pytest.skip("PostgreSQL is not installed and PHAZE_OPT_SKIP_POSTGRES=1")
    pytest.fail("PostgreSQL (initdb, pg_ctl) not found: `make test` installs it (apt-get install postgresql); "
                "or set PHAZE_OPT_SKIP_POSTGRES=1 to skip this test")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_as(root: str, sock: str) -> list[str]:
    """The server refuses to run as root: there it runs as the postgres user (or nobody), owning its folder."""
    if os.geteuid() != 0:
        return []
    try:
        user = pwd.getpwnam("postgres")
    except KeyError:
        user = pwd.getpwnam("nobody")
    for d in (root, sock):
        os.chown(d, user.pw_uid, user.pw_gid)
    return ["runuser", "-u", user.pw_name, "--"]


@contextmanager
def throwaway(databases: tuple[str, ...], max_connections: int = 200) -> Iterator[dict[str, str]]:
    """A fresh server holding the empty `databases`; yields each one's URL (user `phaze`)."""
    initdb, pg_ctl = pg_binary("initdb"), pg_binary("pg_ctl")
    if not (initdb and pg_ctl):
        raise RuntimeError("PostgreSQL (initdb, pg_ctl) not found: apt-get install postgresql (`make postgres`)")
    root = tempfile.mkdtemp(prefix="phaze-pg-")  # not below a caller's private folder: the server's user enters it
    data, sock = os.path.join(root, "data"), os.path.join(root, "sock")
    os.makedirs(sock)
    run_as = _run_as(root, sock)
    port = free_port()
    try:
        subprocess.run(run_as + [initdb, "-D", data, "-U", "phaze", "--auth=trust", "-E", "UTF8", "--no-sync"],
                       check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=120)
        options = f"-c listen_addresses=127.0.0.1 -p {port} -k {sock} -c fsync=off -c max_connections={max_connections}"
        subprocess.run(run_as + [pg_ctl, "-D", data, "-l", os.path.join(root, "server.log"), "-w", "-t", "60",
                                 "-o", options, "start"], check=True, stdout=subprocess.DEVNULL, timeout=90)
        try:
            import psycopg2

            conn = psycopg2.connect(host="127.0.0.1", port=port, user="phaze", dbname="postgres")
            conn.autocommit = True
            with conn.cursor() as cur:
                for db in databases:
                    cur.execute(f"CREATE DATABASE {db}")
            conn.close()
            yield {db: f"postgresql://phaze@127.0.0.1:{port}/{db}" for db in databases}
        finally:
            subprocess.run(run_as + [pg_ctl, "-D", data, "-m", "fast", "-w", "stop"], stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL, timeout=60)
    finally:
        shutil.rmtree(root, ignore_errors=True)
