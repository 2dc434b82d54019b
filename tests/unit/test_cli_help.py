"""The command line's help, as a newcomer reads it: a flag is shown as a flag (no
`<bool>` as if it took a value), and every `--json` says what it prints."""

from __future__ import annotations

from typer.testing import CliRunner

from alma_core.cli import app
from tests.unit.test_readme import cli_paths


def test_flags_take_no_value_and_every_json_option_says_what_it_prints() -> None:
    runner = CliRunner()
    with_json = 0
    for words in sorted(cli_paths()):
        shown = runner.invoke(app, [*words, "--help"], terminal_width=100)
        assert shown.exit_code == 0, (words, shown.output)
        assert "<bool>" not in shown.output, words
        lines = shown.output.splitlines()
        for i, line in enumerate(lines):
            if line.strip().startswith("--json"):
                with_json += 1
                described = (line.strip().removeprefix("--json") + lines[i + 1]).strip()
                assert described.startswith("Print "), (words, line)
    assert with_json >= 10


def test_the_demo_says_what_its_time_measures_and_what_to_do_next() -> None:
    from rich.console import Console

    from alma_core.cli.demo import _next, _summary
    from alma_core.cli.demo_workflows import DemoReport

    console = Console(width=300, record=True)
    console.print(_summary(DemoReport(), 2.04, 16.3))
    title = console.export_text().splitlines()[0].strip()
    assert title == (
        "ALMA Stream demo: 0 workflow runs, learned and retrieved in 2.0 s (16.3 s with start-up)"
    )
    stopped = _next("http://127.0.0.1:1/metrics", kept=False)
    assert stopped.index("start `alma up` here") < stopped.index("alma runs list --tenant acme")
    assert "metrics:" not in stopped, "a stopped stack's metrics URL answers nothing"
    running = _next("http://127.0.0.1:1/metrics", kept=True)
    assert running.startswith("metrics: http://127.0.0.1:1/metrics")
