"""GPU profiles (``dtune/gpus.toml``) and detection: which GPU a run tunes for, checked against the one present.

A tuned config is only valid for the GPU it was measured on, so :func:`resolve_gpu` refuses to label a run
with another GPU than the one present unless the caller explicitly allows the mismatch.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from importlib import resources
from typing import Any

from dtune import _toml

CPU_KEY = "cpu"

_FIELDS = (
    "name",
    "match",
    "cc",
    "sm_count",
    "smem_per_block",
    "regs_per_sm",
    "l2_mb",
    "hbm_gbs",
    "bf16_tflops",
    "fp32_tflops",
    "source",
)


@dataclass(frozen=True)
class GpuProfile:
    """Datasheet limits and ceilings of one GPU model (see gpus.toml for the sources)."""

    key: str
    name: str
    cc_major: int
    cc_minor: int
    sm_count: int
    smem_per_block: int  # opt-in maximum shared memory per block, bytes
    regs_per_sm: int
    l2_mb: float
    hbm_gbs: float
    bf16_tflops: float  # dense tensor-core BF16
    fp32_tflops: float  # non-tensor FP32
    source: str

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def constraint_fields(self) -> dict[str, int]:
        """The fields that search-space constraints may name."""
        return {
            "smem_per_block": self.smem_per_block,
            "sm_count": self.sm_count,
            "cc_major": self.cc_major,
            "cc_minor": self.cc_minor,
            "regs_per_sm": self.regs_per_sm,
        }


class GpuError(ValueError):
    """An unknown GPU key, no GPU present, or a GPU other than the one requested."""


@functools.lru_cache(maxsize=1)
def _table() -> dict[str, tuple[GpuProfile, re.Pattern[str]]]:
    text = resources.files("dtune").joinpath("gpus.toml").read_text(encoding="utf-8")
    out: dict[str, tuple[GpuProfile, re.Pattern[str]]] = {}
    for key, row in _toml.loads(text).items():
        missing = [f for f in _FIELDS if f not in row]
        if missing:
            raise ValueError(f"gpus.toml: profile {key!r} lacks {missing}")
        major, minor = (int(x) for x in str(row["cc"]).split("."))
        profile = GpuProfile(
            key=key,
            name=str(row["name"]),
            cc_major=major,
            cc_minor=minor,
            sm_count=int(row["sm_count"]),
            smem_per_block=int(row["smem_per_block"]),
            regs_per_sm=int(row["regs_per_sm"]),
            l2_mb=float(row["l2_mb"]),
            hbm_gbs=float(row["hbm_gbs"]),
            bf16_tflops=float(row["bf16_tflops"]),
            fp32_tflops=float(row["fp32_tflops"]),
            source=str(row["source"]),
        )
        out[key] = (profile, re.compile(str(row["match"]), re.IGNORECASE))
    return out


def profiles() -> dict[str, GpuProfile]:
    """Every known profile by key (the ``cpu`` pseudo-profile included)."""
    return {key: p for key, (p, _) in _table().items()}


def get_profile(key: str) -> GpuProfile:
    """The profile called ``key`` (e.g. ``"h100"``); GpuError listing the known keys otherwise."""
    try:
        return _table()[key.lower()][0]
    except KeyError:
        raise GpuError(f"unknown GPU {key!r}; known GPUs: {', '.join(_table())}") from None


def key_for_name(device_name: str) -> str | None:
    """The profile key whose pattern matches a CUDA device name (``"NVIDIA H100 80GB HBM3"`` -> ``"h100"``)."""
    for key, (_, pattern) in _table().items():
        if key != CPU_KEY and pattern.search(device_name):
            return key
    return None


@functools.lru_cache(maxsize=16)
def device_name(index: int = 0) -> str | None:
    """The CUDA device's name (cached: never queried twice), or None without a CUDA GPU."""
    import torch

    if not torch.cuda.is_available():
        return None
    return str(torch.cuda.get_device_name(index))


def detect(index: int = 0) -> str | None:
    """The profile key of the CUDA GPU present, or None (no GPU, or a model without a profile)."""
    name = device_name(index)
    return None if name is None else key_for_name(name)


def kin(key: str, candidates: Iterable[str]) -> str | None:
    """The GPU among ``candidates`` (profile keys, e.g. those with shipped tuned configs) whose tuned configs serve
    ``key`` best when ``key`` has none of its own: the same compute capability, shared memory per block and registers
    per SM (the limits the search spaces' constraints read, so every config of one is legal and fits on the other),
    then the nearest SM count and memory bandwidth. None when no candidate is of the same kind (another architecture:
    the templates' defaults serve it)."""
    mine = _table().get(key.lower())
    if mine is None or key.lower() == CPU_KEY:
        return None
    p = mine[0]
    same = [
        c
        for c in candidates
        if c.lower() != key.lower()
        and c.lower() in _table()
        and ((q := _table()[c.lower()][0]).cc_major, q.cc_minor) == (p.cc_major, p.cc_minor)
        and q.smem_per_block == p.smem_per_block
        and q.regs_per_sm == p.regs_per_sm
    ]
    if not same:
        return None

    def gap(c: str) -> tuple[int, float]:
        q = _table()[c.lower()][0]
        return abs(q.sm_count - p.sm_count), abs(q.hbm_gbs - p.hbm_gbs)

    return min(sorted(same), key=gap)


def resolve_gpu(key: str, allow_mismatch: bool = False, interpret: bool = False) -> GpuProfile:
    """The profile a run tunes for: ``auto`` detects; a named GPU must be the one present.

    Under Triton's interpreter (``interpret``) results are labelled ``cpu``; naming a real GPU there (to borrow
    its limits for constraints) needs ``allow_mismatch``, as does naming a GPU other than the one present.
    """
    key = key.lower()
    if key != "auto":
        wanted = get_profile(key)  # unknown keys fail first
    if interpret:
        if key in ("auto", CPU_KEY):
            return get_profile(CPU_KEY)
        if not allow_mismatch:
            raise GpuError(
                f"--interpret runs on the CPU, so its results are labelled 'cpu', not {key!r}; "
                "use --gpu cpu (or auto), or --allow-gpu-mismatch to borrow that GPU's limits for the constraints"
            )
        return wanted
    name = device_name()
    if name is None:
        raise GpuError("no CUDA GPU found; use --interpret to run on the CPU")
    present = key_for_name(name)
    if key == "auto":
        if present is None:
            raise GpuError(
                f"the GPU present ({name!r}) has no dtune profile; known GPUs: {', '.join(profiles())}. "
                "Name the closest one with --gpu KEY --allow-gpu-mismatch"
            )
        return get_profile(present)
    if key == CPU_KEY:
        raise GpuError("--gpu cpu is only for --interpret runs")
    if present != key and not allow_mismatch:
        raise GpuError(
            f"--gpu {key} ({wanted.name}) does not match the GPU present ({name!r}"
            f"{', profile ' + repr(present) if present else ', no dtune profile'}): tuned configs must never be "
            "labelled with another GPU. Run on that GPU, use --gpu auto, or pass --allow-gpu-mismatch"
        )
    return wanted
