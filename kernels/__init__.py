"""Kernel templates of the delta-rule family and their registry (installed as ``dtune.kernels``).

Nine tunable kernels: two forward families (``fused_recurrent``, ``chunk``) times three gate modes (none =
DeltaNet, scalar = Gated DeltaNet, channel = KDA), and the chunk family's backward for each gate
(``chunk_delta_rule_bwd``, ``chunk_gated_delta_rule_bwd``, ``chunk_kda_bwd``).

A forward family is a module that satisfies :class:`KernelFamily` (``legal_params(gate)``,
``default_config(K, V, gate)`` and ``forward(...)``); :data:`FAMILIES` lists them. A backward family satisfies
:class:`BackwardFamily` (the same two parameter functions and ``check_config``, which adds its cross-parameter
rules); :data:`BACKWARDS` maps a forward family to its backward. :data:`KERNELS` names every (family, gate,
direction) triple; a backward kernel's :attr:`KernelSpec.forward_kernel` is the op it differentiates.

What a backward kernel's config is measured on (the search's trials, ``dtune bench``): the op's **training step**,
the forward under autograd with the forward config fixed (the tuned one for the shape, else the default) followed
by the backward from random gradients of the output and the final state. Not the backward alone: the backward
config also shapes the forward under autograd (``SAVE`` decides what the forward stores and the backward
recomputes; ``BT``/``BC`` are the forward's chunking then), so timing the backward alone would reward moving work
into the forward (``SAVE = "all"``) for free. The step is what a training loop pays per call.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Protocol

import torch

from . import chunk, fused_recurrent, interpreter
from .chunk import backward as chunk_backward
from .config import Config, check_config

if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
    interpreter.install()  # the CPU path: no repeated language swap per jit helper call


class TemplateParams(Protocol):
    """The parameter half of a template family: what can be tuned and the config that is always correct."""

    def legal_params(self, gate: str) -> dict[str, tuple[Any, ...]]:
        """Every tunable parameter and all values the template can be built with."""
        ...

    def default_config(self, K: int, V: int, gate: str) -> Config:
        """A config correct for every supported shape with these head dims."""
        ...


class KernelFamily(TemplateParams, Protocol):
    """What ``dtune.ops`` needs of a forward template family (a module, or any object with these functions)."""

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


class BackwardFamily(TemplateParams, Protocol):
    """A backward template family: its parameters, and a full config check (cross-parameter rules included).

    Launched by the op's autograd Function (``dtune.autograd``), never on its own: see the module docstring for
    what its configs are timed on."""

    def check_config(self, K: int, V: int, gate: str, config: dict[str, Any] | None, name: str = ...) -> Config:
        """``config`` over the default, every key and value checked (ValueError/TypeError naming the problem)."""
        ...


FAMILIES: dict[str, KernelFamily] = {"fused_recurrent": fused_recurrent, "chunk": chunk}
BACKWARDS: dict[str, BackwardFamily] = {"chunk": chunk_backward}  # forward family -> its backward templates
GATES = {"delta_rule": "none", "gated_delta_rule": "scalar", "kda": "channel"}
BWD_SUFFIX = "_bwd"


@dataclass(frozen=True)
class KernelSpec:
    """One tunable kernel: a template family with a fixed gate mode, forward or backward."""

    name: str  # e.g. "chunk_kda", "chunk_kda_bwd"
    family: str  # "fused_recurrent" | "chunk"
    gate: str  # "none" | "scalar" | "channel"
    backward: bool = False  # the family's backward templates (tuned on the op's training step)

    @property
    def module(self) -> KernelFamily:
        """The family's forward templates (for a backward kernel: those of the op it differentiates)."""
        return FAMILIES[self.family]

    @property
    def templates(self) -> TemplateParams:
        """The templates this kernel's configs parametrise: the backward's for a backward kernel."""
        return BACKWARDS[self.family] if self.backward else self.module

    @property
    def forward_kernel(self) -> str:
        """The forward op's kernel name (itself for a forward kernel)."""
        return self.name[: -len(BWD_SUFFIX)] if self.backward else self.name

    @property
    def backward_kernel(self) -> str | None:
        """The registered backward kernel of this op (itself for a backward kernel), or None when it has none."""
        name = self.name if self.backward else self.name + BWD_SUFFIX
        return name if name in KERNELS else None

    def legal_params(self) -> dict[str, tuple[Any, ...]]:
        return dict(self.templates.legal_params(self.gate))

    def default_config(self, K: int, V: int) -> Config:
        return dict(self.templates.default_config(K, V, self.gate))

    def check_config(self, K: int, V: int, config: dict[str, Any] | None) -> Config:
        """The full config to launch: ``config`` over the default, every key and value checked.

        Cached per (K, V, config): this runs on every call, decode steps included.
        """
        try:
            key = None if config is None else tuple(sorted(config.items()))
            return dict(_checked(self, K, V, key))
        except (TypeError, AttributeError):  # not a dict, or unhashable values: the uncached path names the problem
            return self.check_uncached(K, V, config)

    def check_uncached(self, K: int, V: int, config: dict[str, Any] | None) -> Config:
        if self.backward:
            return BACKWARDS[self.family].check_config(K, V, self.gate, config, self.name)
        return check_config(self.name, self.legal_params(), self.default_config(K, V), config)


@lru_cache(maxsize=4096)
def _checked(spec: KernelSpec, K: int, V: int, key: tuple[tuple[str, Any], ...] | None) -> Config:
    return spec.check_uncached(K, V, None if key is None else dict(key))


KERNELS: dict[str, KernelSpec] = {
    f"{family}_{op}": KernelSpec(f"{family}_{op}", family, gate) for family in FAMILIES for op, gate in GATES.items()
}
KERNELS.update(
    {
        f"{family}_{op}{BWD_SUFFIX}": KernelSpec(f"{family}_{op}{BWD_SUFFIX}", family, gate, backward=True)
        for family in BACKWARDS
        for op, gate in GATES.items()
    }
)


def get_kernel(name: str) -> KernelSpec:
    """The registered kernel called ``name``; ValueError listing the known names otherwise."""
    try:
        return KERNELS[name]
    except KeyError:
        raise ValueError(f"unknown kernel {name!r}; known kernels: {', '.join(KERNELS)}") from None
