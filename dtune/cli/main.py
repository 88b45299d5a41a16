"""The ``dtune`` command: ``search``, ``export``, ``list``, ``bench``, ``profile``, ``verify`` and ``report``.

Command modules keep heavy imports (torch, triton, the kernels) inside their functions, so that
``dtune search --interpret`` can set TRITON_INTERPRET before Triton is imported.
"""

from __future__ import annotations

import typer

from dtune.cli import export, listing, measure, report, search

app = typer.Typer(
    name="dtune",
    help="Autotuned, correctness-gated Triton kernels for delta-rule linear attention.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

# Each command module has `register(app)`. To add commands, import the module above and list it here.
COMMAND_MODULES = [search, export, listing, measure, report]

for _module in COMMAND_MODULES:
    _module.register(app)


def main() -> None:  # pragma: no cover - console entry point alternative
    app()


if __name__ == "__main__":  # pragma: no cover
    main()
