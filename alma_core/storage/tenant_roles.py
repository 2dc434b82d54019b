"""A tenant's own PostgreSQL roles: the read path bound to who asks (guarantee 6).

A login role bound to a tenant (``alma tenants role TENANT ROLE``) is granted
``alma_tenant`` and mapped in ``tenant_roles``; row-level security (migration 0022) then
lets a session logged in as it read that tenant's rows and nothing else, whatever
tenant its queries or its settings name, through every path that reads with its
credentials (the SDK, the CLI, the inspector, MCP). A role maps to one tenant; a tenant
may have several (a new one beside the old while its credential moves).

ALMA's own roles (a superuser, one that bypasses row-level security, the one binding,
which runs ALMA) are never bound: row-level security does not restrict them, so a
binding would promise what it does not keep.
"""

from __future__ import annotations

from dataclasses import dataclass

import asyncpg

from alma_core import errors

GROUP = "alma_tenant"


@dataclass(frozen=True)
class Bound:
    role: str
    tenant_id: str
    created: bool  # the login role did not exist and was created (without a password)


async def _quoted(conn: asyncpg.Connection, role: str) -> str:
    quoted: str = await conn.fetchval("SELECT quote_ident($1)", role)
    return quoted


async def bind(conn: asyncpg.Connection, tenant_id: str, role: str) -> Bound:
    """Bind ``role`` to ``tenant_id``: create it (LOGIN, no password: set one with
    ``ALTER ROLE``) if it does not exist, grant it ``alma_tenant``, map it. Binding it
    again to the same tenant changes nothing; to another tenant is refused."""
    if not role:
        raise errors.ConfigError("a role name is needed (e.g. acme_orch)")
    async with conn.transaction():
        mapped = await conn.fetchval(
            "SELECT tenant_id FROM tenant_roles WHERE role_name = $1", role
        )
        if mapped is not None and mapped != tenant_id:
            raise errors.ConfigError(
                f"role {role!r} is bound to tenant {mapped!r}: a role reads for one tenant. "
                f"What to do: give {tenant_id!r} a role of its own, or unbind it first "
                f"(alma tenants role {mapped} {role} --remove)"
            )
        found = await conn.fetchrow(
            """SELECT rolsuper, rolbypassrls, rolname = current_user AS is_me,
                      EXISTS (SELECT 1 FROM pg_tables t
                              WHERE t.schemaname = current_schema()
                                AND t.tablename = 'runs' AND t.tableowner = r.rolname)
                        AS owns
               FROM pg_roles r WHERE rolname = $1""",
            role,
        )
        if found is not None and (
            found["rolsuper"] or found["rolbypassrls"] or found["is_me"] or found["owns"]
        ):
            raise errors.ConfigError(
                f"role {role!r} is one of ALMA's own (a superuser, a role that bypasses "
                "row-level security, or the owner of ALMA's tables): row-level security "
                "does not restrict it, so it cannot be bound to a tenant. What to do: "
                "create a login role for the tenant alone (alma tenants role creates it "
                "when the name is new)"
            )
        quoted = await _quoted(conn, role)
        if found is None:
            await conn.execute(f"CREATE ROLE {quoted} LOGIN")
        await conn.execute(f"GRANT {GROUP} TO {quoted}")
        await conn.execute(
            """INSERT INTO tenant_roles (role_name, tenant_id) VALUES ($1, $2)
               ON CONFLICT (role_name) DO NOTHING""",
            role,
            tenant_id,
        )
    return Bound(role, tenant_id, created=found is None)


async def unbind(conn: asyncpg.Connection, tenant_id: str, role: str) -> bool:
    """Take ``role`` from ``tenant_id``: unmap it and revoke ``alma_tenant`` (the role
    itself stays, a database administrator's to drop). False: it was not bound to it."""
    async with conn.transaction():
        gone = await conn.fetchval(
            "DELETE FROM tenant_roles WHERE role_name = $1 AND tenant_id = $2 RETURNING true",
            role,
            tenant_id,
        )
        if gone and await conn.fetchval("SELECT true FROM pg_roles WHERE rolname = $1", role):
            await conn.execute(f"REVOKE {GROUP} FROM {await _quoted(conn, role)}")
    return bool(gone)


async def roles_of(conn: asyncpg.Connection, tenant_id: str) -> list[str]:
    """The login roles bound to ``tenant_id``, by name."""
    rows = await conn.fetch(
        "SELECT role_name FROM tenant_roles WHERE tenant_id = $1 ORDER BY role_name", tenant_id
    )
    return [r["role_name"] for r in rows]


async def session_tenant(conn: asyncpg.Connection) -> str | None:
    """The tenant this connection's login role is bound to ('' for a tenant role bound
    to none; None for ALMA's own roles, which read any tenant they name)."""
    tenant: str | None = await conn.fetchval("SELECT alma_session_tenant()")
    return tenant


async def set_password(conn: asyncpg.Connection, role: str, password: str) -> None:
    """Give ``role`` ``password`` (PostgreSQL stores its SCRAM verifier; the statement
    is not logged by ALMA)."""
    literal = await conn.fetchval("SELECT quote_literal($1)", password)
    await conn.execute(f"ALTER ROLE {await _quoted(conn, role)} PASSWORD {literal}")


async def drop(conn: asyncpg.Connection, role: str) -> None:
    """Drop ``role`` (one made for a tenant by ``alma tenants add``, unbound first)."""
    await conn.execute(f"DROP ROLE IF EXISTS {await _quoted(conn, role)}")


async def tenants(conn: asyncpg.Connection) -> list[str]:
    """The tenants with a login role bound (``alma tenants add`` binds one)."""
    rows = await conn.fetch("SELECT DISTINCT tenant_id FROM tenant_roles ORDER BY tenant_id")
    return [r["tenant_id"] for r in rows]
