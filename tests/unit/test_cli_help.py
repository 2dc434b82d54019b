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
