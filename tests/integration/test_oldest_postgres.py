"""PostgreSQL 15, the oldest PostgreSQL the tests run on (the suite's own is the embedded
18, built without lz4): the migrations up, down and up again, lz4 on the state columns,
the checkpointer's batch statements, and scoped retrieval on pgvector's half copies.
Migration 0009 once stopped on 15 with a syntax error (a STORAGE clause in ADD COLUMN,
from 16 on), and 0016 dropped the states' lz4 where the server has it; the embedded
server showed neither."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import asyncpg
import pytest

from alma_core.settings import Settings
from alma_core.storage.embeddings import AsyncEmbedder
from tests.integration import test_checkpointer, test_retrieval
from tests.integration.conftest import Topics, settings_for
from tests.integration.harness import Worker, assert_replays_the_same
from tests.integration.test_migrations import assert_up_down_up, lz4_available
from tests.integration.test_migrations import (
    test_states_are_compressed_with_lz4_where_the_server_has_it as lz4_columns_check,
)
from tests.services import Services


async def test_the_migrations_go_up_down_and_up_again(
    oldest_empty_database: str, oldest_database: str
) -> None:
    conn = await asyncpg.connect(oldest_empty_database)
    try:
        assert int(await conn.fetchval("SHOW server_version_num")) // 10000 == 15
    finally:
        await conn.close()
    await assert_up_down_up(oldest_empty_database, oldest_database)


async def test_states_are_compressed_with_lz4(oldest_database: str) -> None:
    """Debian's PostgreSQL 15 is built with lz4, so here the columns must take it."""
    conn = await asyncpg.connect(oldest_database)
    try:
        assert await lz4_available(conn)
    finally:
        await conn.close()
    await lz4_columns_check(oldest_database)


@pytest.mark.parametrize(
    "check",
    [
        test_checkpointer.test_sequential_runs_get_gapless_ordered_checkpoints,
        test_checkpointer.test_duplicates_and_unchanged_states_have_no_second_effect,
    ],
    ids=["in order", "once"],
)
async def test_the_checkpointer(
    services: Services,
    oldest_database: str,
    topics: Topics,
    check: Callable[[Settings, Worker], Awaitable[None]],
) -> None:
    settings = settings_for(
        services.kafka_bootstrap,
        oldest_database,
        services.redis_url,
        topics,
        max_state_bytes=64 * 1024,
    )
    async with Worker.start(settings) as worker:
        await check(settings, worker)
    assert await assert_replays_the_same(oldest_database) >= 1


async def test_scoped_retrieval(oldest_database: str, embedder: AsyncEmbedder) -> None:
    await test_retrieval.test_each_scope_returns_exactly_what_its_filter_admits(
        oldest_database, embedder
    )


async def test_full_vectors_stay_in_the_row(oldest_database: str) -> None:
    """Migration 0009's storage, as its statements on 15 set it."""
    await test_retrieval.test_full_vectors_stay_in_the_row(oldest_database)
