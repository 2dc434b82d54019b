"""A DSN of several hosts (a primary and its standby) is tried one host at a time, each
with its own share of the timeout: a host that is gone without a word (a lost machine,
no reset and no refusal) must not keep the next one, the promoted standby, from being
tried. asyncpg spends its one timeout on the whole list (tests/cluster found it: after
a lost primary, no connection reached the new one)."""

from __future__ import annotations

from alma_core.storage import postgres


def test_each_host_of_a_dsn_gets_a_dsn_of_its_own() -> None:
    dsn = "postgresql://alma:s3cret@db1:5432,db2,[::1]:5433/alma?target_session_attrs=read-write"
    assert postgres.host_dsns(dsn) == [
        "postgresql://alma:s3cret@db1:5432/alma?target_session_attrs=read-write",
        "postgresql://alma:s3cret@db2/alma?target_session_attrs=read-write",
        "postgresql://alma:s3cret@[::1]:5433/alma?target_session_attrs=read-write",
    ]
    assert postgres.host_dsns("postgresql://db1,db2") == ["postgresql://db1", "postgresql://db2"]


def test_a_dsn_of_one_host_is_itself() -> None:
    for dsn in ("postgresql://postgres@127.0.0.1:5432/alma", "postgresql:///alma", "not a url"):
        assert postgres.host_dsns(dsn) == [dsn]
