"""fla's own layers and ops with and without the dtune backend, on the same inputs: speed and agreement (one GPU).

Usage (from the checkout's root):
    python benchmarks/fla_backend.py [--skip layers,ops] [--only NAME,...] [--budget-s 450] [--seq-len 32768]
    python benchmarks/fla_backend.py --interpret [--layers-from DIR]   (CPU dry run: Triton's interpreter, tiny shapes)

1. layers -> $OUT/fla_layers.csv: flash-linear-attention's ``fla.layers.GatedDeltaNet`` configured as Qwen3-Next's
   (H = 16, HV = 32, D = 128) and ``KimiDeltaAttention`` as Kimi Linear's (H = 32 at tensor parallelism 1, H = 4 at
   8; D = 128), the list in benchmarks/model_shapes.toml ``[end_to_end]``: one layer's training step (forward and
   backward of the output to its input and every parameter) and its prefill (forward under no_grad) at B = 1,
   T = --seq-len, bf16, with the dtune backend off (fla's Triton path, or FlashQLA where installed and accepting) and on
   (``dtune.integrations.fla.enable("always")``), same weights and inputs. Median ms of each (``dtune.measure.timing``,
   CUDA events, L2 flushed), the speed ratio, the output's and the worst gradient's relative RMS difference, the route
   fla logged for the attention op, and what the default ``"measured"`` policy decides for the call (dtune, or why it
   yields: no side-by-side measurement at that bucket yet, or a faster peer). Where the time goes ->
   fla_layers_launches.csv (torch.profiler, 3 steps per side): a kernel only one side launches is the attention op's,
   one both launch is the rest of the layer; the row's ``fla_op_ms``, ``dtune_op_ms``, ``op_speedup`` and ``rest_ms``
   (the layer's speedup is bounded by the rest). The layers' models pass every in-kernel option (l2norm, raw gate
   with A_log/dt_bias, beta logits, V-first states): zero lines of their code are changed.
   fla's Gated DeltaNet backward refuses Triton < 3.7.1 on Hopper (its issue 640): its check is lifted for the timing
   only, the row says so, and its gradients are not a reference then (the ops step checks dtune's against float64).
2. ops -> $OUT/fla_ops.csv: every option on its own and the layers' combinations (``dtune.integrations.fla_check``):
   fla's op with and without the backend and the float64 reference of the call, outputs, final states and every
   gradient (A_log and dt_bias included); errors against the reference and against each other, routes from fla's log,
   agreement within bf16 error (dtune's error at most twice fla's or the gate tolerance, on every tensor). Head counts
   as the layers' (fla's autotuning, keyed by heads and head dims, is shared with step 1), T = 2048.
$OUT/fla_backend.json: versions, GPU, whether FlashQLA is installed, the notes and every verdict of the backend.

Cost on one H200 (~6-8 min): fla autotunes on its first call per kernel and shape key (about 1 min for Gated DeltaNet's
forward and backward, 3 for KDA's, less for a forward alone), dtune compiles (~15 s per op); --budget-s stops before
an item when less than a minute (or 1.25x the longest item so far) would be left, and the skipped items are listed.

Needs: fla-core 0.6.0 and flash-linear-attention 0.6.0 (its ``fla.layers``; ``pip install --no-deps`` is enough:
``fla.layers``' package imports every layer and some need transformers, so without transformers this script loads the
two layer modules on their own, which need it only for type hints), einops; flash-qla optional.
--layers-from DIR: a folder holding ``fla/layers`` (an unpacked flash-linear-attention wheel) when it is not installed.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import sys
import time
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's dtune, installed or not
if "--interpret" in sys.argv:  # before triton is imported
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402
from dtune.kernels.reference import reference_with_options  # noqa: E402
from torch import nn  # noqa: E402

import dtune.integrations.fla as dtune_fla  # noqa: E402
from dtune._toml import loads  # noqa: E402
from dtune.integrations import fla_check  # noqa: E402
from dtune.measure.error import rel_rms_error  # noqa: E402
from dtune.measure.launches import Launch, by_name, record  # noqa: E402
from dtune.measure.timing import time_call  # noqa: E402
from dtune.tune import models  # noqa: E402

SHAPES = loads((ROOT / "benchmarks" / "model_shapes.toml").read_text())  # [end_to_end]
MODELS = models.load().models  # dtune/models.toml
MIN_LEFT_S = 60  # an item is started only with this much of the budget left (or 1.25x the longest item so far)
TOL = {torch.bfloat16: 2e-2, torch.float32: 2e-3}


# ---- fla's layers ---------------------------------------------------------------------------------------------


def layer_classes(extra: str | None) -> dict[str, type[nn.Module]]:
    """fla.layers' GatedDeltaNet and KimiDeltaAttention; without transformers, their modules loaded on their own."""
    import fla

    if extra:
        fla.__path__.append(str(Path(extra) / "fla"))  # an unpacked flash-linear-attention wheel or a checkout
    try:
        import fla.layers as layers

        return {"GatedDeltaNet": layers.GatedDeltaNet, "KimiDeltaAttention": layers.KimiDeltaAttention}
    except ModuleNotFoundError as exc:
        if not (exc.name or "").startswith("transformers"):
            raise
    folder = next((Path(p) / "layers" for p in fla.__path__ if (Path(p) / "layers" / "kda.py").is_file()), None)
    if folder is None:
        raise ModuleNotFoundError("fla.layers: install flash-linear-attention 0.6.0 (or pass --layers-from)")
    package = types.ModuleType("fla.layers")  # the package without its __init__ (which imports every layer)
    package.__path__ = [str(folder)]
    sys.modules["fla.layers"] = package
    from fla.layers.gated_deltanet import GatedDeltaNet
    from fla.layers.kda import KimiDeltaAttention

    return {"GatedDeltaNet": GatedDeltaNet, "KimiDeltaAttention": KimiDeltaAttention}


def build_layer(classes: dict[str, type[nn.Module]], model: str, tp: int, tiny: bool) -> nn.Module:
    m = MODELS[model]
    (H, HV), D, hidden = m.heads_at(tp), m.head_dim, m.hidden_size
    if tiny:
        H, HV, D, hidden = 2, 2 * (HV // H), 16, 64
    kw = {"hidden_size": hidden, "head_dim": D, "num_heads": H, "num_v_heads": HV, "expand_v": 1.0, "mode": "chunk"}
    return classes[m.layer](**kw, use_short_conv=True, layer_idx=0)


class TorchShortConv(nn.Module):
    """CPU stand-in of fla's ShortConvolution (depthwise causal conv, SiLU) for the dry run: its Triton kernel is
    autotuned, which needs a GPU."""

    def __init__(self, conv: nn.Conv1d) -> None:
        super().__init__()
        self.weight, self.bias, self.width = conv.weight, conv.bias, conv.weight.shape[-1]

    def forward(self, x: torch.Tensor, **_: Any) -> tuple[torch.Tensor, None]:
        y = nn.functional.conv1d(nn.functional.pad(x.transpose(1, 2), (self.width - 1, 0)), self.weight, self.bias,
                                 groups=x.shape[-1])  # fmt: skip
        return nn.functional.silu(y.transpose(1, 2)), None


class TorchGatedNorm(nn.Module):
    """CPU stand-in of fla's FusedRMSNormGated: RMSNorm of o times act(g)."""

    def __init__(self, norm: Any) -> None:  # fla's FusedRMSNormGated (its attributes untyped here)
        super().__init__()
        self.weight, self.eps, self.activation = norm.weight, norm.eps, norm.activation

    def forward(self, o: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        y = o.float() * torch.rsqrt(o.float().square().mean(-1, keepdim=True) + self.eps) * self.weight.float()
        act = torch.sigmoid if self.activation == "sigmoid" else nn.functional.silu
        return (y * act(g.float())).to(o.dtype)


def cpu_stand_ins(layer: Any) -> None:
    for name in ("q_conv1d", "k_conv1d", "v_conv1d"):
        setattr(layer, name, TorchShortConv(getattr(layer, name)))
    layer.o_norm = TorchGatedNorm(layer.o_norm)
    layer._use_fused_qkv_conv = lambda **_: False  # the fused q/k/v convolution is fla's Triton kernel too


def reference_op(**call: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The float64 reference in place of fla's op (the dry run's 'without dtune': fla's kernels need a GPU)."""
    q, k, v, g, beta = (call.pop(n) for n in ("q", "k", "v", "g", "beta"))
    for n in ("safe_gate", "cu_seqlens_cpu"):
        call.pop(n, None)
    state = (call.pop("initial_state", None), call.pop("output_final_state", False), call.pop("cu_seqlens", None))
    o, ht = reference_with_options(q, k, v, g, beta, call.pop("scale", None), *state, **call)
    return o.to(q.dtype), ht


def layer_row(
    classes: dict[str, type[nn.Module]],
    model: str,
    tp: int,
    mode: str,
    T: int,
    device: torch.device,
    lift: bool,
    launch_rows: list[dict[str, Any]],
) -> dict[str, Any]:
    tiny = device.type != "cuda"
    dtype = torch.bfloat16 if not tiny else torch.float32
    torch.manual_seed(0)
    layer: Any = build_layer(classes, model, tp, tiny).to(device, dtype)  # (fla's layer: attributes untyped)
    module = sys.modules[type(layer).__module__]
    op_name = "chunk_kda" if MODELS[model].family == "kda" else "chunk_gated_delta_rule"
    if tiny:
        cpu_stand_ins(layer)
        T = 72  # above 64: a shorter prompt without grad runs the layer's fused-recurrent mode
    hidden = layer.hidden_size
    x = (torch.randn(1, T, hidden, device=device) * 0.5).to(dtype)
    params = [p for p in layer.parameters() if p.requires_grad]
    do = torch.randn(1, T, hidden, device=device).to(dtype)
    train = mode == "train"
    layer.train(train)

    def step() -> tuple[torch.Tensor, list[torch.Tensor]]:
        if not train:
            with torch.no_grad():
                return layer(x)[0], []
        xi = x.detach().requires_grad_()
        o = layer(xi)[0]
        return o, list(torch.autograd.grad(o, [xi, *params], do))

    row: dict[str, Any] = {"layer": f"{model} TP{tp}", "mode": mode, "B": 1, "T": T, "H": layer.num_heads,
                           "HV": layer.num_v_heads, "D": layer.head_k_dim, "note": ""}  # fmt: skip
    results: dict[str, tuple[torch.Tensor, list[torch.Tensor]]] = {}
    launches: dict[str, list[Launch]] = {}
    lifted: list[Any] = []  # fla's module whose check was lifted (restored after its side: users have the check)
    for side in ("fla", "dtune"):
        dtune_fla.enable("always") if side == "dtune" else dtune_fla.disable()
        original = getattr(module, op_name)
        if tiny and side == "fla":
            setattr(module, op_name, reference_op)  # the dry run's stand-in for fla's path (see reference_op)
        try:
            with fla_check.routes() as log:
                t0 = time.perf_counter()
                try:
                    results[side] = step()
                except RuntimeError as exc:
                    if not (lift and "3.7.1" in str(exc)):
                        raise
                    import fla.ops.common.chunk_o as chunk_o

                    chunk_o.TRITON_ABOVE_3_7_1 = True  # fla refuses its Gated DeltaNet backward on this Triton
                    lifted.append(chunk_o)
                    row["note"] += "fla's gated backward check lifted for timing (fla issue 640: its grads are wrong); "
                    results[side] = step()
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                row[f"{side}_first_s"] = round(time.perf_counter() - t0, 1)
            row[f"route_{side}"] = "reference" if tiny and side == "fla" else fla_check.route_of(log.lines, op_name)
            row[f"{side}_ms"] = time_call(step, device).median_ms if not tiny else float("nan")
            launches[side] = by_name(record(step, device, calls=3)[0])
        finally:
            setattr(module, op_name, original)
            for chunk_o in lifted:
                chunk_o.TRITON_ABOVE_3_7_1 = False
    dtune_fla.disable()
    split_launches(row, launches, launch_rows)
    (o_f, g_f), (o_d, g_d) = results["fla"], results["dtune"]
    row["speedup"] = row["fla_ms"] / row["dtune_ms"] if not tiny else float("nan")
    row["diff_o"] = rel_rms_error(o_d, o_f)
    names = ["x", *(n for n, p in layer.named_parameters() if p.requires_grad)] if train else []
    diffs = [(rel_rms_error(a, b), n) for a, b, n in zip(g_d, g_f, names)]
    worst = max(diffs, default=(0.0, "-"))
    row["diff_grad"], row["worst_grad"] = worst
    row["agree"] = row["diff_o"] <= TOL[dtype] and (worst[0] <= TOL[dtype] or "lifted" in row["note"])
    row["measured_policy"] = measured_verdict(step, module, op_name)
    return row


def split_launches(row: dict[str, Any], launches: dict[str, list[Launch]], out: list[dict[str, Any]]) -> None:
    """Where each side's layer time goes: a kernel launched by one side only is the attention op's (its kernels, and
    dtune's passes for the in-kernel options), one launched by both is the rest of the layer (projections, short
    convolutions, norms: the same work on both sides; dtune's kernels are named apart from fla's). An approximation:
    a PyTorch kernel that both sides' ops also launch (a cast, a copy) counts as the rest. Sets ``{side}_op_ms``,
    ``rest_ms`` (fla's side) and ``op_speedup`` on ``row``; appends one row per kernel and side to ``out``."""
    names = {side: {x.name for x in ls} for side, ls in launches.items()}
    for side, ls in launches.items():
        other = names["dtune" if side == "fla" else "fla"]
        mine = [x for x in ls if x.name not in other]
        row[f"{side}_op_ms"] = sum(x.ms for x in mine)
        if side == "fla":
            row["rest_ms"] = sum(x.ms for x in ls if x.name in other)
        for x in ls:
            out.append({"layer": row["layer"], "mode": row["mode"], "side": side, "kernel": x.name,
                        "launches": x.count, "ms": x.ms, "attention_op": x.name not in other})  # fmt: skip
    row["op_speedup"] = row["fla_op_ms"] / row["dtune_op_ms"] if row.get("dtune_op_ms") else float("nan")


class _Verdict(Exception):
    pass


def measured_verdict(step: Callable[[], Any], module: types.ModuleType, op_name: str) -> str:
    """What the default policy decides for the layer's very call: "dtune", or "yields: <reason>" (the backend's
    verifier is asked with the layer's arguments; nothing runs)."""

    def ask(*args: Any, **kwargs: Any) -> None:
        raise _Verdict(*dtune_fla.DtuneBackend().verify(op_name, *args, **kwargs))

    original = getattr(module, op_name)
    setattr(module, op_name, ask)
    dtune_fla.enable("measured")
    try:
        step()
        return "-"
    except _Verdict as v:
        accepted, reason = v.args
        return ("dtune" + (f" ({reason})" if reason else "")) if accepted else f"yields: {reason}"
    finally:
        dtune_fla.disable()
        setattr(module, op_name, original)


# ---- driver ----------------------------------------------------------------------------------------------------


def write_csv(path: Path, rows: list[dict[str, Any]]) -> None:
    if not rows:
        return
    keys = list(dict.fromkeys(k for r in rows for k in r))
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows(rows)


def fmt(v: Any) -> str:
    return f"{v:.3g}" if isinstance(v, float) else str(v)


def table(rows: list[dict[str, Any]], cols: list[str]) -> str:
    cells = [[fmt(r.get(c, "")) for c in cols] for r in rows]
    widths = [max(len(c), *(len(x[i]) for x in cells)) for i, c in enumerate(cols)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(cols, widths))]
    lines += ["  ".join(x.ljust(w) for x, w in zip(cell, widths)) for cell in cells]
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--interpret", action="store_true", help="CPU dry run under Triton's interpreter (tiny shapes)")
    ap.add_argument("--skip", default="", help="steps to leave out: layers, ops (comma-separated)")
    ap.add_argument("--only", default="", help="only these layer rows ('kimi_linear TP8 prefill') or op cases")
    ap.add_argument("--budget-s", type=float, default=450.0, help="stop starting items after this (default 450)")
    ap.add_argument("--seq-len", type=int, default=SHAPES["end_to_end"]["seq_len"], help="the layers' T")
    ap.add_argument("--ops-seq-len", type=int, default=2048, help="the ops step's T (default 2048)")
    ap.add_argument("--no-lift", action="store_true", help="do not lift fla's Hopper check of its gated backward")
    ap.add_argument("--layers-from", default=None, help="a folder holding fla/layers (if not installed)")
    args = ap.parse_args()
    out = Path(os.environ.get("OUT", "out"))
    out.mkdir(parents=True, exist_ok=True)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.interpret else "cpu")
    start, skip = time.monotonic(), set(filter(None, args.skip.split(",")))
    only = set(filter(None, args.only.split(",")))
    skipped: list[str] = []
    notes: list[str] = []

    longest = [0.0]  # the longest item so far: fla's first call at a new shape autotunes for minutes
    last = [start]

    def budget_left(name: str) -> bool:
        now = time.monotonic()
        longest[0], last[0] = max(longest[0], now - last[0]), now
        if args.budget_s - (now - start) >= max(MIN_LEFT_S, 1.25 * longest[0]) or args.interpret:
            return True
        skipped.append(name)
        return False

    layer_rows: list[dict[str, Any]] = []
    launch_rows: list[dict[str, Any]] = []
    if "layers" not in skip:
        try:
            classes = layer_classes(args.layers_from)
        except ModuleNotFoundError as exc:
            classes = {}
            notes.append(f"layers skipped: {exc}")
        for model, tp, mode in SHAPES["end_to_end"]["layers"] if classes else []:
            name = f"{model} TP{tp} {mode}"
            if (only and name not in only) or not budget_left(name):
                continue
            print(f"[layers] {name}", flush=True)
            try:
                layer_rows.append(
                    layer_row(classes, model, tp, mode, args.seq_len, device, not args.no_lift, launch_rows)
                )
            except Exception as exc:
                layer_rows.append({"layer": f"{model} TP{tp}", "mode": mode, "note": f"{type(exc).__name__}: {exc}"})
            write_csv(out / "fla_layers.csv", layer_rows)
            write_csv(out / "fla_layers_launches.csv", launch_rows)

    op_rows: list[dict[str, Any]] = []
    if "ops" not in skip:
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        for case in fla_check.cases():
            if (only and case.name not in only) or not budget_left(case.name):
                continue
            print(f"[ops] {case.name}", flush=True)
            m = MODELS["kimi_linear" if "kda" in case.op else "qwen3_next"]
            D = m.head_dim
            dims = fla_check.Dims(1, args.ops_seq_len, m.heads, m.v_heads, D, D)
            if device.type != "cuda":
                dims = fla_check.Dims(1, 20, 1, 2, 16, 32)
            try:
                op_rows.append(fla_check.compare(case, dims, dtype, device))
            except Exception as exc:
                op_rows.append({"case": case.name, "agree": False, "note": f"{type(exc).__name__}: {exc}"[:200]})
            write_csv(out / "fla_ops.csv", op_rows)

    import fla

    env = {
        "torch": torch.__version__,
        "triton": __import__("triton").__version__,
        "fla": getattr(fla, "__version__", "?"),
        "flash_qla": __import__("importlib.util").util.find_spec("flash_qla") is not None,
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (Triton's interpreter)",
        "elapsed_s": round(time.monotonic() - start, 1),
        "skipped_for_budget": skipped,
        "notes": notes,
    }
    (out / "fla_backend.json").write_text(json.dumps({"env": env}, indent=1, default=str) + "\n")
    if op_rows:
        print("\nfla ops with and without the dtune backend (errors: worst tensor, relative RMS)")
        print(table(op_rows, ["case", "route_without", "route_with", "dtune_vs_ref", "fla_vs_ref", "dtune_vs_fla",
                              "agree", "note"]))  # fmt: skip
    if layer_rows:
        print(f"\nfla layers, one layer, B = 1, T = {layer_rows[0].get('T', args.seq_len)}: fla's path vs dtune's")
        for r in layer_rows:  # the table's cell: the verdict's start (the CSV has all of it)
            r["policy"] = str(r.get("measured_policy", ""))[:48]
        cols = ["layer", "mode", "H", "HV", "fla_ms", "dtune_ms", "speedup", "fla_op_ms", "dtune_op_ms", "op_speedup",
                "rest_ms", "diff_o", "diff_grad", "route_fla", "route_dtune", "agree", "policy", "note"]  # fmt: skip
        print(table(layer_rows, cols))
    for line in notes + [f"skipped (budget): {', '.join(skipped)}"] * bool(skipped):
        print(line)
    bad = [r for r in [*op_rows, *layer_rows] if not r.get("agree")]
    print(f"\n{len(op_rows) + len(layer_rows) - len(bad)} of {len(op_rows) + len(layer_rows)} rows agree; {env}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
