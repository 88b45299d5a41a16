"""TOML reading for data files (GPU profiles, search spaces): tomllib on Python 3.11+, tomli before."""

from __future__ import annotations

import sys
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib

TOMLDecodeError = tomllib.TOMLDecodeError


def loads(text: str) -> dict[str, Any]:
    return tomllib.loads(text)
