"""``python -m alma_core.cli``: the same as the ``alma`` command."""

from alma_core.cli import app

app(prog_name="alma")
