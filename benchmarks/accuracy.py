"""Accuracy of the shipped chunk_kda configs in bf16: each config's error with DIAG_BF16 on and off, against the
template's default config and fla on the same inputs.

For every chunk_kda entry of a tuned-config file (default: the shipped ``dtune/configs/h200.json``), on its bucket's
shape (capped at ``--max-tokens`` tokens, B8 T4096 H16 D128 at most by default) and on a small shape (B2 T1024, the
same head dims), with strong gates (the correctness gate's: log decays down to -5, a random initial state) and mild
ones (down to -0.5): the relative RMS error of the output o and of the final state against the float64 chunked
reference, for

* the config as shipped and the same config with ``DIAG_BF16`` flipped (the isolation: ``DIAG_BF16`` rounds the
  diagonal blocks' dots to bfloat16, the suspected cause of 4.0e-3 against fla's 3.3e-3),
* the template's default config (float32 diagonal blocks: what the search's accuracy criterion compares with),
* fla's fastest mode (``safe_gate=True, lower_bound=-5``) and fla's default, when fla is installed.

It also says what the search's accuracy criterion (``[accuracy] bf16`` of ``search_spaces/chunk_kda.toml``: a
config's error at most that many times the default's on the same inputs) decides for each variant. Writes
``$OUT/accuracy.csv`` (one row per config, shape, gates and variant) and ``$OUT/accuracy.json`` (the environment and
the summary); prints a table last. About 2-3 minutes on an H200 (mostly Triton compiles of the 17 configs).

``--interpret`` is a dry run on the CPU under Triton's interpreter: tiny shapes, float32 (bfloat16 dots are wrong in
the interpreter; ``DIAG_BF16`` changes nothing in float32), no fla.

    python benchmarks/accuracy.py                      # GPU: the shipped H200 configs
    python benchmarks/accuracy.py --interpret --out /tmp/acc
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's dtune, installed or not

KERNEL = "chunk_kda"
STRONG, MILD = -5.0, -0.5  # the strongest per-step log decay drawn
VARIANTS = ("shipped", "diag_flipped", "default", "fla_fast", "fla")


@dataclass(frozen=True)
class Case:
    """One input set: a shape and a gate strength, shared by every config run on it."""

    B: int
    T: int
    H: int
    D: int
    gates: str  # strong | mild

    @property
    def label(self) -> str:
        return f"B{self.B} T{self.T} H{self.H} D{self.D}"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--configs", type=Path, default=None, help="tuned-config JSON (default: the shipped h200.json)")
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "out")), help="results folder ($OUT, ./out)")
    p.add_argument("--max-tokens", type=int, default=32768, help="cap on B*T of a bucket's shape (default 32768)")
    p.add_argument("--ratio", type=float, default=None, help="criterion to apply (default: the space's [accuracy])")
    p.add_argument("--interpret", action="store_true", help="CPU dry run under Triton's interpreter (fp32, tiny)")
    return p.parse_args(argv)


def cases_for(bucket: dict[str, int], max_tokens: int, interpret: bool) -> list[Case]:
    """The bucket's shape capped at ``max_tokens`` and a small one, each with strong and mild gates."""
    D = bucket["K"]
    if interpret:
        shapes = [(1, 40, 2, 32), (2, 17, 2, 32)]
    else:
        T = min(bucket["T"], max_tokens)
        B = max(1, min(bucket["B"], max_tokens // T))
        shapes = [(B, T, bucket["H"], D), (2, 1024, bucket["H"], D)]
    return [Case(B, T, H, d, g) for B, T, H, d in shapes for g in ("strong", "mild")]


class Runner:
    """Inputs and float64 references per case (computed once), and each variant's errors on them."""

    def __init__(self, dtype: Any, device: str) -> None:
        self.dtype, self.device = dtype, device
        self._cases: dict[Case, tuple[dict[str, Any], Any, Any]] = {}

    def case(self, c: Case) -> tuple[dict[str, Any], Any, Any]:
        if c not in self._cases:
            from dtune.kernels.reference import chunk_reference

            from dtune.measure.inputs import make_inputs
            from dtune.shape import Gate, Shape

            shape = Shape(c.B, c.T, c.H, c.H, c.D, c.D, c.B, Gate.CHANNEL)
            gate_min = STRONG if c.gates == "strong" else MILD
            x = make_inputs(shape, dtype=self.dtype, device=self.device, seed=11, gate_min=gate_min)
            x["scale"], x["output_final_state"] = c.D**-0.5, True
            ref_o, ref_s = chunk_reference(**x)
            self._cases.clear()  # one case's tensors in memory at a time (the cases come in order)
            self._cases[c] = (x, ref_o, ref_s)
        return self._cases[c]

    def errors(self, c: Case, run: Callable[[dict[str, Any]], tuple[Any, Any]]) -> tuple[float, float]:
        from dtune.measure.error import rel_rms_error

        x, ref_o, ref_s = self.case(c)
        o, s = run(x)
        return rel_rms_error(o, ref_o), rel_rms_error(s, ref_s)


def dtune_call(config: dict[str, Any]) -> Callable[[dict[str, Any]], tuple[Any, Any]]:
    from dtune.ops import run_kernel

    def run(x: dict[str, Any]) -> tuple[Any, Any]:
        kw = {n: x[n] for n in ("scale", "initial_state", "cu_seqlens")}
        out: tuple[Any, Any] = run_kernel(
            KERNEL, x["q"], x["k"], x["v"], x["g"], x["beta"], output_final_state=True, config=dict(config), **kw
        )
        return out

    return run


def fla_calls() -> tuple[dict[str, Callable[[dict[str, Any]], tuple[Any, Any]]], str]:
    from dtune.measure.baselines import KDA_LOWER_BOUND, fla_forward, fla_function

    fn, why = fla_function(KERNEL)
    if fn is None:
        return {}, why
    return {
        "fla_fast": fla_forward(fn, True, safe_gate=True, lower_bound=KDA_LOWER_BOUND),
        "fla": fla_forward(fn, True),
    }, ""


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.interpret:
        os.environ["TRITON_INTERPRET"] = "1"  # before Triton is imported
    import torch

    from dtune.store import read_configs
    from dtune.tune.space import load_space

    t0 = time.monotonic()
    interpret = args.interpret
    if not interpret and not torch.cuda.is_available():
        print("accuracy.py needs a CUDA GPU (or --interpret for the CPU dry run)", file=sys.stderr)
        return 2
    dtype, device = (torch.float32, "cpu") if interpret else (torch.bfloat16, "cuda")
    dtype_key = "fp32" if interpret else "bf16"
    ratio = args.ratio if args.ratio is not None else load_space(KERNEL).accuracy.get("bf16")
    if args.configs is None:
        from importlib import resources

        args.configs = Path(str(resources.files("dtune.configs").joinpath("h200.json")))
    tuned = read_configs(args.configs)
    entries = [e for e in tuned.entries if e.kernel == KERNEL and e.dtype == "bf16"]
    if not entries:
        print(f"{args.configs}: no bf16 {KERNEL} entries", file=sys.stderr)
        return 2
    fla, fla_note = ({}, "no fla under the interpreter") if interpret else fla_calls()
    runner = Runner(dtype, device)
    rows: list[dict[str, Any]] = []
    by_case: dict[Case, list[tuple[str, dict[str, Any]]]] = {}
    for i, e in enumerate(entries):
        for c in cases_for(e.bucket, args.max_tokens, interpret):
            by_case.setdefault(c, []).append((f"{i}", e.config))
    # every case once, in order: its reference, the default and fla, then each config run on it
    for c, configs in by_case.items():
        base: dict[str, tuple[float, float]] = {"default": runner.errors(c, dtune_call({}))}
        for name, call in fla.items():
            base[name] = runner.errors(c, call)
        for index, config in configs:
            shipped = runner.errors(c, dtune_call(config))
            flipped_cfg = {**config, "DIAG_BF16": not config.get("DIAG_BF16", False)}
            flipped = runner.errors(c, dtune_call(flipped_cfg))
            entry = entries[int(index)]
            for variant, (err_o, err_s), cfg in (
                ("shipped", shipped, config),
                ("diag_flipped", flipped, flipped_cfg),
                *((n, base[n], {}) for n in base),
            ):
                d_o, d_s = base["default"]
                rows.append(
                    {
                        "config": index,
                        "bucket": "T{T}-B{B}-H{H}-HV{HV}-K{K}-V{V}".format(**entry.bucket),
                        "shape": c.label,
                        "gates": c.gates,
                        "variant": variant,
                        "diag_bf16": cfg.get("DIAG_BF16") if variant in ("shipped", "diag_flipped") else None,
                        "err_o": err_o,
                        "err_s": err_s,
                        "vs_default_o": err_o / d_o if d_o > 0 else float("nan"),
                        "vs_default_s": err_s / d_s if d_s > 0 else float("nan"),
                        "dtype": dtype_key,
                    }
                )
        if not interpret:
            torch.cuda.empty_cache()
        print(f"{c.label} {c.gates}: {len(configs)} config(s), {time.monotonic() - t0:.0f} s", file=sys.stderr)
    elapsed = time.monotonic() - t0
    for r in rows:  # what the search's criterion decides for each config variant (the baselines: nothing)
        worst = max(r["vs_default_o"], r["vs_default_s"])
        judged = ratio is not None and r["variant"] in ("shipped", "diag_flipped")
        r["criterion"] = ("pass" if worst <= ratio else "fail") if judged else None
    write(args.out, rows, args, tuned.source, ratio, fla_note, elapsed, interpret)
    print_table(rows, ratio, fla_note, elapsed)
    if interpret:
        print("dry run in fp32: the errors are float32 rounding (~1e-7) and their ratios noise; run it on a GPU")
    return 0


def summary(rows: list[dict[str, Any]], ratio: float | None) -> dict[str, Any]:
    """Per variant the largest error ratio to the default; per DIAG_BF16 setting what the criterion decides."""
    out: dict[str, Any] = {}
    for variant in VARIANTS:
        mine = [r for r in rows if r["variant"] == variant]
        if mine:
            out[f"max_vs_default_{variant}"] = max(max(r["vs_default_o"], r["vs_default_s"]) for r in mine)
            out[f"max_err_o_{variant}"] = max(r["err_o"] for r in mine)
    for on in (True, False):
        mine = [r for r in rows if r["variant"] in ("shipped", "diag_flipped") and r["diag_bf16"] is on]
        if mine:
            key = "diag_bf16_on" if on else "diag_bf16_off"
            out[f"max_vs_default_{key}"] = max(max(r["vs_default_o"], r["vs_default_s"]) for r in mine)
            out[f"rejected_{key}"] = f"{sum(r['criterion'] == 'fail' for r in mine)} of {len(mine)}"
    out["ratio"] = ratio
    return out


def write(
    out: Path,
    rows: list[dict[str, Any]],
    args: argparse.Namespace,
    source: str,
    ratio: float | None,
    fla_note: str,
    elapsed: float,
    interpret: bool,
) -> None:
    import torch

    from dtune.tune.runinfo import git_commit, versions

    out.mkdir(parents=True, exist_ok=True)
    with (out / "accuracy.csv").open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    meta = {
        "configs": source,
        "max_tokens": args.max_tokens,
        "interpret": interpret,
        "device": "cpu" if interpret else torch.cuda.get_device_name(),
        "versions": versions(),
        "commit": git_commit(),
        "fla": fla_note or "fla_fast = safe_gate=True, lower_bound=-5; fla = its default",
        "elapsed_s": round(elapsed, 1),
        "summary": summary(rows, ratio),
    }
    (out / "accuracy.json").write_text(json.dumps(meta, indent=2) + "\n")


def print_table(rows: list[dict[str, Any]], ratio: float | None, fla_note: str, elapsed: float) -> None:
    """One line per config, shape and gates: err_o of each variant, and the shipped / flipped ratios to the default."""
    keyed: dict[tuple[str, str, str], dict[str, dict[str, Any]]] = {}
    for r in rows:
        keyed.setdefault((r["config"], r["shape"], r["gates"]), {})[r["variant"]] = r
    head = f"{'cfg':>3} {'shape':<20} {'gates':<6} {'DIAG on':>9} {'DIAG off':>9} {'default':>9} {'fla_fast':>9}"
    print(head + f" {'fla':>9} {'on/def':>7} {'off/def':>7}   (relative RMS error of o; states in accuracy.csv)")
    for (cfg, shape, gates), v in keyed.items():
        on = v["shipped"] if v["shipped"]["diag_bf16"] else v["diag_flipped"]
        off = v["diag_flipped"] if v["shipped"]["diag_bf16"] else v["shipped"]

        def err(name: str, v: dict[str, dict[str, Any]] = v) -> str:
            return f"{v[name]['err_o']:9.2e}" if name in v else f"{'-':>9}"

        print(
            f"{cfg:>3} {shape:<20} {gates:<6} {on['err_o']:9.2e} {off['err_o']:9.2e} {err('default')} "
            f"{err('fla_fast')} {err('fla')} {on['vs_default_o']:7.2f} {off['vs_default_o']:7.2f}"
        )
    s = summary(rows, ratio)
    line = (
        f"worst error ratio to the default (o or state): DIAG_BF16 on {s.get('max_vs_default_diag_bf16_on', 0):.2f}x,"
        f" off {s.get('max_vs_default_diag_bf16_off', 0):.2f}x"
    )
    if "max_vs_default_fla_fast" in s:
        line += f", fla_fast {s['max_vs_default_fla_fast']:.2f}x"
    print(line)
    if ratio is not None:
        print(
            f"[accuracy] bf16 = {ratio:g} rejects DIAG_BF16 on in {s.get('rejected_diag_bf16_on', '-')} cases, "
            f"off in {s.get('rejected_diag_bf16_off', '-')}"
        )
    if fla_note:
        print(f"fla: {fla_note}")
    print(f"done in {elapsed:.0f} s")


if __name__ == "__main__":
    raise SystemExit(main())
