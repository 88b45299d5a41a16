"""Kernel templates of the delta-rule family and their registry (installed as ``dtune.kernels``).

Six tunable kernels: two families (``fused_recurrent``, ``chunk``) times three gate modes (none = DeltaNet,
scalar = Gated DeltaNet, channel = KDA). A family is a module that satisfies :class:`KernelFamily`
(``legal_params(gate)``, ``default_config(K, V, gate)`` and ``forward(...)``); :data:`FAMILIES` lists them and
:data:`KERNELS` names each (family, gate) pair.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Protocol

import torch

from . import chunk, fused_recurrent
from .config import Config, check_config


class KernelFamily(Protocol):
    """What ``dtune.ops`` needs of a template family (a module, or any object with these three functions)."""

    def legal_params(self, gate: str) -> dict[str, tuple[Any, ...]]:
        """Every tunable parameter and all values the template can be built with."""
        ...

    def default_config(self, K: int, V: int, gate: str) -> Config:
        """A config correct for every supported shape with these head dims."""
        ...

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor | None,
        beta: torch.Tensor,
        gate: str,
        scale: float,
        initial_state: torch.Tensor | None,
        output_final_state: bool,
        cu_seqlens: torch.Tensor | None,
        config: Config,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Launch the template on validated inputs with a checked, complete config: ``(o, final_state)``.
        (The chunk family's ``forward`` also takes ``seq_offsets``, cu_seqlens as check_inputs read it on the host.)"""
        ...


FAMILIES: dict[str, KernelFamily] = {"fused_recurrent": fused_recurrent, "chunk": chunk}
GATES = {"delta_rule": "none", "gated_delta_rule": "scalar", "kda": "channel"}


@dataclass(frozen=True)
class KernelSpec:
    """One tunable kernel: a template family with a fixed gate mode."""

    name: str  # e.g. "chunk_kda"
    family: str  # "fused_recurrent" | "chunk"
    gate: str  # "none" | "scalar" | "channel"

    @property
    def module(self) -> KernelFamily:
        """The family's templates."""
        return FAMILIES[self.family]

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
