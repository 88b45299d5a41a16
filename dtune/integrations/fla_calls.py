"""One call of a flash-linear-attention entry point, read in dtune's terms (:class:`Call`): a reader per entry point
with fla 0.6.0's exact signature (positional calls bind as they do in fla), which also names the first argument dtune
does not honour. Used by :mod:`dtune.integrations.fla`'s verifiers and implementations."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from dtune.options import SAFE_LOWER_BOUND, Options

Tensor = torch.Tensor


@dataclass(frozen=True, eq=False)
class Call:
    """The arguments of one call in dtune's terms; ``unsupported`` names the first argument dtune does not honour."""

    entry: str  # the fla function's name, e.g. "chunk_kda"
    kernel: str  # the dtune kernel that serves it
    q: Any
    k: Any
    v: Any
    g: Any
    beta: Any
    scale: float | None
    initial_state: Any
    output_final_state: bool
    cu_seqlens: Any
    cu_seqlens_cpu: Any
    options: Options
    unsupported: str | None = None
    out: Any = None  # fused_recurrent_kda_fwd: the output buffer to fill
    inplace_final_state: bool = False  # fused_recurrent_kda_fwd: the final state written into initial_state


def _extra(kwargs: Mapping[str, Any], allowed: tuple[str, ...]) -> str | None:
    """The first keyword dtune does not know (fla's deprecated and future ones included), as a reason."""
    for name in kwargs:
        if name == "transpose_state_layout":
            return "the deprecated transpose_state_layout (pass state_v_first instead)"
        if name not in allowed:
            return f"the keyword {name!r}"
    return None


def _options(
    use_qk_l2norm_in_kernel: bool,
    use_gate_in_kernel: bool,
    A_log: Any,
    dt_bias: Any,
    lower_bound: float | None,
    use_beta_sigmoid_in_kernel: bool,
    allow_neg_eigval: bool,
    state_v_first: bool,
) -> Options:
    """The call's options, with fla's rule that A_log, dt_bias and lower_bound mean nothing without
    use_gate_in_kernel (fla drops them then)."""
    gate = (A_log, dt_bias, lower_bound) if use_gate_in_kernel else (None, None, None)
    return Options(
        use_qk_l2norm_in_kernel=bool(use_qk_l2norm_in_kernel),
        use_gate_in_kernel=bool(use_gate_in_kernel),
        A_log=gate[0],
        dt_bias=gate[1],
        lower_bound=gate[2],
        use_beta_sigmoid_in_kernel=bool(use_beta_sigmoid_in_kernel),
        allow_neg_eigval=bool(allow_neg_eigval),
        state_v_first=bool(state_v_first),
    )


def _read_chunk_gated_delta_rule(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    scale: float | None = None,
    initial_state: Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    state_v_first: bool = False,
    cu_seqlens: Tensor | None = None,
    cu_seqlens_cpu: Tensor | None = None,
    chunk_indices: Tensor | None = None,
    cp_context: Any = None,
    **kwargs: Any,
) -> Call:
    """fla 0.6.0's ``chunk_gated_delta_rule`` signature (``chunk_indices`` derives from ``cu_seqlens``: unused)."""
    problem = _extra(kwargs, ("use_gate_in_kernel", "A_log", "dt_bias", "chunk_size"))
    if cp_context is not None:
        problem = "context parallelism (cp_context)"
    elif kwargs.get("chunk_size", 64) not in (16, 32, 64):
        problem = f"chunk_size={kwargs['chunk_size']} (fla refuses it)"
    elif kwargs.get("use_gate_in_kernel") and kwargs.get("A_log") is None:
        problem = "use_gate_in_kernel without A_log (fla refuses it)"
    use_gate = kwargs.get("use_gate_in_kernel", False)
    opts = _options(
        use_qk_l2norm_in_kernel, use_gate, kwargs.get("A_log"), kwargs.get("dt_bias"), None,
        use_beta_sigmoid_in_kernel, allow_neg_eigval, state_v_first,
    )  # fmt: skip
    args = (q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, cu_seqlens_cpu, opts, problem)
    return Call("chunk_gated_delta_rule", "chunk_gated_delta_rule", *args)


def _read_chunk_kda(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    scale: float | None = None,
    initial_state: Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    safe_gate: bool = False,
    lower_bound: float | None = None,
    disable_recompute: bool = False,
    return_intermediate_states: bool = False,
    state_v_first: bool = False,
    cu_seqlens: Tensor | None = None,
    cu_seqlens_cpu: Tensor | None = None,
    cp_context: Any = None,
    use_graph: bool = False,
    max_num_seqs: int | None = None,
    **kwargs: Any,
) -> Call:
    """fla 0.6.0's ``chunk_kda`` signature (``A_log``, ``dt_bias`` and ``chunk_size`` by keyword)."""
    problem = _extra(kwargs, ("A_log", "dt_bias", "chunk_size"))
    if cp_context is not None:
        problem = "context parallelism (cp_context)"
    elif return_intermediate_states:
        problem = "return_intermediate_states (the chunk states of an inference engine)"
    elif use_graph:
        problem = "use_graph (varlen chunk tables built on the device for CUDA-graph replay)"
    elif kwargs.get("chunk_size", 64) not in (32, 64):
        problem = f"chunk_size={kwargs['chunk_size']} (fla refuses it)"
    elif use_gate_in_kernel and kwargs.get("A_log") is None and lower_bound is None:
        problem = "use_gate_in_kernel without A_log or lower_bound (fla refuses it)"
    elif (
        safe_gate
        and use_gate_in_kernel
        and not (lower_bound is not None and SAFE_LOWER_BOUND[0] <= lower_bound < SAFE_LOWER_BOUND[1])
    ):
        problem = f"safe_gate with lower_bound={lower_bound} outside [-5, 0) (fla refuses it)"
    elif initial_state is not None and getattr(initial_state, "dtype", None) != torch.float32:
        problem = "an initial state that is not float32 (fla refuses it)"
    opts = _options(
        use_qk_l2norm_in_kernel, use_gate_in_kernel, kwargs.get("A_log"), kwargs.get("dt_bias"), lower_bound,
        use_beta_sigmoid_in_kernel, allow_neg_eigval, state_v_first,
    )  # fmt: skip
    args = (q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, cu_seqlens_cpu, opts, problem)
    return Call("chunk_kda", "chunk_kda", *args)


def _read_fused_recurrent_kda_fwd(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    A_log: Tensor | None = None,
    dt_bias: Tensor | None = None,
    initial_state: Tensor | None = None,
    scale: float | None = None,
    output_final_state: bool = False,
    inplace_final_state: bool = True,
    state_v_first: bool = False,
    cu_seqlens: Tensor | None = None,
    ssm_state_indices: Tensor | None = None,
    num_accepted_tokens: Tensor | None = None,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    lower_bound: float | None = None,
    out: Tensor | None = None,
    **kwargs: Any,
) -> Call:
    """fla 0.6.0's ``fused_recurrent_kda_fwd`` signature (what ``fused_recurrent_kda`` calls)."""
    problem = _extra(kwargs, ())
    if ssm_state_indices is not None or num_accepted_tokens is not None:
        problem = "continuous batching (ssm_state_indices / num_accepted_tokens)"
    elif inplace_final_state and initial_state is None:
        problem = "inplace_final_state without an initial state (fla refuses it)"
    elif use_gate_in_kernel and A_log is None and lower_bound is None:
        problem = "use_gate_in_kernel without A_log or lower_bound"
    elif allow_neg_eigval and not use_beta_sigmoid_in_kernel:
        problem = "allow_neg_eigval without use_beta_sigmoid_in_kernel (fla refuses it)"
    elif isinstance(beta, Tensor) and isinstance(v, Tensor) and beta.dim() == v.dim():
        problem = "a beta per value channel ([B, T, HV, V])"
    opts = _options(
        use_qk_l2norm_in_kernel, use_gate_in_kernel, A_log, dt_bias, lower_bound, use_beta_sigmoid_in_kernel,
        allow_neg_eigval, state_v_first,
    )  # fmt: skip
    final = output_final_state or inplace_final_state
    args = (q, k, v, g, beta, scale, initial_state, final, cu_seqlens, None, opts, problem, out, inplace_final_state)
    return Call("fused_recurrent_kda_fwd", "fused_recurrent_kda", *args)


def _read_chunk_delta_rule(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    beta: Tensor,
    scale: float | None = None,
    initial_state: Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    cu_seqlens: Tensor | None = None,
    cu_seqlens_cpu: Tensor | None = None,
    **kwargs: Any,
) -> Call:
    """fla 0.6.0's ``chunk_delta_rule`` signature."""
    problem = _extra(kwargs, ("chunk_size",))
    if problem is None and kwargs.get("chunk_size", 64) not in (16, 32, 64):
        problem = f"chunk_size={kwargs['chunk_size']} (fla refuses it)"
    opts = Options(use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
    args = (q, k, v, None, beta, scale, initial_state, output_final_state, cu_seqlens, cu_seqlens_cpu, opts, problem)
    return Call("chunk_delta_rule", "chunk_delta_rule", *args)


READERS: dict[str, Callable[..., Call]] = {
    "chunk_gated_delta_rule": _read_chunk_gated_delta_rule,
    "chunk_kda": _read_chunk_kda,
    "fused_recurrent_kda_fwd": _read_fused_recurrent_kda_fwd,
    "chunk_delta_rule": _read_chunk_delta_rule,
}
KERNEL_OF = {"chunk_gated_delta_rule": "chunk_gated_delta_rule", "chunk_kda": "chunk_kda",
             "fused_recurrent_kda_fwd": "fused_recurrent_kda", "chunk_delta_rule": "chunk_delta_rule"}  # fmt: skip
