"""``alma tenants``: each tenant's own settings (its rate quota, where it differs from
the global ALMA_TENANT_RATE / ALMA_TENANT_BURST; the learner on or off; its checkpoint
retention; its storage quota; its state size limit). The checkpointer, the joiner and
the learner read them every few seconds
(:data:`alma_core.storage.tenant_settings.REFRESH_S`), each pruning round at its
start: no restart. And each tenant's own PostgreSQL roles (``alma tenants role``), with
which its tools read its rows and nothing else."""

from __future__ import annotations

import json
import math
import shlex
from dataclasses import asdict
from typing import Any

import typer
from rich.table import Table

from alma_core import errors, tenancy
from alma_core.cli import common
from alma_core.quotas import Quota
from alma_core.settings import Settings
from alma_core.storage import cache, runs, tenant_roles, tenant_settings
from alma_core.storage.tenant_settings import TenantSettings

tenants_app = common.app(
    help="Tenants' own settings (rate quotas, the learner, checkpoint retention, storage "
    "quotas, state size limits) and their own PostgreSQL roles."
)


def register(app: typer.Typer) -> None:
    app.add_typer(tenants_app, name="tenants")


def _doc(row: TenantSettings, s: Settings) -> dict[str, Any]:
    quota = row.quota(Quota(s.tenant_rate, s.tenant_burst))
    return {
        "tenant_id": row.tenant_id,
        "rate_per_s": quota.rate or None,  # None: no limit
        "burst": (quota.burst or quota.rate or None) if quota.limited else None,
        "learner": row.learns,
        "checkpoint_retention_days": row.retention_days(s.checkpoint_retention_days),
        "storage_quota_bytes": row.storage_quota(s.tenant_storage_quota_bytes) or None,
        "max_state_bytes": row.state_limit(s.max_state_bytes),
        "own": {
            "rate_per_s": row.rate_per_s,
            "burst": row.burst,
            "learner": row.learner,
            "checkpoint_retention_days": row.checkpoint_retention_days,
            "storage_quota_bytes": row.storage_quota_bytes,
            "max_state_bytes": row.max_state_bytes,
        },
        "updated_at": row.updated_at.isoformat() if row.updated_at else None,
    }


def _shown(value: float | int | None, own: float | int | None) -> str:
    text = "no limit" if value is None else f"{value:g}"
    return text if own is not None else f"{text} (global)"


def _learner(learns: bool, own: bool | None) -> str:
    text = "on" if learns else "off"
    return text if own is not None else f"{text} (global)"


def _days(days: float, own: float | None) -> str:
    text = "forever" if days == 0 else f"{days:g} days"
    return text if own is not None else f"{text} (global)"


def _checked(tenant: str, s: Settings) -> str:
    """The tenant id as typed, or exit 2 naming why it can be no tenant (the rule the
    event contract and the SDK apply: :func:`alma_core.tenancy.tenant_problem`)."""
    base = s.lifecycle_topic if s.tenant_topics else None
    if problem := tenancy.tenant_problem(tenant, base):
        common.fail(f"{problem}. What to do: check the id (alma tenants list)", common.USAGE)
    return tenant


def _unknown(tenant: str) -> str:
    return (
        f"tenant {tenant!r} is unknown here: no run, dead letter, role or settings of its "
        "own. A typo? `alma tenants list` shows the tenants with settings, `alma runs list "
        "--tenant T` a tenant's runs"
    )


@tenants_app.command("list")
def tenants_list(as_json: bool = common.json_option("the tenants")) -> None:
    """Every tenant with runs, settings or a role of its own, and its effective settings."""
    s = common.settings()

    async def main() -> None:
        conn = await common.connect(common.dsn(s))
        try:
            own = {r.tenant_id: r for r in await tenant_settings.load_all(conn)}
            known = set(await runs.tenants(conn)) | set(own) | set(await tenant_roles.tenants(conn))
        finally:
            await conn.close()
        docs = [_doc(own.get(t, TenantSettings(t)), s) for t in sorted(known)]
        if as_json:
            print(json.dumps(docs))
            return
        table = Table(title="tenants")
        columns = ("tenant", "rate (events/s)", "burst", "learner", "checkpoints kept")
        for col in (*columns, "storage quota (bytes)", "state limit (bytes)"):
            table.add_column(col)
        for d in docs:
            table.add_row(
                d["tenant_id"],
                _shown(d["rate_per_s"], d["own"]["rate_per_s"]),
                _shown(d["burst"], d["own"]["burst"]),
                _learner(d["learner"], d["own"]["learner"]),
                _days(d["checkpoint_retention_days"], d["own"]["checkpoint_retention_days"]),
                _shown(d["storage_quota_bytes"], d["own"]["storage_quota_bytes"]),
                _shown(d["max_state_bytes"], d["own"]["max_state_bytes"]),
            )
        common.out.print(table)

    common.run(main)


@tenants_app.command("show")
def tenants_show(
    tenant: str = typer.Argument(..., help="The tenant."),
) -> None:
    """A tenant's effective settings, its own values, what it holds in PostgreSQL now
    (runs, checkpoints and their states' stored bytes, events, dead letters, outcomes,
    memories), its kept bytes against its storage quota, and the PostgreSQL roles bound
    to it (``alma tenants role``), as JSON."""
    s = common.settings()
    _checked(tenant, s)

    async def main() -> None:
        conn = await common.connect(common.dsn(s))
        try:
            if not await tenant_settings.known(conn, tenant):
                raise errors.NotFound(
                    f"{_unknown(tenant)}; the settings a new tenant gets are the global ones "
                    "(`alma tenants list` shows them)"
                )
            row = await tenant_settings.load(conn, tenant)
            used = await tenant_settings.usage(conn, tenant)
            held = await tenant_settings.standing(conn, tenant, s.tenant_storage_quota_bytes)
            roles = await tenant_roles.roles_of(conn, tenant)
        finally:
            await conn.close()
        storage = {"used_bytes": held.used, "quota_bytes": held.quota or None, "full": held.full}
        print(
            json.dumps(_doc(row, s) | {"usage": asdict(used), "storage": storage, "roles": roles})
        )

    common.run(main)


@tenants_app.command("set")
def tenants_set(
    tenant: str = typer.Argument(..., help="The tenant."),
    rate: float = typer.Option(
        None, "--rate", min=0, help="Events per second through the checkpointer (0: no limit)."
    ),
    burst: int = typer.Option(
        None, "--burst", min=0, help="Events at once (0: one second's worth of the rate)."
    ),
    learner: str = typer.Option(
        None,
        "--learner",
        help="on: learn from the tenant's finished runs (the default); off: store no "
        "outcome or memory of them, embed nothing; global: back to the default.",
    ),
    checkpoint_days: float = typer.Option(
        None,
        "--checkpoint-retention-days",
        min=0,
        help="Days the checkpoints of the tenant's closed runs are kept (0: forever), "
        "instead of ALMA_CHECKPOINT_RETENTION_DAYS.",
    ),
    storage_quota: int = typer.Option(
        None,
        "--storage-quota-bytes",
        min=0,
        help="Bytes of checkpoint states the tenant may keep (0: no limit), instead of "
        "ALMA_TENANT_STORAGE_QUOTA_BYTES; at it, its new runs are refused (storage_quota "
        "dead letters, replayable once there is room).",
    ),
    state_limit: int = typer.Option(
        None,
        "--max-state-bytes",
        min=1024,
        help="Bytes one checkpoint's state of the tenant may take, below ALMA_MAX_STATE_BYTES "
        "(the ceiling); a state over it is refused (state_too_large).",
    ),
    reset: bool = typer.Option(False, "--reset", help="Back to the global settings."),
    create: bool = typer.Option(
        False,
        "--create",
        help="Set a tenant that has nothing here yet (no run, dead letter, role or "
        "settings): without it such a tenant is refused, as a typo would be.",
    ),
) -> None:
    """Set a tenant's own rate quota, learner, checkpoint retention, storage quota or
    state size limit (what is not given keeps its value); in effect within a few
    seconds (retention: at the next pruning round), without a restart. Rate quotas need
    ALMA_TENANT_TOPICS on the workers."""
    s = common.settings()
    given = (rate, burst, learner, checkpoint_days, storage_quota, state_limit)
    if reset and any(value is not None for value in given):
        common.fail("--reset clears the tenant's own values: give it alone", common.USAGE)
    if not reset and all(value is None for value in given):
        common.fail(
            "nothing to set: pass --rate, --burst, --learner, --checkpoint-retention-days, "
            "--storage-quota-bytes, --max-state-bytes or --reset",
            common.USAGE,
        )
    learns = {"on": True, "off": False, "global": None}
    if learner is not None and learner not in learns:
        common.fail(f"--learner takes on, off or global (got {learner!r})", common.USAGE)
    _checked(tenant, s)
    for option, number in (("--rate", rate), ("--checkpoint-retention-days", checkpoint_days)):
        if number is not None and not math.isfinite(number):
            common.fail(
                f"{option} takes a finite number, 0 or more (0: no limit; got {number!r})",
                common.USAGE,
            )

    async def main() -> None:
        conn = await common.connect(common.dsn(s))
        try:
            async with conn.transaction():
                if not create and not await tenant_settings.known(conn, tenant):
                    common.fail(
                        f"{_unknown(tenant)}. What to do: to set up a tenant before its "
                        "first run, pass --create",
                        common.USAGE,
                    )
                before = await tenant_settings.load(conn, tenant)
                row = await tenant_settings.store(
                    conn,
                    tenant,
                    rate_per_s=None if reset else (before.rate_per_s if rate is None else rate),
                    burst=None if reset else (before.burst if burst is None else burst),
                    learner=None
                    if reset
                    else (before.learner if learner is None else learns[learner]),
                    checkpoint_retention_days=None
                    if reset
                    else (
                        before.checkpoint_retention_days
                        if checkpoint_days is None
                        else checkpoint_days
                    ),
                    storage_quota_bytes=None
                    if reset
                    else (before.storage_quota_bytes if storage_quota is None else storage_quota),
                    max_state_bytes=None
                    if reset
                    else (before.max_state_bytes if state_limit is None else state_limit),
                )
        finally:
            await conn.close()
        doc = _doc(row, s)
        common.out.print(
            f"tenant {tenant!r}: rate {_shown(doc['rate_per_s'], row.rate_per_s)}, burst "
            f"{_shown(doc['burst'], row.burst)}, learner {_learner(row.learns, row.learner)}, "
            "checkpoints kept "
            f"{_days(doc['checkpoint_retention_days'], row.checkpoint_retention_days)}, "
            "storage quota (bytes) "
            f"{_shown(doc['storage_quota_bytes'], row.storage_quota_bytes)}, state limit "
            f"(bytes) {_shown(doc['max_state_bytes'], row.max_state_bytes)}; "
            f"the workers apply it within {tenant_settings.REFRESH_S:g} s"
        )
        if state_limit is not None and state_limit > s.max_state_bytes:
            common.err.print(
                f"note: ALMA_MAX_STATE_BYTES ({s.max_state_bytes}) is every tenant's ceiling: "
                f"{tenant!r}'s states are held to it, not to {state_limit}",
                markup=False,
            )
        if not s.tenant_topics and (rate is not None or burst is not None):
            common.err.print(
                "note: quotas apply only with ALMA_TENANT_TOPICS=true on the workers "
                "(docs/operations.md, 'Tenants')",
                markup=False,
            )

    common.run(main)


@tenants_app.command("role")
def tenants_role(
    tenant: str = typer.Argument(..., help="The tenant."),
    role: str = typer.Argument(
        ..., help="The tenant's PostgreSQL login role (created, without a password, when new)."
    ),
    remove: bool = typer.Option(
        False, "--remove", help="Unbind the role (it stays, without ALMA's grants)."
    ),
) -> None:
    """Bind a PostgreSQL login role to a tenant: a session logged in as it reads that
    tenant's rows and nothing else, whatever tenant it names (row-level security), and
    writes only its workflows' reducers and its dead letters' replays. Give it, not
    ALMA's own credentials, to the tenant's orchestrator and tools (SDK, CLI, inspector,
    MCP). Needs a role that may create roles (ALMA's owner, as for `alma db upgrade`)."""
    s = common.settings()
    _checked(tenant, s)

    async def main() -> None:
        conn = await common.connect(common.dsn(s))
        try:
            if remove:
                if not await tenant_roles.unbind(conn, tenant, role):
                    common.fail(
                        f"role {role!r} is not bound to tenant {tenant!r} "
                        f"(alma tenants show {tenant} lists its roles)",
                        common.USAGE,
                    )
                common.out.print(
                    f"tenant {tenant!r}: role {role!r} unbound; it reads nothing of ALMA's "
                    "now (the role stays: DROP ROLE is the database administrator's)",
                    markup=False,
                )
                return
            bound = await tenant_roles.bind(conn, tenant, role)
        finally:
            await conn.close()
        common.out.print(
            f"tenant {tenant!r}: role {role!r} bound; its sessions read {tenant!r}'s rows "
            "and nothing else",
            markup=False,
        )
        if bound.created:
            common.err.print(
                f"note: role {role!r} was created without a password: set one "
                f"(ALTER ROLE \"{role}\" PASSWORD '...', or your database's own "
                "authentication) before the tenant connects",
                markup=False,
            )

    common.run(main)


@tenants_app.command("redis-acl")
def tenants_redis_acl(
    tenant: str = typer.Argument(..., help="The tenant."),
    user: str = typer.Option(..., "--user", help="The tenant's own Redis user."),
) -> None:
    """Print the Redis ACL of a tenant's own Redis user (for `redis-cli`; on every node
    of a Redis Cluster): its runs' cache entries and in-flight marks, the partitions'
    epochs, and no other key; no administration. Add its password (`>password`) before
    running it. Give the tenant's orchestrator this user, not ALMA's."""
    s = common.settings()
    _checked(tenant, s)
    rules = cache.tenant_acl_rules(s.redis_prefix, tenant, s.partitions)
    print(shlex.join(["ACL", "SETUSER", user, *rules]))
    common.err.print(
        f"note: {len(rules)} rules for ALMA_REDIS_PREFIX={s.redis_prefix!r} and "
        f"ALMA_PARTITIONS={s.partitions}; add the user's password ('>password') and run it "
        "with redis-cli against ALMA's Redis (every node of a cluster); print it again "
        "after changing either setting",
        markup=False,
    )
