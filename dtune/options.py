"""flash-linear-attention's in-kernel options: inside the fused-recurrent kernels and the chunk forward's stages, as
exact separate passes under autograd.

fla's ops take options that transform their inputs before the recurrence; real models pass them (fla's own
``GatedDeltaNet`` and ``KimiDeltaAttention`` layers pass all of them). :class:`Options` carries them, with fla's
names. The fused-recurrent kernels (decoding) apply them to each token as they load it (:meth:`Options.in_kernel`;
one launch per step, as fla's own kernels do). The chunk forward outside autograd applies them in its stages as they
load g, q, k and beta (:meth:`Options.chunk_in_kernel`: no float32 gate, no normalised q and k written and read
back; ``state_v_first``'s states are transposed around the call). Otherwise :meth:`Options.apply` runs them all as
passes that autograd differentiates (Triton kernels with their own backward for the l2norm and the gate, PyTorch
ops for the rest), so every gradient (``A_log`` and ``dt_bias`` included) follows. The same formulas in float64 are
``dtune.kernels.reference.reference_with_options``.

====================================  =========================================================================
option (fla's name)                   what it does (fla-core 0.6.0), in the dtype fla computes it
====================================  =========================================================================
``use_qk_l2norm_in_kernel``           ``q, k <- x / sqrt(Σ x² + 1e-6)``: float32 inside, stored in x's dtype
``use_gate_in_kernel``                ``g <- -exp(A_log) · softplus(g + dt_bias)`` in float32; ``A_log [HV]``,
                                      ``dt_bias [HV]`` (Gated DeltaNet) or ``[HV·K]`` (KDA, per key channel)
``lower_bound`` (with the gate)       ``g <- lower_bound · sigmoid(exp(A_log) · (g + dt_bias))`` (``A_log`` None:
                                      ``lower_bound · sigmoid(g + dt_bias)``), in ``(lower_bound, 0)``
``use_beta_sigmoid_in_kernel``        ``beta <- sigmoid(beta)`` in float32
``allow_neg_eigval``                  ... times 2 (needs ``use_beta_sigmoid_in_kernel``, as in fla)
``state_v_first``                     initial and final states ``[N, HV, V, K]`` instead of ``[N, HV, K, V]``
====================================  =========================================================================

What each separate pass costs per element of the tensor it transforms (16-bit q, k and raw gate: 2 bytes; float32: 4),
and where the kernels apply it instead:

- l2norm of q and k (a Triton pass, :mod:`dtune.kernels.options`): forward one read and one write (2 + 2 B), backward
  x, dy read and dx written (2 + 2 + 2 B). In the chunk forward: stage 1 (``intra*``) sums the squares of its
  chunk's q and k rows over the key tiles and puts the factors on A's blocks (rows and columns) and on W's operand,
  q~ and k~, and stores them (``[tokens, H]`` float32) for the state pass and the output stage, which put them on
  their products' rows.
  The backward's ``bwd_dqk`` stage could apply l2norm's Jacobian to dq and dk as it stores them (not yet: a pass).
- the gate (a Triton pass): forward the raw g read and the float32 log gate written (2 + 4 B; the chunk kernel then
  reads that gate, as it would read one the caller computed); backward the gate's gradient and g read, dg written
  (4 + 2 + 2 B), dA_log and ddt_bias from per-block partial sums. In the chunk forward: stage 1's gate cumsum
  activates g as it loads it (KDA: ``[B, T, HV, K]``, the largest per-token input after v); the backward's gate
  gradient (``bwd_dqk``) could multiply by the activation's derivative before its reverse cumsum (not yet: a pass).
- beta (PyTorch ops): ``[B, T, HV]``, a float32 copy (2 + 4 B per token and head): negligible; in the chunk forward
  every load of beta (stage 1, the state pass with ``WU = "recomputed"``) activates it.
- ``state_v_first``: a transposed copy of the initial state (read and write, 8 B per state element) and of the final
  state: ``N · HV · K · V`` elements, independent of T (the chunk forward's caller transposes them; the
  fused-recurrent kernel reads and writes ``[V, K]`` states directly).
- ``cu_seqlens`` int32 or int64: the kernels take both. ``cu_seqlens_cpu`` (a host copy) saves the one host read
  of ``cu_seqlens`` (:func:`dtune.kernels.chunk.tables.remember_host_offsets`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch
from torch.autograd.function import once_differentiable

from dtune.inputs import interpreting
from dtune.kernels import options as option_kernels
from dtune.kernels.options import InKernel
from dtune.shape import Gate

Tensor = torch.Tensor

L2NORM_EPS: float = option_kernels.L2NORM_EPS.value  # fla's l2norm_fwd default, as the kernels apply it
SAFE_LOWER_BOUND = (-5.0, 0.0)  # fla's range for lower_bound with safe_gate and the gate in the kernel
# The longest calls the kernels apply the options in (longer ones take the passes). Measured on an H100 (2026-12-06,
# commit 7b29413, `benchmarks/host_cost.py --layer-options --repeats 5`, bf16, H 16, D 128; host times the median of 5
# batches, GPU-bound times per call of one loop of 50 back-to-back calls): in the kernels a call queues in about 60%
# of the host time (chunk: 275-308 us against 435-497; fused recurrent: 65 against 209), but the work they add runs
# inside the sequential passes: at B 1, T 32768 the chunk ops took 1.742 ms (Gated DeltaNet) and 3.819 ms (KDA)
# against 1.110 and 2.945 with the passes (a rerun at commit 0490a7f: 1.502 against 1.276, 2.538 against 2.317), the
# fused-recurrent KDA at B 1, T 2048 4.34 ms against 3.32. With host
# time and GPU time both linear in the length, the chunk ops break even near 8k tokens a call (Gated DeltaNet; KDA,
# whose in-kernel work per token is larger, near 4k) and the fused-recurrent kernel near 280 tokens a sequence.
IN_KERNEL_MAX_TOKENS = 8192  # chunk forward: tokens per call (DeltaNet, Gated DeltaNet)
IN_KERNEL_MAX_TOKENS_KDA = 4096  # chunk forward, KDA: tokens per call
IN_KERNEL_MAX_SEQ_LEN = 256  # fused recurrent: tokens per sequence


@dataclass(frozen=True, eq=False)
class Options:
    """fla's in-kernel options of one call (fla's names and defaults: every option off).

    ``A_log``, ``dt_bias`` and ``lower_bound`` are used only with ``use_gate_in_kernel``; passing them without it,
    or ``allow_neg_eigval`` without ``use_beta_sigmoid_in_kernel``, is a ``ValueError`` (:meth:`check`).
    """

    use_qk_l2norm_in_kernel: bool = False
    use_gate_in_kernel: bool = False
    A_log: Tensor | None = None
    dt_bias: Tensor | None = None
    lower_bound: float | None = None
    use_beta_sigmoid_in_kernel: bool = False
    allow_neg_eigval: bool = False
    state_v_first: bool = False

    @property
    def active(self) -> bool:
        """True when any option transforms an input or a state."""
        return (
            self.use_qk_l2norm_in_kernel or self.use_gate_in_kernel or self.use_beta_sigmoid_in_kernel
        ) or self.state_v_first

    def check(self, gate: Gate, HV: int, K: int, device: torch.device | None = None) -> None:
        """ValueError naming the option that cannot apply to a call with this gate, ``HV`` value heads and key dim
        ``K`` (before any pass runs); with ``device``, ``A_log`` and ``dt_bias`` must be on it."""
        if self.allow_neg_eigval and not self.use_beta_sigmoid_in_kernel:
            raise ValueError("allow_neg_eigval=True needs use_beta_sigmoid_in_kernel=True (beta in (0, 2))")
        if not self.use_gate_in_kernel:
            given = [n for n in ("A_log", "dt_bias", "lower_bound") if getattr(self, n) is not None]
            if given:
                raise ValueError(f"{', '.join(given)} are used only with use_gate_in_kernel=True")
            return
        if gate is Gate.NONE:
            raise ValueError("use_gate_in_kernel needs a gated op (DeltaNet has no gate)")
        if self.A_log is None and self.lower_bound is None:
            raise ValueError("use_gate_in_kernel=True needs A_log ([HV]) unless lower_bound is set")
        if self.A_log is not None and self.A_log.numel() != HV:
            raise ValueError(f"A_log must have HV = {HV} elements, got shape {tuple(self.A_log.shape)}")
        want = HV * K if gate is Gate.CHANNEL else HV
        if self.dt_bias is not None and self.dt_bias.numel() != want:
            kind = "HV * K" if gate is Gate.CHANNEL else "HV"
            raise ValueError(f"dt_bias must have {kind} = {want} elements, got shape {tuple(self.dt_bias.shape)}")
        for name in ("A_log", "dt_bias"):
            t = getattr(self, name)
            if device is not None and t is not None and t.device != device:
                raise ValueError(f"{name} is on {t.device}, the inputs on {device}: put it on the inputs' device")
        if self.lower_bound is not None and not self.lower_bound < 0:
            raise ValueError(f"lower_bound must be negative (a log-space floor of the gate), got {self.lower_bound}")

    def tensors(self) -> tuple[Tensor | None, Tensor | None]:
        """``(A_log, dt_bias)`` as the call uses them (None without ``use_gate_in_kernel``)."""
        return (self.A_log, self.dt_bias) if self.use_gate_in_kernel else (None, None)

    def apply(
        self, q: Tensor, k: Tensor, g: Tensor | None, beta: Tensor, initial_state: Tensor | None
    ) -> tuple[Tensor, Tensor, Tensor | None, Tensor, Tensor | None]:
        """The kernel's inputs: ``(q, k, g, beta, initial_state)`` with the options applied (each a separate pass; the
        untouched ones as given). The initial state of ``state_v_first`` is a transposed view (the kernels copy it
        contiguous)."""
        if self.use_qk_l2norm_in_kernel:
            q, k = l2norm(q), l2norm(k)
        if self.use_gate_in_kernel and g is not None:
            g = gate_activation(g, self.A_log, self.dt_bias, self.lower_bound)
        if self.use_beta_sigmoid_in_kernel:
            beta = beta_activation(beta, self.allow_neg_eigval)
        if self.state_v_first and initial_state is not None:
            initial_state = initial_state.transpose(-1, -2)
        return q, k, g, beta, initial_state

    def in_kernel(self) -> InKernel:
        """The options as the fused-recurrent kernel applies them, token by token (no separate pass)."""
        return InKernel(
            l2norm=self.use_qk_l2norm_in_kernel,
            gate_activation=self.use_gate_in_kernel,
            A_log=self.A_log if self.use_gate_in_kernel else None,
            dt_bias=self.dt_bias if self.use_gate_in_kernel else None,
            lower_bound=self.lower_bound if self.use_gate_in_kernel else None,
            beta_sigmoid=(2 if self.allow_neg_eigval else 1) if self.use_beta_sigmoid_in_kernel else 0,
            state_vk=self.state_v_first,
        )

    def chunk_in_kernel(self) -> InKernel:
        """The options as the chunk forward's stages apply them: all but ``state_v_first`` (its caller transposes the
        states, ``N · HV · K · V`` elements independent of T)."""
        return replace(self.in_kernel(), state_vk=False)

    def final_state(self, ht: Tensor | None) -> Tensor | None:
        """The final state in the caller's layout: ``[N, HV, V, K]`` (contiguous) with ``state_v_first``."""
        if ht is None or not self.state_v_first:
            return ht
        return ht.transpose(-1, -2).contiguous()


NO_OPTIONS = Options()


def in_kernel_pays(family: str, tokens: int, seq_len: float, gate: str) -> bool:
    """Whether the kernels should apply the options of a call of ``tokens`` tokens in all, ``seq_len`` per sequence
    (``family``: ``"chunk"`` or ``"fused_recurrent"``; ``gate``: the op's gate mode, ``"channel"`` for KDA), rather
    than separate passes: see :data:`IN_KERNEL_MAX_TOKENS`, :data:`IN_KERNEL_MAX_TOKENS_KDA`,
    :data:`IN_KERNEL_MAX_SEQ_LEN`."""
    if family == "fused_recurrent":
        return seq_len <= IN_KERNEL_MAX_SEQ_LEN
    return tokens <= (IN_KERNEL_MAX_TOKENS_KDA if gate == "channel" else IN_KERNEL_MAX_TOKENS)


class _L2Norm(torch.autograd.Function):
    """l2norm by the option kernels: forward one read and one write, backward from x and the saved 1/norm."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, eps: float) -> Tensor:
        y, rstd = option_kernels.l2norm_fwd(x, eps)
        ctx.save_for_backward(x, rstd)
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, dy: Tensor) -> tuple[Tensor, None]:
        x, rstd = ctx.saved_tensors
        return option_kernels.l2norm_bwd(x, rstd, dy), None


class _Gate(torch.autograd.Function):
    """The gate activation by the option kernels; the backward recomputes from the raw g (nothing float32 saved)."""

    @staticmethod
    def forward(ctx: Any, g: Tensor, A_log: Tensor | None, dt_bias: Tensor | None, lower_bound: float | None) -> Tensor:
        A = None if A_log is None else A_log.reshape(-1)
        bias = None if dt_bias is None else dt_bias.reshape(-1)
        ctx.save_for_backward(g, A, bias)
        ctx.lower_bound = lower_bound
        ctx.shapes = (None if A_log is None else A_log.shape, None if dt_bias is None else dt_bias.shape)
        return option_kernels.gate_fwd(g, A, bias, lower_bound)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, dout: Tensor) -> tuple[Tensor | None, ...]:
        g, A, bias = ctx.saved_tensors
        dg, dA, dbias = option_kernels.gate_bwd(g, A, bias, ctx.lower_bound, dout)
        a_shape, b_shape = ctx.shapes
        dA = None if dA is None or A is None else dA.reshape(a_shape).to(A.dtype)
        dbias = None if dbias is None or bias is None else dbias.reshape(b_shape).to(bias.dtype)
        return dg, dA, dbias, None


def _use_kernels(x: Tensor) -> bool:
    """Triton runs the passes on a GPU, and on the CPU under the interpreter; a plain CPU tensor takes PyTorch ops."""
    return x.is_cuda or interpreting()


def l2norm(x: Tensor, eps: float = L2NORM_EPS) -> Tensor:
    """``x / sqrt(Σ x² + eps)`` over the last dim, computed in float32 and stored in x's dtype (fla's l2norm_fwd):
    one Triton pass (:mod:`dtune.kernels.options`); PyTorch ops for a CPU tensor outside the interpreter."""
    if _use_kernels(x):
        y: Tensor = _L2Norm.apply(x, eps)
        return y
    norm = torch.linalg.vector_norm(x, dim=-1, keepdim=True, dtype=torch.float32)
    return (x * torch.rsqrt(norm.square() + eps)).to(x.dtype)


def gate_activation(
    g: Tensor, A_log: Tensor | None, dt_bias: Tensor | None = None, lower_bound: float | None = None
) -> Tensor:
    """The log-space gate of ``use_gate_in_kernel`` in float32, from the raw ``g`` (``[B, T, HV]`` for Gated
    DeltaNet, ``[B, T, HV, K]`` for KDA): ``-exp(A_log) · softplus(g + dt_bias)``, or with ``lower_bound``
    ``lower_bound · sigmoid(exp(A_log) · (g + dt_bias))`` (``A_log`` None: ``lower_bound · sigmoid(g + dt_bias)``).
    ``softplus`` is linear above 20, as fla's. One Triton pass forward and one backward (:mod:`dtune.kernels.options`);
    PyTorch ops for a CPU tensor outside the interpreter."""
    if lower_bound is None and A_log is None:
        raise ValueError("use_gate_in_kernel=True needs A_log unless lower_bound is set")
    if _use_kernels(g):
        out: Tensor = _Gate.apply(g, A_log, dt_bias, lower_bound)
        return out
    HV = g.shape[2]
    per_channel = g.dim() == 4
    shape = (HV, 1) if per_channel else (HV,)
    x = g.float() if dt_bias is None else g + dt_bias.float().reshape((HV, -1) if per_channel else (HV,))
    if lower_bound is None:
        assert A_log is not None
        return torch.nn.functional.softplus(x) * -A_log.float().reshape(shape).exp()
    if A_log is not None:
        x = x * A_log.float().reshape(shape).exp()
    return torch.sigmoid(x) * lower_bound


def beta_activation(beta: Tensor, allow_neg_eigval: bool = False) -> Tensor:
    """``sigmoid(beta)`` in float32, times 2 with ``allow_neg_eigval`` (fla's fused_beta_sigmoid)."""
    b = torch.sigmoid(beta.float())
    return b * 2.0 if allow_neg_eigval else b
