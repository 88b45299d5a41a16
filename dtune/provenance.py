"""Which source a result came from: the commit recorded in ``run.json``, ``bench.csv`` and ``profile.csv``, and the
command line that made it."""

from __future__ import annotations

import datetime
import os
import shlex
import subprocess
import sys
from pathlib import Path

ENV = "DTUNE_COMMIT"


def git_commit() -> str | None:
    """The source tree's commit: ``$DTUNE_COMMIT`` when set (where the code runs as a copy of the working tree whose
    ``.git`` is missing or older than the tree, e.g. on a GPU machine), else ``git rev-parse HEAD`` of the checkout,
    else None."""
    if os.environ.get(ENV):
        return os.environ[ENV]
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            cwd=Path(__file__).resolve().parent,
            capture_output=True,
            text=True,
            timeout=5,
            check=False,
        )
        found = out.stdout.strip() if out.returncode == 0 else ""
    except (OSError, subprocess.SubprocessError):
        found = ""
    return found or None


def stamp(*facts: str) -> str:
    """``facts`` (the empty ones left out), then this source's short commit and today's date, comma-separated: the tail
    of a ``measured_by`` line, e.g. ``3 rounds, commit 2d7cbf2, 2026-12-07``."""
    commit = str(git_commit() or "")[:7]
    parts = [*facts, f"commit {commit}" if commit else "", datetime.date.today().isoformat()]
    return ", ".join(p for p in parts if p)


def command_line() -> str | None:
    """The ``dtune`` command line of this process (``dtune search ...``, also when started as ``python -m dtune``), or
    None where dtune's CLI did not start it (a script, a test)."""
    prog = Path(sys.argv[0]) if sys.argv and sys.argv[0] else None
    if prog is None or not (prog.name == "dtune" or (prog.name == "__main__.py" and prog.parent.name == "dtune")):
        return None
    return shlex.join(["dtune", *sys.argv[1:]])
