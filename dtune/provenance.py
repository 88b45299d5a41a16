"""Which source a result came from: the commit recorded in ``run.json``, ``bench.csv`` and ``profile.csv``."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

ENV = "DTUNE_COMMIT"


def git_commit() -> str | None:
    """The source tree's commit: ``git rev-parse HEAD`` when dtune runs from a git checkout, else ``$DTUNE_COMMIT``
    (set it where the code runs without its ``.git``, e.g. a copy of the working tree on a GPU machine), else None."""
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
    return found or os.environ.get(ENV) or None
