"""The environment of a child Python process (trial workers, isolated checks, cold first calls)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path


def child_env(base: Mapping[str, str] | None = None, **extra: str) -> dict[str, str]:
    """``base`` (default: this process's environment) with ``extra`` set and the folder this dtune was imported from
    first on PYTHONPATH, so that ``python -m dtune....`` in the child runs the same code (a source checkout too)."""
    env = dict(os.environ if base is None else base)
    root = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
    env.update(extra)
    return env
