"""``alma ui``: the run inspector in a browser (:mod:`alma_core.ui`), served until
Ctrl-C. Read-only unless ``--allow-writes``; on 127.0.0.1 unless told otherwise."""

from __future__ import annotations

import asyncpg
import typer

from alma_core import errors
from alma_core.cli import common
from alma_core.settings import Settings
from alma_core.storage import tenant_roles


def register(app: typer.Typer) -> None:
    app.command("ui")(ui)


def ui(
    host: str = typer.Option("127.0.0.1", help="Address to listen on (another exposes it)."),
    port: int = typer.Option(8765, min=0, max=65535, help="Port to listen on."),
    tenant: str = typer.Option(
        None, "--tenant", help="Show this tenant's runs only (default: ALMA_TENANT)."
    ),
    tenant_header: str = typer.Option(
        None,
        "--tenant-header",
        help="Take each request's tenant from this header (set by a proxy that "
        "authenticates people) instead of pinning one.",
    ),
    allow_writes: bool = typer.Option(
        False, "--allow-writes", help="Enable forking from a checkpoint and replaying dead letters."
    ),
    allowed_host: list[str] = typer.Option(
        None,
        "--allowed-host",
        help="A host name people open the inspector by (repeat for several; *.example.com "
        "for a domain's). Default: 127.0.0.1, localhost, ::1 and --host's address. Other "
        "names are refused (DNS rebinding).",
    ),
) -> None:
    """Serve the run inspector: runs, a run's timeline by branch, each checkpoint's
    state, diffs and merges, dead letters, memory retrieval."""
    try:
        import uvicorn

        from alma_core.ui import create_app
        from alma_core.ui.views import LOOPBACK_HOSTS
    except ImportError:
        common.fail("`alma ui` needs the ui extra: pip install 'alma-stream[ui]'", common.USAGE)
    s = common.resolved(common.settings())
    pinned = None if tenant_header else common.tenant(s, tenant, required=False)
    if pinned is None and not tenant_header and s.require_tenant:
        pinned = common.run(lambda: _bound_tenant(s))  # a tenant's own role: its tenant
    names = allowed_hosts(host, allowed_host or [], LOOPBACK_HOSTS)
    try:
        app = create_app(
            s,
            tenant=pinned,
            tenant_header=tenant_header,
            allow_writes=allow_writes,
            allowed_hosts=names,
        )
    except errors.ConfigError as exc:
        common.fail(exc.message, common.USAGE)
    where = f"http://{host}:{port}/"
    mode = "reads and writes" if allow_writes else "read-only"
    common.err.print(
        f"run inspector at {where} ({mode}; answers to {', '.join(names)}; Ctrl-C stops)",
        markup=False,
    )
    if s.gc_freeze:  # a page's full collections walk what it made, not the start-up objects
        from alma_core.heap import freeze_heap

        freeze_heap()
    config = uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="on")
    common.run(uvicorn.Server(config).serve)


async def _bound_tenant(s: Settings) -> str | None:
    """The tenant ALMA_POSTGRES_DSN's role is bound to (``alma tenants role``), if any:
    an inspector started with a tenant's own credentials shows that tenant."""
    conn = await common.connect(common.dsn(s))
    try:
        return await tenant_roles.session_tenant(conn) or None
    except asyncpg.UndefinedFunctionError:  # a schema before 0022: no tenant roles yet
        return None
    finally:
        await conn.close()


def allowed_hosts(host: str, given: list[str], loopback: tuple[str, ...]) -> list[str]:
    """The names the inspector answers to: those given, else loopback and the address it
    listens on (a wildcard address names none: people reach it by names given)."""
    if given:
        return given
    names = list(loopback)
    if host not in ("0.0.0.0", "::", "") and host not in names:
        names.append(host)
    return names
