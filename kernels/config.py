"""Launch configurations: the tunable parameters of a kernel template, checked before any launch.

A template declares every parameter that changes speed and the values each may take (``legal``); a
config is a plain dict naming some of them. :func:`check_config` merges a user's (or the tuner's)
config over the template's default and rejects unknown keys and illegal values with a clear error.
Which of the legal configurations are *fast* or *safe* on a given GPU is the search space's business
(``search_spaces/*.toml``); legality here only means "the template can be built with it".
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

Config = dict[str, Any]

# Gate modes of the templates, as the constexpr ``GATE`` the kernels branch on: no decay (DeltaNet), one log decay per
# value head and token (Gated DeltaNet), one per key channel (KDA).
GATE_CODES: dict[str, int] = {"none": 0, "scalar": 1, "channel": 2}

# Log gates are clamped at load to this floor (forward and backward kernels, and the float64 backward reference). A gate
# of −inf (a full forget) is valid input, but −inf − (−inf) inside a chunk's cumulative sums is NaN. At −20 nats a
# decay factor is exp(−20) ≈ 2e-9: what crosses a clamped step is below float32's rounding of the terms it is added
# to (relative 6e-8), so the result equals the reference's exact zero to rounding, and every cumulative gate of a
# chunk stays finite (≥ −20 · BT). The floor is kept this shallow on purpose: the KDA diagonal blocks' middle-row
# dot needs a block's half span below ~88 nats, and each clamped step adds 20 (a deeper floor would send every block
# with a −inf gate to the guarded exact path, or overflow the unguarded one). The clamp's gradient is 0 below it. NaN is
# not clamped (``chunk.common.floor_gate``: a plain max would return the floor for NaN, a finite wrong answer): a NaN
# gate reaches the outputs and gradients, as in the recurrence. (The fused-recurrent kernels do not clamp.)
GATE_FLOOR = -20.0

# The decay-driven skip of a segment's transition in the sequence-parallel state passes (``SEG_DECAY``,
# ``dh_SEG_DECAY``; Gated DeltaNet): where a bound of the segment's whole transition, log ‖M_seg‖₂ ≤ Σ_t (γ_t + log
# max(1, |1 − β_t ‖k_t‖²|)) (each token's map is e^{γ_t} (I − β_t k_t k_tᵀ)), lies below this, M_seg is taken as 0.
# e^-104 ≈ 6.8e-46 is below half of float32's smallest number (2^-149 ≈ 1.4e-45): every entry of M_seg, at most its
# norm, rounds to 0 in float32 as computed in full, so the skip stores what the full product would, and the term
# dropped, M_seg S, is under 1e-45 · ‖S‖ (under 5e-7 for the largest finite state). A non-finite S still reaches the
# next segment (phase 2's product: 0 · NaN is NaN). The same bound decides the burn-in (``SEG_START = "burnin"``).
SEG_SKIP_LOG = -104.0

# Debug switch: launchers fill their outputs with NaN before launch, so elements a kernel fails to write show
# up as NaN in the result instead of passing on leftover memory. Tests and the correctness gate turn it on.
POISON_OUTPUTS = False


# Debug switch: while a list, launchers allocate every output inside a larger buffer whose regions just before and
# just after it hold GUARD_SENTINEL, and record it here; :func:`touched_guards` then names each output a kernel stored
# outside of. An out-of-range store (a row mask off by one) fails a test instead of corrupting memory or crashing the
# process. The tests turn it on (tests/conftest.py).
GUARDS: list[Guarded] | None = None
GUARD_SENTINEL = -30000.0  # finite in float16, bfloat16 and float32
GUARD_MAX = 1 << 16  # elements per guard region: one row block of the largest layouts, at most the output's size
KEEP_GUARDS = 256  # outputs kept for the check; beyond, the untouched ones are dropped (a touched one stays)


@dataclass(frozen=True)
class Guarded:
    """An output and the buffer around it: ``pad`` guard elements, the output's ``numel``, ``pad`` more."""

    base: torch.Tensor = field(repr=False)
    pad: int
    numel: int
    shape: tuple[int, ...]

    def touched(self) -> str | None:
        """Where a kernel stored outside the output ("before", "after", "before and after"), or None."""
        sentinel = torch.full_like(self.base[: self.pad], _fill(self.base.dtype))
        before = not torch.equal(self.base[: self.pad], sentinel)
        after = not torch.equal(self.base[self.pad + self.numel :], sentinel)
        return " and ".join(w for w, hit in (("before", before), ("after", after)) if hit) or None


def _fill(dtype: torch.dtype) -> float | int:
    return GUARD_SENTINEL if dtype.is_floating_point else int(GUARD_SENTINEL)


def _guarded_empty(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    numel = 1
    for n in shape:
        numel *= n
    pad = -(-max(min(numel, GUARD_MAX), 64) // 64) * 64  # a multiple of 64 elements keeps the output aligned
    base = torch.full((2 * pad + numel,), _fill(dtype), dtype=dtype, device=device)
    assert GUARDS is not None
    if len(GUARDS) >= KEEP_GUARDS:
        GUARDS[:] = [g for g in GUARDS if g.touched() is not None]
    GUARDS.append(Guarded(base, pad, numel, tuple(shape)))
    return base[pad : pad + numel].view(shape)


def touched_guards(guards: list[Guarded]) -> list[str]:
    """Every output of ``guards`` whose guard regions a kernel wrote: its shape, dtype and which side."""
    return [f"{list(g.shape)} {g.base.dtype} ({where})" for g in guards if (where := g.touched()) is not None]


def new_output(*shape: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An uninitialised output buffer, NaN-filled when POISON_OUTPUTS is on, inside sentinel guards when GUARDS is."""
    out = torch.empty(*shape, dtype=dtype, device=device) if GUARDS is None else _guarded_empty(shape, dtype, device)
    if POISON_OUTPUTS:
        out.fill_(float("nan"))
    return out


def check_config(
    kernel: str, legal: Mapping[str, tuple[Any, ...]], default: Config, config: Mapping[str, Any] | None
) -> Config:
    """Return ``default`` updated with ``config``; ValueError naming any unknown key or illegal value."""
    if config is None:
        return dict(default)
    if not isinstance(config, Mapping):
        raise TypeError(f"config for {kernel} must be a dict of template parameters, got {type(config).__name__}")
    unknown = sorted(set(config) - set(legal))
    if unknown:
        raise ValueError(f"config for {kernel}: unknown parameter(s) {unknown}; known: {sorted(legal)}")
    merged = dict(default)
    for name, value in config.items():
        if value not in legal[name] or isinstance(value, bool) != isinstance(legal[name][0], bool):
            raise ValueError(f"config for {kernel}: {name}={value!r} is not one of {list(legal[name])}")
        merged[name] = value
    return merged


def next_power_of_2(n: int) -> int:
    return 1 << (max(int(n), 1) - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for launch grids on the host: plain integer math (``triton.cdiv`` is a constexpr function in
    recent Triton, several microseconds per host call)."""
    return -(-a // b)
