"""Launch configurations: the tunable parameters of a kernel template, checked before any launch.

A template declares every parameter that changes speed and the values each may take (``legal``); a
config is a plain dict naming some of them. :func:`check_config` merges a user's (or the tuner's)
config over the template's default and rejects unknown keys and illegal values with a clear error.
Which of the legal configurations are *fast* or *safe* on a given GPU is the search space's business
(``search_spaces/*.toml``); legality here only means "the template can be built with it".
"""

from __future__ import annotations

from collections.abc import Mapping
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

# Debug switch: launchers fill their outputs with NaN before launch, so elements a kernel fails to write show
# up as NaN in the result instead of passing on leftover memory. Tests and the correctness gate turn it on.
POISON_OUTPUTS = False


def new_output(*shape: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An uninitialised output buffer, NaN-filled when POISON_OUTPUTS is on."""
    out = torch.empty(*shape, dtype=dtype, device=device)
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
