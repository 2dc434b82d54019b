"""How the run inspector's pages are rendered: the Jinja2 environment over
``templates/``, every value made visible (control and bidirectional characters as
escapes) and escaped, and the filters the templates use."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

from jinja2 import Environment, FileSystemLoader, select_autoescape
from markupsafe import Markup, escape

from alma_core import history
from alma_core.text import shell_word
from alma_core.ui import views

HERE = Path(__file__).parent


def environment() -> Environment:
    env = Environment(
        loader=FileSystemLoader(HERE / "templates"),
        autoescape=select_autoescape(default=True, default_for_string=True),
        trim_blocks=True,
        lstrip_blocks=True,
        finalize=views.visible,  # control and bidirectional characters as escapes, everywhere
    )
    env.tests["absent"] = lambda value: value is history.ABSENT  # beside a null
    env.filters["json"] = views.shown_json
    env.filters["raw"] = views.shown_bytes
    env.filters["when"] = when
    env.filters["took"] = views.took
    # an id in a command to copy: shown without its control characters, and pasted
    # into a shell it is the id again (``$'\u202e...'``); escaped for HTML here
    env.filters["sh"] = lambda text: Markup(escape(shell_word(str(text))))
    env.filters["counted"] = views.counted  # "1 run", "2 runs"
    env.filters["pointer"] = lambda key: history.pointer("", key)  # a field's JSON Pointer
    return env


def when(at: datetime | None, ms: bool = False) -> str:
    """A time as shown: in UTC, and saying so (the forms' times are UTC too); to the
    millisecond with ``ms`` (a run's history, where events come milliseconds apart)."""
    if at is None:
        return ""
    shown = at.astimezone(UTC)
    if ms:
        return shown.strftime("%Y-%m-%d %H:%M:%S.") + f"{shown.microsecond // 1000:03d} UTC"
    return shown.strftime("%Y-%m-%d %H:%M:%S UTC")
