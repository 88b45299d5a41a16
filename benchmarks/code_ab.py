"""Kernel code A/B: the same calls timed from two or more source trees (git revisions or the working tree), each in
its own process, alternated round by round, with every tree's outputs compared to the first tree's.

For a change to a kernel's code rather than to its config (a config change is a search parameter and is timed side
by side in one process: ``benchmarks/bwd_variants.py``, ``fwd_variants.py``). Each tree is a copy of the package
(``dtune/``, ``kernels/``, ``search_spaces/``) at a revision; its process imports that copy, builds the call with its
own harness (:func:`dtune.measure.harness.op_run`: the op's default call, a ``*_bwd`` kernel's training step) and
times it (:func:`dtune.measure.timing.time_call`: CUDA events with the L2 flushed). Round 1 runs every tree once
(compiling; Triton's cache then serves the others), rounds 2.. time them in turn; the first tree's outputs (the
output, the final state, every gradient) are saved and each other tree's are compared to them (relative RMS).

Usage (from the checkout's root):
    python benchmarks/code_ab.py build DIR REV [REV ...]     copy each revision's package to DIR/<name> (REV: a git
                                                             revision, or "." for the working tree; where git is)
    python benchmarks/code_ab.py run DIR [--kernels chunk_gated_delta_rule_bwd,...] [--shape 8,4096,16,128]
                                         [--rounds 3]        on the GPU machine; tables printed last, rows in
                                                             DIR/code_ab.jsonl (or $OUT/code_ab.jsonl)
    python benchmarks/code_ab.py run DIR --interpret         CPU, Triton's interpreter, float32, a tiny shape

Printed last: per kernel, each tree's median ms over the timed rounds, its spread (min-max) and its ratio to the
first tree, and its worst relative RMS difference from the first tree's outputs.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ("dtune", "kernels", "search_spaces")  # what a tree holds: the package as a source checkout lays it out
KERNELS = ("chunk_delta_rule_bwd", "chunk_gated_delta_rule_bwd")


def tree_name(rev: str) -> str:
    """A folder name for a revision: ``worktree`` for ``"."``, else the revision with path characters replaced."""
    return "worktree" if rev == "." else rev.replace("/", "_").replace("~", "-").replace("^", "-")


def build(out: Path, revs: list[str], root: Path = ROOT) -> list[Path]:
    """Copy the package of each revision (``"."``: the working tree as it is) to ``out/<name>``, in order."""
    if len(revs) < 2:
        raise SystemExit("code_ab build: give at least two revisions (the first is the reference)")
    out.mkdir(parents=True, exist_ok=True)
    trees = []
    for i, rev in enumerate(revs):
        dest = out / f"{i}-{tree_name(rev)}"
        shutil.rmtree(dest, ignore_errors=True)
        dest.mkdir()
        if rev == ".":
            for part in PACKAGE:
                shutil.copytree(root / part, dest / part, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            with tempfile.TemporaryFile() as tar:
                subprocess.run(["git", "-C", str(root), "archive", rev, *PACKAGE], stdout=tar, check=True)
                tar.seek(0)
                with tarfile.open(fileobj=tar) as tf:
                    tf.extractall(dest, filter="data")
        trees.append(dest)
    return trees


def trees_in(folder: Path) -> list[Path]:
    """The trees ``build`` made, in its order (``<index>-<name>``)."""
    trees = sorted((p for p in folder.iterdir() if (p / "dtune" / "__init__.py").is_file()),
                   key=lambda p: int(p.name.split("-", 1)[0]))  # fmt: skip
    if len(trees) < 2:
        raise SystemExit(f"code_ab run: {folder} holds {len(trees)} tree(s); make them with `code_ab.py build`")
    return trees


def tensors(result: Any) -> list[Any]:
    """The tensors a call returned, in a fixed order: a forward's ``(o, final state)``, a training step's output,
    final state and every gradient (by input name)."""
    import torch

    items = list(result)
    if items and isinstance(items[-1], dict):  # a training step: (o, final state, {input: gradient})
        grads = items.pop()
        items += [grads[n] for n in sorted(grads)]
    return [t for t in items if isinstance(t, torch.Tensor)]


def child(tree: Path, kernels: list[str], shape: list[int], mode: str, ref: Path, interpret: bool) -> dict[str, Any]:
    """Run in a process of its own, with ``tree`` first on the path: each kernel's call (built and timed by the tree's
    own harness); ``mode``: ``"save"`` its outputs to ``ref``, ``"compare"`` them with ``ref``'s, ``"time"`` only."""
    sys.path.insert(0, str(tree))
    import torch

    import dtune
    from dtune.measure.error import rel_rms_error
    from dtune.measure.harness import op_run
    from dtune.measure.timing import time_call
    from dtune.shape import Gate, Shape

    if not Path(dtune.__file__).resolve().is_relative_to(tree.resolve()):
        raise SystemExit(f"code_ab: imported dtune from {dtune.__file__}, not from the tree {tree}")
    device = torch.device("cpu" if interpret else "cuda")
    dtype = torch.float32 if interpret else torch.bfloat16
    B, T, H, D = shape
    row: dict[str, Any] = {"tree": tree.name}
    for kernel in kernels:
        run = op_run(kernel, Shape(B, T, H, H, D, D, gate=Gate.NONE), dtype, device)
        call = run.call(None)
        outs = [t.detach().float().cpu() for t in tensors(call())]
        path = ref / f"{kernel}.pt"
        if mode == "save":
            torch.save(outs, path)
        elif mode == "compare":
            base = torch.load(path)
            row[f"{kernel}_diff"] = max(rel_rms_error(a, b) for a, b in zip(outs, base))
        if mode != "save" or not interpret:
            row[kernel] = time_call(call, device, repeats=3 if interpret else 50).median_ms
    return row


def run(folder: Path, kernels: list[str], shape: list[int], rounds: int, interpret: bool, out: Path) -> list[dict]:
    """Every tree once per round (the first round compiles and saves / compares outputs), in separate processes."""
    trees = trees_in(folder)
    ref = out / "code_ab_ref"
    ref.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, **({"TRITON_INTERPRET": "1"} if interpret else {}))
    rows: list[dict[str, Any]] = []
    log = out / "code_ab.jsonl"
    for r in range(rounds + 1):
        for i, tree in enumerate(trees):
            mode = ("save" if i == 0 else "compare") if r == 0 else "time"
            args = [sys.executable, __file__, "child", str(tree), "--kernels", ",".join(kernels), "--shape",
                    ",".join(map(str, shape)), "--mode", mode, "--ref", str(ref)]  # fmt: skip
            args += ["--interpret"] * interpret
            done = subprocess.run(args, env=env, capture_output=True, text=True)
            lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
            if done.returncode or not lines:
                print(f"{tree.name} round {r}: failed\n{done.stderr[-2000:]}", flush=True)
                continue
            row = {**json.loads(lines[-1]), "round": r}
            rows.append(row)
            with log.open("a") as f:
                f.write(json.dumps(row) + "\n")
            print(json.dumps(row), flush=True)
    return rows


def table(rows: list[dict[str, Any]], kernels: list[str]) -> list[str]:
    """Per kernel and tree: median of the timed rounds (round 0 is the compile round, used only where it is the one
    round), spread, ratio to the first tree, output difference from the first tree."""
    names = list(dict.fromkeys(r["tree"] for r in rows))
    lines = [f"{'kernel':<28} {'tree':<24} {'ms':>8} {'min-max':>17} {'x first':>8} {'diff':>9}"]
    for kernel in kernels:
        first = None
        for name in names:
            rs = [r for r in rows if r["tree"] == name and kernel in r]
            timed = [r[kernel] for r in rs if r["round"] > 0] or [r[kernel] for r in rs]
            if not timed:
                continue
            ms = statistics.median(timed)
            first = first or ms
            diff = next((r[f"{kernel}_diff"] for r in rs if f"{kernel}_diff" in r), None)
            lines.append(
                f"{kernel:<28} {name:<24} {ms:8.4f} {min(timed):8.4f}-{max(timed):<8.4f} {first / ms:8.3f} "
                + (f"{diff:9.2e}" if diff is not None else f"{'-':>9}")
            )
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="copy each revision's package into DIR")
    b.add_argument("dir", type=Path)
    b.add_argument("revs", nargs="+", help='git revisions, "." for the working tree; the first is the reference')
    for name in ("run", "child"):
        p = sub.add_parser(name, help="time the trees in DIR" if name == "run" else argparse.SUPPRESS)
        p.add_argument("dir", type=Path)
        p.add_argument("--kernels", default=",".join(KERNELS), help="kernels (a *_bwd kernel: its training step)")
        p.add_argument("--shape", default="8,4096,16,128", help="B,T,H,D (K = V = D, HV = H)")
        p.add_argument("--interpret", action="store_true", help="CPU, Triton's interpreter, float32")
        if name == "run":
            p.add_argument("--rounds", type=int, default=3, help="timed rounds after the compile round")
        else:
            p.add_argument("--mode", choices=("save", "compare", "time"), default="time")
            p.add_argument("--ref", type=Path, required=True)
    a = ap.parse_args()
    if a.cmd == "build":
        for tree in build(a.dir, a.revs):
            print(tree)
        return
    kernels = [k for k in a.kernels.split(",") if k]
    shape = [int(x) for x in a.shape.split(",")]
    if a.cmd == "child":
        print(json.dumps(child(a.dir, kernels, shape, a.mode, a.ref, a.interpret)))
        return
    if not a.interpret:
        import torch

        if not torch.cuda.is_available():
            raise SystemExit("code_ab run: needs a CUDA GPU (or --interpret: CPU, Triton's interpreter)")
    out = Path(os.environ.get("OUT", a.dir))
    out.mkdir(parents=True, exist_ok=True)
    rows = run(a.dir, kernels, shape, a.rounds, a.interpret, out)
    print("\n".join(table(rows, kernels)))


if __name__ == "__main__":
    main()
