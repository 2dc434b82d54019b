"""The ``alma`` command line: one module per command group. Human tables by default,
``--json`` for scripts.

Exit codes: 0 done; 1 the operation failed, a service that does not answer included
(the message says what to do next); 2 wrong usage or settings, an install without
the ``cli`` extra included (like a missing setting, it is fixed before running again).
No password of a DSN or URL is ever printed (:func:`alma_core.logs.redact`).
"""

from __future__ import annotations

import sys

try:
    import typer
except ImportError:  # pragma: no cover - an install without the `cli` extra
    sys.stderr.write(
        "error: the `alma` command needs the cli extra: pip install 'alma-stream[cli]'\n"
    )
    raise SystemExit(2) from None

from alma_core.cli import (
    common,
    db,
    demo,
    dlq,
    mcp,
    memory,
    offsets,
    reducers,
    replay,
    runs,
    stack,
    tenant_access,
    tenants,
    timeline,
    topics,
    ui,
)

PACKAGE = "alma-stream"

# Locals in a traceback could hold a DSN with its password: never shown.
app = common.app(
    help="ALMA Stream: workflow memory over Kafka, Postgres and Redis.",
    pretty_exceptions_show_locals=False,
)
for group in (
    stack,
    db,
    topics,
    offsets,
    reducers,
    runs,
    timeline,
    replay,
    dlq,
    tenants,
    tenant_access,
    memory,
    demo,
    mcp,
    ui,
):
    group.register(app)


def version() -> str:
    """The installed package's version (``unknown`` when run from a source tree that
    was never installed)."""
    from importlib import metadata

    try:
        return metadata.version(PACKAGE)
    except metadata.PackageNotFoundError:
        return "unknown"


def _print_version(value: bool) -> None:
    if value:
        print(f"alma {version()}")
        raise typer.Exit(0)


@app.callback()
def main(
    show_version: bool = typer.Option(
        False,
        "--version",
        help="Print the version and exit.",
        callback=_print_version,
        is_eager=True,
    ),
) -> None:
    """ALMA Stream: workflow memory over Kafka, Postgres and Redis."""
