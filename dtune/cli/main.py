"""The ``dtune`` command: ``tune-gpu``, ``search``, ``export``, ``list``, ``bench``, ``profile``, ``verify``,
``report``; ``dtune --version`` prints dtune's version and torch's, triton's and Python's.

Command modules keep heavy imports (torch, triton, the kernels) inside their functions, so that
``dtune search --interpret`` can set TRITON_INTERPRET before Triton is imported.

Every command is :func:`~dtune.cli.common.guarded`: a file-system or config error ends it with one line naming the
path and the problem (exit 2). Help is click's plain layout (``rich_markup_mode=None``): at any terminal width it
shows every flag name whole, where rich's panels cut them.
"""

from __future__ import annotations

import platform
from collections.abc import Callable
from importlib import metadata
from typing import Annotated, Any

import typer

import dtune
from dtune.cli import export, listing, measure, report, search, tune_gpu
from dtune.cli.common import guarded


class App(typer.Typer):
    """A typer app whose commands are all :func:`~dtune.cli.common.guarded`."""

    def command(self, *args: Any, **kwargs: Any) -> Callable[[Callable[..., Any]], Callable[..., Any]]:  # type: ignore[override]
        register = super().command(*args, **kwargs)

        def decorator(f: Callable[..., Any]) -> Callable[..., Any]:
            register(guarded(f))
            return f

        return decorator


app = App(
    name="dtune",
    help="Autotuned, correctness-gated Triton kernels for delta-rule linear attention.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)


def version_line() -> str:
    """``dtune 0.1.0 (torch 2.9.1, triton 3.5.1, python 3.11.9)``: read from the installed packages' metadata, so
    neither torch nor Triton is imported."""

    def installed(name: str) -> str:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return "not installed"

    return (
        f"dtune {dtune.__version__} (torch {installed('torch')}, triton {installed('triton')}, "
        f"python {platform.python_version()})"
    )


def _print_version(value: bool) -> None:
    if value:
        typer.echo(version_line())
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool,
        typer.Option(
            "--version", callback=_print_version, is_eager=True, help="Print the versions of dtune, torch and triton."
        ),
    ] = False,
) -> None:
    pass


# Each command module has `register(app)`. To add commands, import the module above and list it here.
COMMAND_MODULES = [tune_gpu, search, export, listing, measure, report]

for _module in COMMAND_MODULES:
    _module.register(app)


def main() -> None:  # pragma: no cover - console entry point alternative
    app()


if __name__ == "__main__":  # pragma: no cover
    main()
