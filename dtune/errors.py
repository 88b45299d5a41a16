"""Error types shared across layers (no heavy imports: the CLI catches them before torch or Triton is loaded)."""

from __future__ import annotations


class FileProblem(ValueError):
    """A file dtune reads that cannot be used: a tuned-config file, a search space. The message names the file and
    the problem, so the CLI prints it as one line (exit 2)."""
