"""Which source a result came from: the commit recorded in ``run.json``, ``bench.csv`` and ``profile.csv``."""

from __future__ import annotations

import os
import subprocess
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
