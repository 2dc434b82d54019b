"""Write the JSON Schema of every event and reply next to this file.

python -m alma_core.schemas.export          # regenerate schemas/*.json
python -m alma_core.schemas.export --check  # exit 1 when the files drift from the models
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from pydantic import BaseModel

from alma_core.schemas.events import CONTRACT_VERSION, EVENT_MODELS, MergeReply, event_adapter

SCHEMA_DIR = Path(__file__).parent


def documents() -> dict[str, str]:
    """File name -> JSON Schema text, for every contract document."""
    models: dict[str, type[BaseModel]] = {
        f"{event_type.value}.json": model for event_type, model in EVENT_MODELS.items()
    }
    models["merge.reply.json"] = MergeReply
    out = {name: _render(model.model_json_schema(), name) for name, model in models.items()}
    out["event.json"] = _render(event_adapter.json_schema(), "event.json")
    return out


def _render(schema: dict[str, object], name: str) -> str:
    schema = {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": f"https://alma-stream.dev/schemas/v{CONTRACT_VERSION}/{name}",
        **schema,
    }
    return json.dumps(schema, indent=2, sort_keys=True) + "\n"


def write(directory: Path = SCHEMA_DIR) -> list[Path]:
    written = []
    for name, text in documents().items():
        path = directory / name
        path.write_text(text)
        written.append(path)
    return written


def drift(directory: Path = SCHEMA_DIR) -> list[str]:
    """Names of the files that are missing or differ from the models."""
    return [
        name
        for name, text in documents().items()
        if not (directory / name).exists() or (directory / name).read_text() != text
    ]


def main(argv: list[str]) -> int:
    if "--check" in argv:
        stale = drift()
        if stale:
            print(f"JSON Schema files out of date: {', '.join(stale)}; run `alma schemas export`")
            return 1
        print("JSON Schema files match the models")
        return 0
    for path in write():
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
