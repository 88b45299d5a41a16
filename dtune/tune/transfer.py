"""Transfer between buckets: a new shape's search starts from the winners of the nearest tuned shapes.

Sources: the shipped tuned configs (``dtune/configs/*.json``: this GPU's file first, other GPUs' after), run folders
given with ``--transfer-from RUN_DIR`` and the current run's own earlier shapes (each run folder's best
gate-passing config per study, as ``dtune export`` picks it). Winners of the same kernel are ranked by how far
their bucket is: other GPU, then other dtype, then head dims (log scale), then the value-head ratio, then
:meth:`dtune.shape.Shape.bucket_distance` (sequence length, batch, heads). The nearest distinct configs are the
search's starting points next to the default and the seeds; one that is illegal for the new shape is pruned by
the space's constraints like any other.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from dtune.shape import Shape

DEFAULT_COUNT = 3  # transferred starting points per shape


@dataclass(frozen=True)
class Donor:
    """A tuned bucket's winner."""

    kernel: str
    gpu: str
    dtype: str
    bucket: dict[str, int]
    config: dict[str, Any]
    time_ms: float | None
    source: str

    def describe(self) -> str:
        b = self.bucket
        t = f" {self.time_ms:.4g} ms" if self.time_ms else ""
        return (
            f"{self.source}: {self.kernel} {self.gpu} {self.dtype} T{b['T']}-B{b['B']}-H{b['H']}-HV{b['HV']}-K{b['K']}-"
            f"V{b['V']}{t}"
        )


def donors_of(doc: dict[str, Any], source: str) -> list[Donor]:
    """The entries of a tuned-config document (schema 1) as donors."""
    out = []
    for e in doc.get("entries", []):
        if isinstance(e, dict) and isinstance(e.get("config"), dict) and isinstance(e.get("bucket"), dict):
            kernel, gpu, dtype = str(e["kernel"]), str(doc.get("gpu")), str(e["dtype"])
            out.append(Donor(kernel, gpu, dtype, dict(e["bucket"]), dict(e["config"]), e.get("time_ms"), source))
    return out


def shipped_donors() -> list[Donor]:
    """Every shipped tuned-config file's entries."""
    out: list[Donor] = []
    root = resources.files("dtune.configs")
    for ref in sorted(root.iterdir(), key=lambda r: r.name):
        if ref.name.endswith(".json"):
            try:
                out.extend(donors_of(json.loads(ref.read_text(encoding="utf-8")), f"shipped {ref.name}"))
            except (OSError, ValueError):
                continue
    return out


def run_donors(run_dir: Path) -> list[Donor]:
    """The best gate-passing config of every study of a run folder (nothing if it has none yet)."""
    from dtune.tune.export import build_export

    try:
        doc = build_export(Path(run_dir))
    except (OSError, ValueError, KeyError):
        return []
    return donors_of(doc, f"run {run_dir}")


def bucket_distance(shape: Shape, b: dict[str, int]) -> tuple[float, ...]:
    """How far a tuned bucket of the same GPU and dtype is from ``shape``: head dims (log scale), then the value-head
    ratio, then :meth:`dtune.shape.Shape.bucket_distance` (sequence length, batch, heads)."""
    dims = abs(math.log(shape.K) - math.log(b["K"])) + abs(math.log(shape.V) - math.log(b["V"]))
    ratio = abs(math.log(shape.HV / shape.H) - math.log(b["HV"] / b["H"]))
    return (dims, ratio, *shape.bucket_distance(b))


def _distance(shape: Shape, gpu: str, dtype: str, d: Donor) -> tuple[float, ...]:
    return (float(d.gpu != gpu), float(d.dtype != dtype), *bucket_distance(shape, d.bucket))


def nearest(
    donors: Iterable[Donor], kernel: str, gpu: str, dtype: str, shape: Shape, count: int = DEFAULT_COUNT
) -> list[Donor]:
    """The ``count`` nearest donors of ``kernel`` with distinct configs, nearest first (none for a count of 0)."""
    if count <= 0:
        return []
    mine = sorted((d for d in donors if d.kernel == kernel), key=lambda d: _distance(shape, gpu, dtype, d))
    out: list[Donor] = []
    seen: set[str] = set()
    for d in mine:
        k = json.dumps(d.config, sort_keys=True)
        if k not in seen:
            seen.add(k)
            out.append(d)
        if len(out) >= count:
            break
    return out
