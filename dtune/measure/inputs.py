"""The one input builder: random inputs that obey the ops' contract, and the workload every measurement times.

:func:`make_inputs` draws L2-normalised ``q, k``, log gates with strong decays (down to ``gate_min``), ``beta`` in
(0, 1) and a random initial state; with ``seq_lens`` the sequences are packed (``B = 1``, ``cu_seqlens``).

:class:`Workload` says what a timed call does besides the shape: read an initial state, write the final state,
run a packed variable-length batch. :data:`DEFAULT_WORKLOAD` — both states on, fixed-length batches — is what the
search's trials time, what ``dtune bench`` and ``dtune profile`` time and what the shipped configs were tuned
for: prefill from a cached state and decode both read and write the state, and the correctness gate checks
exactly that call. ``--no-initial-state`` / ``--no-final-state`` change it (the FLOP/byte model follows).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch

from dtune.shape import Gate, Shape

Tensor = torch.Tensor
GATE_MIN = -5.0  # strongest per-step log decay drawn (docs/DESIGN.md §1: unsafe chunkings must fail)
DECAYS = ("strong", "model")  # the log gates' distributions: see make_inputs
TIMING_SEED = 1234  # the inputs every timed call runs on


@dataclass(frozen=True)
class Workload:
    """What one measured call does besides its shape."""

    initial_state: bool = True  # read an initial state [N, HV, K, V] (float32)
    final_state: bool = True  # write the final state
    seq_lens: tuple[int, ...] | None = None  # pack these sequences (B = 1, cu_seqlens) instead of B rows of T
    decays: str = "strong"  # the log gates drawn: "strong" or "model" (make_inputs)

    def shape(self, shape: Shape) -> Shape:
        """The shape the call really has: ``shape``'s heads and dims over the packed sequences, if any."""
        if self.seq_lens is None:
            return shape
        return replace(shape, B=1, T=sum(self.seq_lens), N=len(self.seq_lens), varlen=True)


DEFAULT_WORKLOAD = Workload()


def make_inputs(
    shape: Shape,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    seed: int = 0,
    gate_min: float = GATE_MIN,
    seq_lens: list[int] | tuple[int, ...] | None = None,
    initial_state: bool = True,
    values: bool = True,
    decays: str = "strong",
) -> dict[str, Any]:
    """Random inputs obeying the contract: unit-norm q/k, log gates uniform-ish in [gate_min, 0), beta in (0, 1).

    ``decays`` (the log gates' distribution): ``"strong"`` (the default, what the correctness gate and the tuned
    configs' timings use): 30% of the entries near ``gate_min``, the rest ``gate_min · u³``: a mean log decay near -2 a
    token, a state forgets in a few tokens (strong decays make unsafe chunkings fail). ``"model"``: the gates of
    Gated DeltaNet and KDA layers as fla initialises them, ``g = -A · softplus(a + dt_bias)`` with ``A ~ U(0, 16)``
    per value head, ``dt_bias`` the inverse softplus of ``dt ~ logU(1e-3, 1e-1)`` per value head (KDA: per head and
    key channel) and the projected ``a ~ N(0, 1)`` per token (``gate_min`` unused): mean log decays from about -1e-3
    to -1 a token by head, so most heads forget over tens to thousands of tokens and some barely. Work that depends
    on the gates' values (a transition skipped where its decay bound is negligible, a burn-in's length) is timed on
    both.

    Returns ``q, k, v, g, beta, initial_state, cu_seqlens`` (the ops' keyword names). With ``seq_lens`` the
    sequences are packed (B = 1) and ``cu_seqlens`` is set. Gates are drawn in float32 (as models keep them);
    q, k, v, beta in ``dtype``; the initial state in float32. ``values=False``: the same tensors uninitialised on
    ``device`` (``cu_seqlens`` still set): for a call that only compiles, at no cost of drawing them.
    """
    p = shape
    B, T = p.B, p.T
    cu = None
    if seq_lens is not None:
        B, T = 1, sum(seq_lens)
        cu = torch.tensor([0, *torch.tensor(list(seq_lens)).cumsum(0).tolist()], dtype=torch.int32)
    if not values:
        n_seq = len(seq_lens) if seq_lens is not None else B
        g_dims = None if p.gate is Gate.NONE else (B, T, p.HV) if p.gate is Gate.SCALAR else (B, T, p.HV, p.K)

        def blank(dims: tuple[int, ...] | None, dt: torch.dtype) -> Tensor | None:
            return None if dims is None else torch.empty(dims, dtype=dt, device=device)

        return {
            "q": blank((B, T, p.H, p.K), dtype),
            "k": blank((B, T, p.H, p.K), dtype),
            "v": blank((B, T, p.HV, p.V), dtype),
            "g": blank(g_dims, torch.float32),
            "beta": blank((B, T, p.HV), dtype),
            "initial_state": blank((n_seq, p.HV, p.K, p.V) if initial_state else None, torch.float32),
            "cu_seqlens": None if cu is None else cu.to(device),
        }
    gen = torch.Generator(device="cpu").manual_seed(seed)

    def rnd(*dims: int) -> Tensor:
        return torch.randn(*dims, generator=gen)

    q = torch.nn.functional.normalize(rnd(B, T, p.H, p.K), dim=-1)
    k = torch.nn.functional.normalize(rnd(B, T, p.H, p.K), dim=-1)
    v = rnd(B, T, p.HV, p.V)
    beta = torch.rand(B, T, p.HV, generator=gen) * 0.98 + 0.01
    g: Tensor | None = None
    if p.gate is not Gate.NONE:
        dims = (B, T, p.HV) if p.gate is Gate.SCALAR else (B, T, p.HV, p.K)
        if decays == "model":
            g = model_gates(dims, gen)
        elif decays == "strong":
            # A mix of strong and weak decays: 30% of entries near gate_min, the rest spread over (gate_min, 0).
            u = torch.rand(*dims, generator=gen)
            g = torch.where(torch.rand(*dims, generator=gen) < 0.3, gate_min * (0.8 + 0.2 * u), gate_min * u**3)
        else:
            raise ValueError(f"unknown decays {decays!r}; use one of {', '.join(DECAYS)}")
    n_seq = len(seq_lens) if seq_lens is not None else B
    h0 = rnd(n_seq, p.HV, p.K, p.V) * 0.5 if initial_state else None
    out: dict[str, Any] = {
        "q": q.to(dtype),
        "k": k.to(dtype),
        "v": v.to(dtype),
        "g": g,
        "beta": beta.to(dtype),
        "initial_state": h0,
        "cu_seqlens": cu,
    }
    return {n: (x.to(device) if isinstance(x, torch.Tensor) else x) for n, x in out.items()}


def model_gates(dims: tuple[int, ...], gen: torch.Generator) -> Tensor:
    """Log gates ``[B, T, HV]`` or ``[B, T, HV, K]`` as fla's Gated DeltaNet / KDA layers produce them at
    initialisation (``make_inputs(decays="model")``): ``-A · softplus(a + dt_bias)``, float32."""
    HV, per = dims[2], dims[3:]  # per: (K,) for KDA's per-channel gates
    A = torch.rand(HV, *[1] * len(per), generator=gen) * 16.0
    lo, hi = torch.log(torch.tensor(1e-3)), torch.log(torch.tensor(1e-1))
    dt = torch.exp(lo + (hi - lo) * torch.rand(HV, *per, generator=gen)).clamp(min=1e-4)
    dt_bias = dt + torch.log(-torch.expm1(-dt))  # softplus(dt_bias) = dt
    a = torch.randn(*dims, generator=gen)
    return -A * torch.nn.functional.softplus(a + dt_bias)


def workload_inputs(
    shape: Shape,
    dtype: torch.dtype,
    device: str | torch.device,
    workload: Workload = DEFAULT_WORKLOAD,
    seed: int = TIMING_SEED,
    values: bool = True,
) -> dict[str, Any]:
    """The keyword arguments of one timed op call: :func:`make_inputs` for ``workload`` (``values``: see there), plus
    ``scale`` and ``output_final_state``. ``dtune.ops.run_kernel(kernel, **x, config=...)`` runs it."""
    x = make_inputs(
        shape,
        dtype,
        device,
        seed=seed,
        seq_lens=workload.seq_lens,
        initial_state=workload.initial_state,
        values=values,
        decays=workload.decays,
    )
    x["scale"] = shape.K**-0.5
    x["output_final_state"] = workload.final_state
    return x
