"""Which config a measurement runs: a tuned-config file (``--config``), else the store, else the default.

A tuned-config file (``tuned.json`` from ``dtune export``) is read and validated by :mod:`dtune.store`, and the
config is chosen by the store's rule (the exact bucket, else borrowed from the nearest ones and adjusted:
:mod:`dtune.borrow`), so a benchmark times exactly what the ops would launch with that file loaded. A plain JSON
config object (or ``{"config": {...}}``) is one config for every shape.

Where a config came from (``dtune bench``'s ``config_source``) starts with how it matched the shape
(:func:`config_match`): ``exact: h200.json T4096-B8-…`` (the shape's own tuned bucket), ``borrowed: h200.json
T4096-B8-… (what was changed)``, ``default (…)`` (no entry: the template's default), ``given: FILE`` or ``given
config`` (one config for every shape).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dtune.borrow import BORROWED, DEFAULT, EXACT
from dtune.inputs import dtype_name
from dtune.shape import Gate, Shape, ShapeGrid
from dtune.store import ConfigFileError, TunedConfigs, read_configs, tuned_choice

GIVEN = "given"
MATCHES = (EXACT, BORROWED, DEFAULT, GIVEN)
TINY = 1 << 14  # B·T·H·K of a shape the interpreter runs in seconds


@dataclass
class ConfigSource:
    """Where the config comes from: a tuned-config file (``table``), one fixed config, else :mod:`dtune.store`."""

    path: Path | None = None
    table: TunedConfigs | None = None  # a tuned-config file, validated as at run time
    fixed: dict[str, Any] | None = None  # a plain config file: one config for every shape

    @classmethod
    def load(cls, path: str | Path | Mapping[str, Any] | None) -> ConfigSource:
        """From a file (tuned-config file or config object), or a config given as a dict; None: the store."""
        if path is None:
            return cls()
        if isinstance(path, Mapping):
            return cls(fixed=dict(path))
        path = Path(path)
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except OSError as e:
            raise ConfigFileError(f"config file {path}: cannot be read ({e.strerror or e})") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ConfigFileError(f"config file {path}: is not valid JSON ({e})") from None
        if isinstance(data, dict) and "entries" in data:
            return cls(path=path, table=read_configs(path))
        if isinstance(data, dict) and isinstance(data.get("config"), dict):
            return cls(path=path, fixed=dict(data["config"]))
        if isinstance(data, dict):
            return cls(path=path, fixed=data)
        raise ConfigFileError(f"config file {path}: expected a tuned.json (with 'entries') or a JSON config object")

    def resolve(self, kernel: str, p: Shape, dtype: torch.dtype, device: torch.device) -> tuple[dict | None, str]:
        """``(config, where_from)``; config None means the template's default. ``where_from`` starts with the match
        (see the module's docstring)."""
        if self.fixed is not None:
            return dict(self.fixed), f"{GIVEN}: {self.path}" if self.path is not None else f"{GIVEN} config"
        if self.table is not None and self.path is not None:
            choice = self.table.choose(kernel, dtype_name(dtype), p)
            if choice is None:
                return None, f"{DEFAULT} (no entry for {kernel} {dtype_name(dtype)} in {self.path.name})"
            return dict(choice.config), choice.describe()
        try:
            found = tuned_choice(kernel, p, dtype, device)
        except Exception as exc:  # a broken shipped file must not break a benchmark
            return None, f"{DEFAULT} (store unavailable: {exc})"
        if found is None:
            return None, f"{DEFAULT} (no tuned config in the store)"
        return dict(found.config), found.describe()

    def tuned_grid(self, kernel: str, dtype: torch.dtype, on_gpu: bool, gate: Gate = Gate.NONE) -> ShapeGrid | None:
        """The shapes the file was tuned on, when it has any for ``kernel`` and ``dtype`` and they can run here
        (on the CPU: tiny ones only); else None."""
        if self.table is None:
            return None
        shapes = self.table.shapes(kernel, dtype_name(dtype), gate)
        if not shapes or (not on_gpu and any(s.B * s.T * s.H * s.K > TINY for s in shapes)):
            return None
        return ShapeGrid(explicit=tuple(shapes))


def config_match(where: str) -> str:
    """How a ``where_from`` of :meth:`ConfigSource.resolve` matched its shape: one of :data:`MATCHES`, or "" for
    anything else (fla's rows, older bench.csv files)."""
    head = str(where).split(":", 1)[0].split(" ", 1)[0]
    return head if head in MATCHES else ""
