"""The pool hands connections back without a reset query (``storage.postgres``): that
holds only while nothing sent on a pooled connection outlives its transaction. This
scan of the code refuses session-level state: a ``SET``/``RESET`` without ``LOCAL``,
``set_config(..., false)``, a session advisory lock, or ``LISTEN`` outside the effect
listener (which holds a connection of its own)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SESSION_STATE = {
    # SQL keywords are written in capitals here (prose "Set the ..." is not SQL)
    "SET or RESET without LOCAL": re.compile(r"""["']\s*(?:SET|RESET)\s+(?!LOCAL\b)"""),
    "set_config(..., false)": re.compile(r"set_config\([^)]*,\s*false\s*\)", re.I),
    "a session advisory lock": re.compile(r"pg_(?:try_)?advisory_lock(?:_shared)?\s*\(", re.I),
    "LISTEN": re.compile(r"""["']\s*LISTEN\b|\.add_listener\("""),
}
# LISTEN on a connection the module opened for it
OWN_CONNECTION = {("alma_core/storage/effects.py", "LISTEN")}


def offences(source: str) -> list[str]:
    return [what for what, pattern in SESSION_STATE.items() if pattern.search(source)]


@pytest.mark.parametrize(
    ("line", "what"),
    [
        ('await conn.execute("SET search_path = x")', "SET or RESET without LOCAL"),
        ("await conn.execute('RESET ALL')", "SET or RESET without LOCAL"),
        ('"""\n    SET statement_timeout = 0"""', "SET or RESET without LOCAL"),
        ("SELECT set_config('alma.tenant_id', $1, false)", "set_config(..., false)"),
        ('"SELECT pg_advisory_lock($1)"', "a session advisory lock"),
        ('"SELECT pg_try_advisory_lock(1)"', "a session advisory lock"),
        ('await conn.execute("LISTEN alma")', "LISTEN"),
        ("await conn.add_listener(CHANNEL, cb)", "LISTEN"),
    ],
)
def test_the_scan_finds_session_state(line: str, what: str) -> None:
    assert offences(line) == [what]


@pytest.mark.parametrize(
    "line",
    [
        'await conn.execute("SET LOCAL hnsw.ef_search = 40")',
        "SELECT set_config('role', $1, true)",
        '"SELECT pg_advisory_xact_lock($1)"',
        '"UPDATE runs SET status = $1"',
        '"""Set the stored offsets."""',
    ],
)
def test_the_scan_lets_transaction_state_through(line: str) -> None:
    assert offences(line) == []


def test_nothing_on_a_pooled_connection_outlives_its_transaction() -> None:
    found = {}
    for package in ("alma_core", "consumers"):
        for path in sorted((ROOT / package).rglob("*.py")):
            name = path.relative_to(ROOT).as_posix()
            hits = [w for w in offences(path.read_text()) if (name, w) not in OWN_CONNECTION]
            if hits:
                found[name] = hits
    assert not found, (
        f"session-level state in {found}: pooled connections are not reset on release "
        "(alma_core/storage/postgres.py); make it transaction-local (SET LOCAL, "
        "set_config(..., true), pg_advisory_xact_lock) or use a connection of its own"
    )
