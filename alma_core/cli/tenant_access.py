"""``alma tenants add`` and ``remove``: a tenant's access to a shared ALMA, made and
taken away in one command (docs/operations.md, "A shared ALMA in one command").

``add T`` makes, in this order (each step safe to run again, so a failed ``add`` is
finished by running it again):

1. T's lifecycle and reply topics (tenant topics);
2. T's Kafka principal ``User:T``, its SCRAM-SHA-512 password generated, and the four
   literal ACLs of an orchestrator (alma_core/messaging/acls.py);
3. T's PostgreSQL login role ``T``, bound to T (row-level security: it reads T's rows
   and nothing else), with a generated password;
4. T's Redis user ``T`` with T's key patterns only, saved to the ACL file where Redis
   has one;

then prints T's orchestrator's settings once: ALMA keeps no copy of the passwords.
``remove T`` takes every one of them away (the topics with what they hold; T's runs,
checkpoints and memories in PostgreSQL stay, retention's to remove).
"""

from __future__ import annotations

import contextlib
import json
import shlex
from typing import Any
from urllib.parse import quote, urlsplit, urlunsplit

import typer

from alma_core import errors
from alma_core.cli import common, embedded_secure
from alma_core.cli.tenants import _checked, tenants_app
from alma_core.cli.topics import ensure_topics, tenant_topics
from alma_core.messaging import acls, kafka, kafka_admin
from alma_core.settings import Settings
from alma_core.storage import cache, tenant_roles

PG_NAME_BYTES = 63  # PostgreSQL's identifier limit (NAMEDATALEN - 1)


def register(app: typer.Typer) -> None:
    """Adds the commands to ``alma tenants`` (``app`` has that group already)."""
    tenants_app.command("add")(add)
    tenants_app.command("remove")(remove)


def _needs(s: Settings, tenant: str) -> None:
    """Exit 2 where ``add``/``remove`` cannot do what they say: no tenant topics, no
    SCRAM admin on the broker, or a tenant id that cannot name all three identities."""
    if not s.tenant_topics:
        common.fail(
            "a tenant's own access needs tenant topics (ALMA_TENANT_TOPICS=true). What to do: "
            "start the stack with `alma up --secure`, or set ALMA_TENANT_TOPICS on the workers "
            "and here",
            common.USAGE,
        )
    if s.kafka_sasl_mechanism != embedded_secure.MECHANISM:
        common.fail(
            "a tenant's Kafka principal is a SCRAM-SHA-512 user, made by an admin principal "
            "that signs in with SCRAM-SHA-512 (ALMA_KAFKA_SASL_MECHANISM and its "
            "username and password). What to do: run it beside `alma up --secure` (it "
            "acts as that stack's admin), or set an admin's credentials",
            common.USAGE,
        )
    _checked(tenant, s)
    if tenant in embedded_secure.STACK_PRINCIPALS:
        common.fail(f"{tenant!r} is the name of ALMA's own principal: choose another", 2)
    if len(tenant.encode()) > PG_NAME_BYTES:
        common.fail(
            f"tenant {tenant!r} is {len(tenant.encode())} bytes: its PostgreSQL role's name "
            f"can be {PG_NAME_BYTES} at most. What to do: use a shorter tenant id",
            common.USAGE,
        )


async def _command(client: Any, *args: str) -> Any:
    """A raw Redis command (redis-py's ACL calls take no rule list as ACL SETUSER does)."""
    return await client.execute_command(*args)


def _with_login(url: str, user: str, password: str) -> str:
    """``url`` (one service) with ``user`` and ``password`` in place of its own."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    netloc = f"{quote(user, safe='')}:{quote(password, safe='')}@{host}"
    if parts.port:
        netloc += f":{parts.port}"
    return urlunsplit(parts._replace(netloc=netloc))


def add(
    tenant: str = typer.Argument(
        ..., help="The tenant's id (its topics', principal's, role's name)."
    ),
    as_json: bool = common.json_option("the tenant's settings"),
) -> None:
    """Give a tenant its own access: its topics, Kafka principal and ACLs, PostgreSQL
    role and Redis user, each with a generated password; print its orchestrator's
    settings (once: ALMA keeps no copy of the passwords). Run again to finish one that
    failed halfway, or to give the tenant new passwords."""
    s = common.settings()
    _needs(s, tenant)
    password = embedded_secure.new_password()

    async def main() -> dict[str, Any]:
        bootstrap = common.bootstrap(s)
        topics = tenant_topics(s, tenant)
        try:
            await ensure_topics(
                bootstrap,
                topics,
                partitions=s.partitions,
                replication_factor=s.replication_factor,
                client_options=kafka.client_options(s),
                max_record_bytes=s.max_record_bytes,
            )
            async with kafka_admin.connected(bootstrap, s) as admin:
                await kafka_admin.set_scram_password(admin, tenant, password)
                granted = acls.for_role("orchestrator", s, tenant)
                await kafka_admin.grant(admin, f"User:{tenant}", granted)
        except errors.AlmaError:
            raise
        except Exception as exc:
            raise common.kafka_unavailable(bootstrap, f"add tenant {tenant!r}", exc) from exc
        dsn = common.dsn(s)
        conn = await common.connect(dsn)
        try:
            await tenant_roles.bind(conn, tenant, tenant)
            await tenant_roles.set_password(conn, tenant, password)
        finally:
            await conn.close()
        redis_url = common.redis_url(s)
        saved = await _redis_user(redis_url, tenant, password, s)
        env = {
            "ALMA_KAFKA_BOOTSTRAP": bootstrap,
            "ALMA_KAFKA_SECURITY_PROTOCOL": s.kafka_security_protocol,
            "ALMA_KAFKA_SASL_MECHANISM": embedded_secure.MECHANISM,
            "ALMA_KAFKA_SASL_USERNAME": tenant,
            "ALMA_KAFKA_SASL_PASSWORD": password,
            **({"ALMA_KAFKA_SSL_CAFILE": str(s.kafka_ssl_cafile)} if s.kafka_ssl_cafile else {}),
            "ALMA_TENANT_TOPICS": "true",
            "ALMA_TENANT": tenant,
            "ALMA_PARTITIONS": str(s.partitions),
            "ALMA_POSTGRES_DSN": _with_login(dsn, tenant, password),
            "ALMA_REDIS_URL": _with_login(redis_url, tenant, password),
        }
        return {
            "tenant": tenant,
            "topics": topics,
            "acls": len(granted),
            "saved": saved,
            "env": env,
        }

    done = common.run(main)
    if as_json:
        print(json.dumps(done["env"], indent=2))
    else:
        for name, value in done["env"].items():
            print(f"{name}={shlex.quote(value)}")
    unsaved = "" if done["saved"] else " (Redis has no ACL file: it lasts until Redis restarts)"
    common.err.print(
        f"tenant {tenant!r}: topics {', '.join(done['topics'])}; Kafka principal "
        f"User:{tenant} with {done['acls']} ACLs; PostgreSQL role {tenant!r}; Redis user "
        f"{tenant!r}{unsaved}. "
        "The settings above are its orchestrator's, shown once (ALMA keeps no copy of the "
        "passwords): hand them to the tenant over a private channel; `alma tenants add` "
        "again gives it new passwords, `alma tenants remove` takes its access away",
        markup=False,
        soft_wrap=True,
    )


async def _redis_user(url: str, tenant: str, password: str, s: Settings) -> bool:
    """Create (or reset) ``tenant``'s Redis user; whether Redis saved it to its ACL file."""
    import redis.asyncio as aioredis
    from redis.exceptions import RedisError

    if "," in url:
        raise errors.ConfigError(
            "ALMA_REDIS_URL names a Redis Cluster: a user is made on each node. What to do: "
            f"run `alma tenants redis-acl {tenant} --user {tenant}` and the ACL it prints, with "
            "the password, on every node"
        )
    rules = cache.tenant_acl_rules(s.redis_prefix, tenant, s.partitions)
    client = aioredis.Redis.from_url(url, socket_timeout=10)
    try:
        await _command(client, "ACL", "SETUSER", tenant, "reset", *rules, f">{password}")
        try:
            await _command(client, "ACL", "SAVE")
        except RedisError:  # no aclfile: the user lives until Redis restarts
            return False
        return True
    except RedisError as exc:
        raise errors.CacheError(
            f"Redis refused to make the user {tenant!r}: {exc}. What to do: run this with "
            "Redis credentials that may (ACL SETUSER), such as ALMA's own"
        ) from exc
    finally:
        await client.aclose()


def remove(
    tenant: str = typer.Argument(..., help="The tenant."),
) -> None:
    """Take a tenant's access away: its Kafka principal and ACLs, its topics (with the
    events they hold), its PostgreSQL role and Redis user. Its runs, checkpoints and
    memories stay in PostgreSQL (retention removes them)."""
    s = common.settings()
    _needs(s, tenant)

    async def main() -> list[str]:
        bootstrap = common.bootstrap(s)
        gone: list[str] = []
        try:
            async with kafka_admin.connected(bootstrap, s) as admin:
                removed = await kafka_admin.revoke_all(admin, f"User:{tenant}")
                existing = set(await admin.list_topics())
                topics = [t for t in tenant_topics(s, tenant) if t in existing]
                if removed or topics:  # never a principal made up for a mistyped name
                    await kafka_admin.disable_scram(admin, tenant)
                    gone.append(f"{removed} ACLs; principal User:{tenant}'s sign-in")
                if topics:
                    await admin.delete_topics(topics)
                    gone.append(f"topics {', '.join(topics)}")
        except Exception as exc:
            raise common.kafka_unavailable(bootstrap, f"remove tenant {tenant!r}", exc) from exc
        conn = await common.connect(common.dsn(s))
        try:
            if await tenant_roles.unbind(conn, tenant, tenant):
                await tenant_roles.drop(conn, tenant)
                gone.append(f"PostgreSQL role {tenant!r}")
        finally:
            await conn.close()
        import redis.asyncio as aioredis
        from redis.exceptions import RedisError

        client = aioredis.Redis.from_url(common.redis_url(s), socket_timeout=10)
        try:
            if await _command(client, "ACL", "DELUSER", tenant):
                gone.append(f"Redis user {tenant!r}")
                with contextlib.suppress(RedisError):  # no aclfile: nothing to save
                    await _command(client, "ACL", "SAVE")
        finally:
            await client.aclose()
        return gone

    gone = common.run(main)
    if not gone:
        common.fail(f"tenant {tenant!r} had no access to take away (alma tenants add makes it)")
    common.out.print(
        f"tenant {tenant!r}: removed {'; '.join(gone)}. Its runs, checkpoints and memories "
        "stay in PostgreSQL until retention removes them",
        markup=False,
    )
