"""The ``alma`` command line: one module per command group. Human tables by default,
``--json`` for scripts.

Exit codes: 0 done; 1 the operation failed (the message says what to do next);
2 wrong usage or settings.
"""

from __future__ import annotations

try:
    import typer
except ImportError:  # pragma: no cover - an install without the `cli` extra
    raise SystemExit(
        "the `alma` command needs the cli extra: pip install 'alma-stream[cli]'"
    ) from None

from alma_core.cli import db, demo, dlq, mcp, memory, offsets, reducers, runs, stack, topics

app = typer.Typer(help="ALMA Stream: workflow memory over Kafka, Postgres and Redis.")
for group in (stack, db, topics, offsets, reducers, runs, dlq, memory, demo, mcp):
    group.register(app)
