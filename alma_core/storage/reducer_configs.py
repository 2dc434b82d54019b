"""Each workflow's reducers in PostgreSQL (``reducer_configs``): joins and ``updates``
of the workflow's runs use them (the checkpointer reads them per batch)."""

from __future__ import annotations

import json

import asyncpg

from alma_core import errors
from alma_core.reducers import ReducerConfig


async def load(
    conn: asyncpg.Connection | asyncpg.Pool, tenant_id: str, workflow_id: str
) -> ReducerConfig | None:
    """The workflow's registered reducers; None when it has registered none."""
    raw = await conn.fetchval(
        "SELECT config::text FROM reducer_configs WHERE tenant_id = $1 AND workflow_id = $2",
        tenant_id,
        workflow_id,
    )
    return None if raw is None else ReducerConfig.from_json(json.loads(raw))


async def save(
    conn: asyncpg.Connection, tenant_id: str, workflow_id: str, config: ReducerConfig
) -> None:
    config.validate()
    await conn.execute(
        """INSERT INTO reducer_configs (tenant_id, workflow_id, config)
           VALUES ($1, $2, $3::jsonb)
           ON CONFLICT (tenant_id, workflow_id)
           DO UPDATE SET config = EXCLUDED.config, updated_at = now()""",
        tenant_id,
        workflow_id,
        json.dumps(config.to_json()),
    )


async def add_fields(
    pool: asyncpg.Pool, tenant_id: str, workflow_id: str, fields: dict[str, str]
) -> ReducerConfig:
    """Add ``fields`` (field -> reducer) to the workflow's reducers, keeping the rest.
    A field registered with another reducer is a ConfigError: changing it would
    change how running runs fold their updates."""
    ReducerConfig(field_reducers=fields).validate()
    async with pool.acquire() as conn, conn.transaction():
        await conn.execute(  # serialise concurrent registrations of one workflow
            "SELECT pg_advisory_xact_lock(hashtext($1))", f"{tenant_id}\x1f{workflow_id}"
        )
        config = await load(conn, tenant_id, workflow_id) or ReducerConfig()
        clash = {
            f: config.field_reducers[f]
            for f, r in fields.items()
            if config.field_reducers.get(f, r) != r
        }
        if clash:
            raise errors.ConfigError(
                f"workflow {workflow_id!r} already uses reducers {clash} for these fields; "
                "pick other field names or change them with `alma reducers set`"
            )
        if all(f in config.field_reducers for f in fields):
            return config
        merged = ReducerConfig(
            {**config.field_reducers, **fields}, config.default_reducer, config.strict
        )
        await save(conn, tenant_id, workflow_id, merged)
        return merged
