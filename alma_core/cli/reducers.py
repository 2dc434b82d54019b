"""``alma reducers`` (list, set, show a workflow's reducers) and ``alma schemas``
(the event contract's JSON Schema files)."""

from __future__ import annotations

import json
from pathlib import Path

import typer
from rich.table import Table

from alma_core import errors, reducers
from alma_core.cli import common
from alma_core.storage import reducer_configs

reducers_app = common.app(help="Reducers.")
TENANT_HELP = "The workflow's tenant; default ALMA_TENANT (one of them is required)."
schemas_app = common.app(help="The event contract's JSON Schema files.")


def register(app: typer.Typer) -> None:
    app.add_typer(reducers_app, name="reducers")
    app.add_typer(schemas_app, name="schemas")


@schemas_app.command("export")
def schemas_export(
    check: bool = typer.Option(False, "--check", help="Fail if files drift."),
) -> None:
    """Regenerate schemas/*.json from the pydantic models."""
    from alma_core.schemas import export

    raise typer.Exit(export.main(["--check"] if check else []))


@reducers_app.command("list")
def reducers_list(as_json: bool = common.json_option("the reducers")) -> None:
    """Reducers available by name (built-ins and the alma.reducers entry points)."""
    registry = reducers.default_registry()
    rows = [registry.get(n) for n in registry.names()]
    if as_json:
        print(
            json.dumps(
                [{"name": r.name, "expects": r.expects, "associative": r.associative} for r in rows]
            )
        )
        return
    table = Table(title="reducers")
    for col in ("name", "expects", "associative"):
        table.add_column(col)
    for r in rows:
        table.add_row(r.name, r.expects, "yes" if r.associative else "no")
    common.out.print(table)


@reducers_app.command("set")
def reducers_set(
    workflow_id: str = typer.Argument(..., help="The workflow."),
    config_file: Path = typer.Argument(
        ...,
        help='JSON: {"reducers": {"field": "name"}, '
        '"default_reducer": "last_value", "strict": false}',
    ),
    tenant: str = typer.Option(None, "--tenant", help=TENANT_HELP),
) -> None:
    """Register a workflow's reducers; joins and `updates` of its runs use them."""
    s = common.settings()
    who = common.tenant(s, tenant, required=True) or ""
    try:
        data = json.loads(config_file.read_text())
    except OSError as exc:
        common.fail(f"cannot read {config_file}: {exc.strerror}", common.USAGE)
    except json.JSONDecodeError as exc:
        common.fail(f"{config_file} is not JSON: {exc}", common.USAGE)
    unknown = (
        set(data) - {"reducers", "default_reducer", "strict"} if isinstance(data, dict) else {}
    )
    if not isinstance(data, dict) or unknown or not isinstance(data.get("reducers", {}), dict):
        common.fail(
            f'{config_file} must be an object with "reducers" (an object '
            'of field -> reducer name), optional "default_reducer" and "strict"'
            + (f"; unknown keys: {', '.join(sorted(unknown))}" if unknown else ""),
            common.USAGE,
        )
    config = reducers.ReducerConfig.from_json(data)
    try:
        config.validate()
    except errors.UnknownReducer as exc:
        common.fail(f"{config_file}: {exc.message} (`alma reducers list`)", common.USAGE)

    async def main() -> None:
        conn = await common.connect(common.dsn(s))
        try:
            await reducer_configs.save(conn, who, workflow_id, config)  # validates names first
        finally:
            await conn.close()
        common.out.print(f"reducers of workflow {workflow_id!r} (tenant {who!r}) saved")

    common.run(main)


@reducers_app.command("show")
def reducers_show(
    workflow_id: str = typer.Argument(..., help="The workflow."),
    tenant: str = typer.Option(None, "--tenant", help=TENANT_HELP),
) -> None:
    """A workflow's registered reducers, as JSON."""
    s = common.settings()
    who = common.tenant(s, tenant, required=True) or ""

    async def main() -> None:
        conn = await common.connect(common.dsn(s))
        try:
            config = await reducer_configs.load(conn, who, workflow_id)
        finally:
            await conn.close()
        if config is None:
            raise errors.AlmaError(
                f"no reducers registered for workflow {workflow_id!r} of tenant {who!r}: "
                "`alma reducers set` registers them (runs use last_value meanwhile)"
            )
        print(json.dumps(config.to_json()))

    common.run(main)
