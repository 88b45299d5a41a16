"""Plant small bugs one at a time in a copy of this checkout and run the tests that cover each: how many the suite
catches. The bugs are data (``scripts/plant_bugs.toml``: the file, the text replaced, the tests to run); a planted bug
is *caught* when its tests fail, *survived* when they pass (a gap in the suite), *broken* when pytest could not run
them (a collection error: the planted text does not even import).

Usage:  python scripts/plant_bugs.py [--only WORD] [--out DIR] [--workers N] [--timeout S]
e.g.    python scripts/plant_bugs.py --only decode

The copy holds the files git tracks, as they are in the working tree; each run's pytest stops at its first failure
(``-x``), with the kernels under Triton's interpreter unless ``TRITON_INTERPRET`` is set otherwise. Results:
``DIR/plant_bugs.csv`` (default ``./out``), one row per bug, and a table printed last.
"""

from __future__ import annotations

import argparse
import csv
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's dtune, installed or not

from dtune import _toml  # noqa: E402

BUGS = Path(__file__).with_suffix(".toml")


@dataclass(frozen=True)
class Bug:
    name: str
    file: str
    old: str
    new: str
    tests: tuple[str, ...]


@dataclass(frozen=True)
class Outcome:
    bug: Bug
    verdict: str  # "caught", "survived" or "broken"
    first_failure: str
    seconds: float


def load_bugs(path: Path = BUGS) -> list[Bug]:
    """The planted bugs of ``path``; ValueError for one whose text is not found exactly once."""
    bugs = []
    for m in _toml.loads(path.read_text(encoding="utf-8"))["mutant"]:
        bug = Bug(m["name"], m["file"], m["old"], m["new"], tuple(m["tests"]))
        count = (ROOT / bug.file).read_text(encoding="utf-8").count(bug.old)
        if count != 1:
            raise ValueError(f"{bug.name!r}: its text occurs {count} times in {bug.file}, not once")
        bugs.append(bug)
    return bugs


def copy_checkout(dest: Path) -> None:
    """The files git tracks, as they are in the working tree."""
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    for name in files.decode().split("\0"):
        if name and (ROOT / name).is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, dest / name)


def first_failure(output: str) -> str:
    m = re.search(r"^FAILED (\S+)", output, re.M) or re.search(r"^(\S+::\S+) FAILED", output, re.M)
    return m.group(1) if m else ""


def plant(bug: Bug, tree: Path, workers: int, timeout: float) -> Outcome:
    """Run ``bug``'s tests in ``tree`` with the bug planted, then restore the file."""
    path = tree / bug.file
    original = path.read_text(encoding="utf-8")
    path.write_text(original.replace(bug.old, bug.new, 1), encoding="utf-8")
    env = {"TRITON_INTERPRET": "1", **os.environ, "PYTHONPATH": str(tree), "PYTHONDONTWRITEBYTECODE": "1"}
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "-o", "addopts=", "-rf"]
    if workers > 1:
        cmd += ["-n", str(workers)]
    start = time.monotonic()
    try:
        proc = subprocess.run([*cmd, *bug.tests], cwd=tree, env=env, capture_output=True, text=True, timeout=timeout)
        rc, out = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired:
        rc, out = -1, ""
    finally:
        path.write_text(original, encoding="utf-8")
    seconds = time.monotonic() - start
    failed = first_failure(out)
    if rc == 1 or (rc == 2 and failed):  # 2: xdist's stop at the first failure (-x)
        return Outcome(bug, "caught", failed, seconds)
    if rc == 0:
        return Outcome(bug, "survived", "", seconds)
    return Outcome(bug, "broken", "timeout" if rc == -1 else f"pytest exit {rc}", seconds)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default="", help="only the bugs whose name contains this word")
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "out")))
    ap.add_argument("--workers", type=int, default=1, help="pytest-xdist workers per bug")
    ap.add_argument("--timeout", type=float, default=900, help="seconds a bug's tests may take")
    a = ap.parse_args()
    bugs = [b for b in load_bugs() if a.only in b.name]
    a.out.mkdir(parents=True, exist_ok=True)
    outcomes = []
    with tempfile.TemporaryDirectory(prefix="plant-bugs-") as tmp:
        tree = Path(tmp)
        copy_checkout(tree)
        for i, bug in enumerate(bugs, 1):
            o = plant(bug, tree, a.workers, a.timeout)
            outcomes.append(o)
            print(f"[{i}/{len(bugs)}] {o.verdict:<8} {o.seconds:6.0f} s  {bug.name}", flush=True)
    with open(a.out / "plant_bugs.csv", "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(["bug", "file", "verdict", "first_failure", "seconds"])
        for o in outcomes:
            w.writerow([o.bug.name, o.bug.file, o.verdict, o.first_failure, f"{o.seconds:.0f}"])
    caught = sum(o.verdict == "caught" for o in outcomes)
    print(f"\n{'bug':<72} {'verdict':<9} first failing test")
    for o in outcomes:
        print(f"{o.bug.name:<72} {o.verdict:<9} {o.first_failure}")
    print(f"\ncaught {caught} of {len(outcomes)} planted bugs")


if __name__ == "__main__":
    main()
