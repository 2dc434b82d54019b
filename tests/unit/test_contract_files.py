"""The JSON Schema files in schemas/ are exactly what the models export."""

from __future__ import annotations

import json

from alma_core.schemas import export


def test_schema_files_match_models() -> None:
    assert export.drift() == [], "run `alma schemas export` and commit schemas/*.json"


def test_every_event_type_has_a_schema_file() -> None:
    names = set(export.documents())
    assert {
        "node.started.json",
        "node.completed.json",
        "node.failed.json",
        "branch.join.json",
        "workflow.completed.json",
        "merge.reply.json",
        "event.json",
    } <= names
    for text in export.documents().values():
        schema = json.loads(text)
        assert schema["$schema"].endswith("2020-12/schema")


def test_drift_is_detected(tmp_path: object) -> None:
    from pathlib import Path

    folder = Path(str(tmp_path))
    export.write(folder)
    assert export.drift(folder) == []
    (folder / "node.completed.json").write_text("{}\n")
    assert export.drift(folder) == ["node.completed.json"]
