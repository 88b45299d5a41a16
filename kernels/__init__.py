"""Kernel templates of the delta-rule family and their registry (installed as ``dtune.kernels``).

Six tunable kernels: two families (``fused_recurrent``, ``chunk``) times three gate modes (none = DeltaNet,
scalar = Gated DeltaNet, channel = KDA). A family module provides ``legal_params(gate)``,
``default_config(K, V, gate)`` and ``forward(...)``; :data:`KERNELS` names each (family, gate) pair.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from functools import cache, lru_cache
from types import ModuleType
from typing import Any

from .config import Config, check_config

FAMILIES = ("fused_recurrent", "chunk")
GATES = {"delta_rule": "none", "gated_delta_rule": "scalar", "kda": "channel"}


@dataclass(frozen=True)
class KernelSpec:
    """One tunable kernel: a template family with a fixed gate mode."""

    name: str  # e.g. "chunk_kda"
    family: str  # "fused_recurrent" | "chunk"
    gate: str  # "none" | "scalar" | "channel"

    @property
    def module(self) -> ModuleType:
        return _family_module(self.family)

    def legal_params(self) -> dict[str, tuple[Any, ...]]:
        return dict(self.module.legal_params(self.gate))

    def default_config(self, K: int, V: int) -> Config:
        return dict(self.module.default_config(K, V, self.gate))

    def check_config(self, K: int, V: int, config: dict[str, Any] | None) -> Config:
        """The full config to launch: ``config`` over the default, every key and value checked.

        Cached per (K, V, config): this runs on every call, decode steps included.
        """
        try:
            key = None if config is None else tuple(sorted(config.items()))
            return dict(_checked(self, K, V, key))
        except (TypeError, AttributeError):  # not a dict, or unhashable values: the uncached path names the problem
            return check_config(self.name, self.legal_params(), self.default_config(K, V), config)


@cache
def _family_module(family: str) -> ModuleType:
    return importlib.import_module(f"{__name__}.{family}")


@lru_cache(maxsize=4096)
def _checked(spec: KernelSpec, K: int, V: int, key: tuple[tuple[str, Any], ...] | None) -> Config:
    config = None if key is None else dict(key)
    return check_config(spec.name, spec.legal_params(), spec.default_config(K, V), config)


KERNELS: dict[str, KernelSpec] = {
    f"{family}_{op}": KernelSpec(f"{family}_{op}", family, gate) for family in FAMILIES for op, gate in GATES.items()
}


def get_kernel(name: str) -> KernelSpec:
    """The registered kernel called ``name``; ValueError listing the known names otherwise."""
    try:
        return KERNELS[name]
    except KeyError:
        raise ValueError(f"unknown kernel {name!r}; known kernels: {', '.join(KERNELS)}") from None
