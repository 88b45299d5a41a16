"""dtune's command line (typer + rich). :mod:`dtune.cli.main` builds the app from the command modules."""
