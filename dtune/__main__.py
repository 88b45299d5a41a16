"""`python -m dtune`: the dtune CLI."""

from dtune.cli.main import app

app(prog_name="dtune")
