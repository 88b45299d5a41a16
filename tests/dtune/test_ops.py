"""The six public ops, called as users call them (positional ``q, k, v, [g,] beta``, keywords after), against the
float64 loop; and the gate contract: ``-inf`` is a full forget, the opt-in check refuses NaN and positive gates
(what the kernels compute for them unchecked: tests/kernels/test_gate_values.py).

Every case uses a scale other than the default, grouped value heads (HV = 2H), K != V, an initial state, strong
decays and a length that is not a multiple of the chunk, so an op that drops ``scale``, swaps ``g`` and ``beta``
(both ``[B, T, HV]`` for Gated DeltaNet), reads the wrong key head or drops the state fails here.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from dtune.kernels.reference import naive_recurrent

from dtune import ops
from dtune.measure.inputs import make_inputs
from dtune.shape import Gate, Shape
from tests.conftest import rel_err

OPS: dict[str, tuple[Callable[..., Any], Gate]] = {
    "fused_recurrent_delta_rule": (ops.fused_recurrent_delta_rule, Gate.NONE),
    "fused_recurrent_gated_delta_rule": (ops.fused_recurrent_gated_delta_rule, Gate.SCALAR),
    "fused_recurrent_kda": (ops.fused_recurrent_kda, Gate.CHANNEL),
    "chunk_delta_rule": (ops.chunk_delta_rule, Gate.NONE),
    "chunk_gated_delta_rule": (ops.chunk_gated_delta_rule, Gate.SCALAR),
    "chunk_kda": (ops.chunk_kda, Gate.CHANNEL),
}
GATED = [name for name, (_, gate) in OPS.items() if gate is not Gate.NONE]
CHUNK_CONFIG = {"BT": 16, "BC": 16}  # small chunks: T = 21 is one full chunk and a partial one
SCALE = 0.37  # not K ** -0.5 = 0.25


def call(name: str, x: dict[str, Any], g: torch.Tensor | None = None, **kw: Any) -> tuple[torch.Tensor, Any]:
    """The op as a user calls it: ``op(q, k, v, g, beta, scale=..., ...)`` (no ``g`` for DeltaNet)."""
    fn, gate = OPS[name]
    gates = () if gate is Gate.NONE else (x["g"] if g is None else g,)
    if name.startswith("chunk"):
        kw.setdefault("config", CHUNK_CONFIG)
    return fn(x["q"], x["k"], x["v"], *gates, x["beta"], **kw)  # type: ignore[no-any-return]


def reference(x: dict[str, Any], g: torch.Tensor | None, **kw: Any) -> tuple[torch.Tensor, torch.Tensor]:
    o, s = naive_recurrent(x["q"], x["k"], x["v"], g, x["beta"], output_final_state=True, **kw)
    assert s is not None
    return o, s


@pytest.mark.parametrize("name", list(OPS))
def test_public_op_matches_the_loop(name: str) -> None:
    gate = OPS[name][1]
    x = make_inputs(Shape(2, 21, 1, 2, 16, 24, 2, gate), seed=31, gate_min=-5.0)
    o, s = call(name, x, scale=SCALE, initial_state=x["initial_state"], output_final_state=True)
    o_ref, s_ref = reference(x, x["g"], scale=SCALE, initial_state=x["initial_state"])
    assert o.shape == x["v"].shape and s is not None
    assert rel_err(o, o_ref) < 1e-4, rel_err(o, o_ref)
    assert rel_err(s, s_ref) < 1e-4, rel_err(s, s_ref)
    # The default scale is K ** -0.5 (K = 16, V = 24: not V's); a different scale must change the output (the op must
    # not ignore it).
    o_default, _ = call(name, x, initial_state=x["initial_state"])
    o_ref_default, _ = reference(x, x["g"], scale=x["q"].shape[-1] ** -0.5, initial_state=x["initial_state"])
    assert rel_err(o_default, o_ref_default) < 1e-4, rel_err(o_default, o_ref_default)
    assert rel_err(o_default, o_ref) > 0.1


@pytest.mark.parametrize("name", list(OPS))
def test_public_op_packed_sequences(name: str) -> None:
    gate = OPS[name][1]
    x = make_inputs(Shape(1, 0, 1, 2, 16, 16, 3, gate, True), seed=32, seq_lens=[5, 0, 19], gate_min=-5.0)
    kw = {"initial_state": x["initial_state"], "cu_seqlens": x["cu_seqlens"]}
    o, s = call(name, x, scale=SCALE, output_final_state=True, **kw)
    o_ref, s_ref = reference(x, x["g"], scale=SCALE, **kw)
    assert s is not None and rel_err(o, o_ref) < 1e-4 and rel_err(s, s_ref) < 1e-4


# ---- the gate contract ---------------------------------------------------------------------------------------


def _gated_inputs(name: str, seed: int = 33) -> dict[str, Any]:
    return make_inputs(Shape(1, 21, 1, 1, 16, 16, 1, OPS[name][1]), seed=seed, gate_min=-5.0)


@pytest.mark.parametrize("name", GATED)
def test_minus_inf_gate_is_a_full_forget(name: str) -> None:
    """A gate of -inf clears the state at that token (and, for KDA, that key channel): the reference's result."""
    x = _gated_inputs(name)
    g = x["g"].clone()
    g[0, 9] = -math.inf  # a full forget of every channel of token 9
    if g.dim() == 4:
        g[0, 14, :, :5] = -math.inf  # KDA: a partial forget of five channels at token 14
    o, s = call(name, x, g=g, initial_state=x["initial_state"], output_final_state=True)
    o_ref, s_ref = reference(x, g, initial_state=x["initial_state"])
    assert torch.isfinite(o).all() and s is not None and torch.isfinite(s).all()
    assert rel_err(o, o_ref) < 1e-4 and rel_err(s, s_ref) < 1e-4


BAD_GATES = [
    (math.nan, "g contains NaN"),
    (5.0, r"g must be a log-space gate <= 0.*largest entry is 5"),
    (1e-3, "0.001"),
]
BAD_IDS = ["nan", "plus-5", "tiny-positive"]


@pytest.mark.parametrize("name", GATED)
@pytest.mark.parametrize(("bad", "match"), BAD_GATES, ids=BAD_IDS)
def test_check_gate_refuses_nan_or_positive(name: str, bad: float, match: str) -> None:
    """The opt-in check: ``check_gate=True`` refuses NaN and positive gates with one line naming ``g``."""
    x = _gated_inputs(name)
    g = x["g"].clone()
    g[0, 20, 0] = bad  # the last token only: the check must read all of g
    with pytest.raises(ValueError, match=match):
        call(name, x, g=g, check_gate=True)


@pytest.mark.filterwarnings("ignore:All-NaN slice:RuntimeWarning")  # numpy, inside the interpreter, on the NaN
@pytest.mark.parametrize("name", GATED)
def test_the_default_call_does_not_read_the_gate(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """By default nothing reads g's values (that would be a host sync per call): a NaN gate is launched, not refused;
    DTUNE_CHECK_GATE's switch (``dtune.inputs.CHECK_GATE``) turns the check on for every call that does not say."""
    import dtune.inputs

    def no_read(g: torch.Tensor) -> None:
        raise AssertionError("the default call read g's values")

    x = _gated_inputs(name)
    g = x["g"].clone()
    g[0, 3] = math.nan
    monkeypatch.setattr(dtune.inputs, "check_gate_values", no_read)
    o, _ = call(name, x, g=g)
    assert o.shape == x["v"].shape
    monkeypatch.undo()
    monkeypatch.setattr(dtune.inputs, "CHECK_GATE", True)
    with pytest.raises(ValueError, match="g contains NaN"):
        call(name, x, g=g)
    call(name, x, g=g, check_gate=False)  # an explicit False wins over the program's switch


@pytest.mark.parametrize(("value", "on"), [("1", True), ("yes", True), ("0", False), ("", False), ("off", False)])
def test_check_gate_environment_variable(value: str, on: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    import dtune.inputs

    monkeypatch.setenv("DTUNE_CHECK_GATE", value)
    assert dtune.inputs._env_flag("DTUNE_CHECK_GATE") is on


def test_check_gate_environment_variable_is_read_at_import() -> None:
    import os
    import subprocess
    import sys

    code = "import dtune.ops, dtune.inputs as i; print(i.CHECK_GATE)"
    for value, want in (("1", "True"), ("0", "False")):
        env = {**os.environ, "DTUNE_CHECK_GATE": value}
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
        assert out.stdout.strip() == want, out.stderr


def test_zero_gate_is_allowed_and_means_no_decay() -> None:
    """g = 0 (decay 1) is the boundary of the contract: Gated DeltaNet with g = 0 is DeltaNet."""
    x = _gated_inputs("fused_recurrent_gated_delta_rule")
    o, _ = call("fused_recurrent_gated_delta_rule", x, g=torch.zeros_like(x["g"]), initial_state=x["initial_state"])
    o_dn, _ = call("fused_recurrent_delta_rule", x, initial_state=x["initial_state"])
    torch.testing.assert_close(o, o_dn)


def test_gate_check_is_skipped_while_capturing(monkeypatch: pytest.MonkeyPatch) -> None:
    """During CUDA-graph capture nothing may be read back: the check is skipped (it would break the capture)."""
    import dtune.inputs

    g = torch.full((1, 2, 1), 5.0)
    monkeypatch.setattr(dtune.inputs, "capturing", lambda t: True)
    dtune.inputs.check_gate_values(g)  # no exception, no read
    monkeypatch.setattr(dtune.inputs, "capturing", lambda t: False)
    with pytest.raises(ValueError, match="largest entry is 5"):
        dtune.inputs.check_gate_values(g)


# ---- the CPU path: what it cannot compute is refused; a normal call warns nothing -------------------------------


@pytest.mark.parametrize("name", [n for n in OPS if n.startswith("chunk")])
def test_bf16_chunk_op_under_the_interpreter_is_refused(name: str) -> None:
    """Triton's interpreter computes bf16 tl.dot wrongly (~1e10): the chunk ops refuse, forward and training step,
    saying why and what to do; float16 and float32 compute right (checked against the loop)."""
    gate = OPS[name][1]
    x = make_inputs(Shape(1, 21, 1, 2, 16, 16, 1, gate), torch.bfloat16, seed=36)
    with pytest.raises(RuntimeError, match=r"bfloat16.*tl\.dot.*use float32 \(or float16\).*CUDA GPU"):
        call(name, x)
    x["q"].requires_grad_()
    with pytest.raises(RuntimeError, match="bfloat16"):
        call(name, x)
    for dtype, tol in ((torch.float16, 5e-3), (torch.float32, 1e-4)):
        y = make_inputs(Shape(1, 21, 1, 2, 16, 16, 1, gate), dtype, seed=36)
        o, _ = call(name, y, initial_state=y["initial_state"])
        o_ref, _ = reference({n: t.double() if isinstance(t, torch.Tensor) else t for n, t in y.items()}, y["g"],
                             initial_state=y["initial_state"])  # fmt: skip
        assert rel_err(o, o_ref) < tol, (dtype, rel_err(o, o_ref))


@pytest.mark.parametrize("name", [n for n in OPS if n.startswith("fused_recurrent")])
def test_bf16_fused_recurrent_under_the_interpreter_is_right(name: str) -> None:
    """The fused-recurrent kernels have no tl.dot: bf16 is right under the interpreter (to bf16 rounding)."""
    x = make_inputs(Shape(1, 21, 1, 2, 16, 16, 1, OPS[name][1]), torch.bfloat16, seed=37)
    o, _ = call(name, x, initial_state=x["initial_state"])
    o_ref, _ = reference({n: t.double() if isinstance(t, torch.Tensor) else t for n, t in x.items()}, x["g"],
                         initial_state=x["initial_state"])  # fmt: skip
    assert o.dtype == torch.bfloat16 and rel_err(o, o_ref) < 1e-2


@pytest.mark.parametrize("name", list(OPS))
def test_a_normal_call_warns_nothing(name: str) -> None:
    """No warning on a normal call (fp32, the interpreter): the forward, the chunk ops' training step, and the opt-in
    gate check on a g that requires grad (no "Converting a tensor with requires_grad=True to a scalar")."""
    gate = OPS[name][1]
    x = make_inputs(Shape(1, 21, 1, 2, 16, 16, 1, gate), seed=38)
    kw = {"initial_state": x["initial_state"], "output_final_state": True}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        call(name, x, **kw)
        if name.startswith("chunk"):
            leaves = {n: t.clone().requires_grad_() if isinstance(t, torch.Tensor) else t for n, t in x.items()}
            extra = {} if gate is Gate.NONE else {"check_gate": True}
            o, s = call(name, leaves, **{**kw, "initial_state": leaves["initial_state"]}, **extra)
            wrt = [t for n, t in leaves.items() if isinstance(t, torch.Tensor) and t.requires_grad]
            torch.autograd.grad((o, s), wrt, (torch.ones_like(o), torch.ones_like(s)))
        elif gate is not Gate.NONE:
            call(name, x, **kw, check_gate=True)


# ---- the tuned config reaches the launch ---------------------------------------------------------------------

TUNED = {  # a legal config for each kernel that differs from its default at K = V = 16
    "fused_recurrent": {"BV": 8, "num_warps": 2, "num_stages": 2},
    "chunk": {"BT": 16, "BC": 16, "INTRA": "rows", "FUSE_OUTPUT": False},
}


@pytest.mark.parametrize("name", list(OPS))
def test_ops_launch_the_tuned_config(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """With no ``config=``, the op launches what the store returns for this kernel and shape (the CPU's store is
    empty, so the lookup is replaced by one that returns a known non-default config); ``config=`` overrides it."""
    from dtune.kernels import get_kernel

    import dtune.ops

    spec = get_kernel(name)
    tuned = TUNED[spec.family]
    asked: list[tuple[Any, ...]] = []
    monkeypatch.setattr(dtune.ops, "tuned_config", lambda *a: asked.append(a) or dict(tuned))
    launched: list[dict[str, Any]] = []
    forward = spec.module.forward

    def spy(*args: Any, **kw: Any) -> Any:
        launched.append(args[-1])  # the config (the chunk family also gets seq_offsets= by keyword)
        return forward(*args, **kw)

    monkeypatch.setattr(spec.module, "forward", spy)
    gate = OPS[name][1]
    x = make_inputs(Shape(1, 21, 1, 2, 16, 16, 1, gate), seed=34)
    fn = OPS[name][0]
    gates = () if gate is Gate.NONE else (x["g"],)
    o, _ = fn(x["q"], x["k"], x["v"], *gates, x["beta"], initial_state=x["initial_state"])
    assert [a[0] for a in asked] == [name] and asked[0][1].K == 16  # looked up for this kernel and shape
    full = spec.check_config(16, 16, tuned)
    assert launched == [full] and full != spec.default_config(16, 16)
    o_ref, _ = reference(x, x["g"], initial_state=x["initial_state"])
    assert rel_err(o, o_ref) < 1e-4
    explicit = spec.default_config(16, 16)
    fn(x["q"], x["k"], x["v"], *gates, x["beta"], config=explicit)
    assert len(asked) == 1 and launched[-1] == explicit  # an explicit config wins; the store is not asked


@pytest.mark.parametrize("name", list(OPS))
def test_public_op_inside_torch_compile(name: str) -> None:
    """A model compiled with torch.compile around a layer that calls an op (as Hugging Face models calling fla's ops
    are): the op is a graph break and runs eagerly, the result the eager call's (it used to fail inside Dynamo)."""
    gate = OPS[name][1]
    x = make_inputs(Shape(1, 21, 1, 2, 16, 24, 1, gate), seed=33, gate_min=-5.0)

    def layer(q: torch.Tensor, h0: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        o, s = call(name, {**x, "q": q * 1.5}, scale=SCALE, initial_state=h0, output_final_state=True)
        return o.sum(-1), s

    want = layer(x["q"], x["initial_state"])
    torch._dynamo.reset()
    got = torch.compile(layer, backend="eager")(x["q"], x["initial_state"])
    assert rel_err(got[0], want[0]) < 1e-6 and rel_err(got[1], want[1]) < 1e-6


def test_training_step_inside_torch_compile() -> None:
    """The chunk op's forward and backward from a compiled function: gradients equal the eager step's."""
    x = make_inputs(Shape(1, 21, 1, 2, 16, 24, 1, Gate.SCALAR), seed=34, gate_min=-5.0)

    def step(q: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        o, s = call("chunk_gated_delta_rule", {**x, "q": q}, g=g, initial_state=x["initial_state"],
                    output_final_state=True)  # fmt: skip
        return (o * o).sum() + s.sum()

    def grads(fn: Callable[..., torch.Tensor]) -> tuple[torch.Tensor, ...]:
        q, g = x["q"].clone().requires_grad_(), x["g"].clone().requires_grad_()
        return torch.autograd.grad(fn(q, g), (q, g))

    want = grads(step)
    torch._dynamo.reset()
    got = grads(torch.compile(step, backend="eager"))
    for a, b in zip(got, want, strict=True):
        assert rel_err(a, b) < 1e-6


def test_an_op_runs_on_its_inputs_device_whichever_is_current(monkeypatch: pytest.MonkeyPatch) -> None:
    """Triton launches on the current CUDA device: a call whose inputs live on another (a model spread over GPUs)
    switches to theirs for the call (the GPU case: tests/kernels/test_hot_path_gpu.py, with two GPUs)."""

    class OnCuda(torch.Tensor):
        is_cuda = True  # type: ignore[assignment]

        @property
        def device(self) -> torch.device:  # type: ignore[override]
            return torch.device("cuda", 1)

    current = [0]

    class Device:  # torch.cuda.device: the current device inside
        def __init__(self, device: torch.device) -> None:
            self.index = device.index

        def __enter__(self) -> None:
            self.before, current[0] = current[0], self.index

        def __exit__(self, *exc: object) -> None:
            current[0] = self.before

    monkeypatch.setattr(torch.cuda, "current_device", lambda: current[0])
    monkeypatch.setattr(torch.cuda, "device", Device)
    seen: list[int] = []

    class Stop(Exception):
        pass

    def first_step(kernel: str) -> None:  # the call's first step: where it runs
        seen.append(current[0])
        raise Stop

    monkeypatch.setattr(ops, "get_kernel", first_step)
    t = torch.empty(1).as_subclass(OnCuda)
    with pytest.raises(Stop):
        ops.run_kernel("chunk_kda", t, t, t, t, t)
    assert seen == [1] and current[0] == 0  # the call on cuda:1, the current device back to 0 after
    current[0] = 1
    with pytest.raises(Stop):
        ops.run_kernel("chunk_kda", t, t, t, t, t)
    assert seen == [1, 1]
    assert ops.other_device(torch.empty(1)) is None  # CPU: as is
