"""A crashed trial, run again under ``compute-sanitizer --tool memcheck``: its first error goes into the trial's
message, so a search records *where* a config faults (kernel, source line, thread and block), not only that the
worker died.

An illegal memory access kills the CUDA context, and its exception names no kernel (H200, 2026-11-30: trial 10 of a
chunk_kda search crashed that way; compute-sanitizer placed it at ``chunk_intra_kernel`` in ``intra.py:263``, which
led to the root cause). Runs once per crashed trial, in a fresh worker process under the sanitizer, on the timing
worker's GPU; only when the sanitizer is installed (``dtune search --no-sanitize`` turns it off).
"""

from __future__ import annotations

import glob
import json
import re
import shutil
import subprocess
import sys
import threading
from collections.abc import Callable
from typing import Any

# Trial outcomes worth a sanitizer run: the worker died, or the GPU raised at run time.
REASONS = ("crash", "runtime")
_RUNNING: set[subprocess.Popen[str]] = set()  # sanitizer runs in flight (a search that stops kills them)
_LOCK = threading.Lock()


def kill_running() -> None:
    """Stop every sanitizer run in flight (the search's budget ran out, or it was interrupted)."""
    with _LOCK:
        procs = list(_RUNNING)
    for proc in procs:
        if proc.poll() is None:
            proc.kill()


def find_sanitizer() -> str | None:
    """``compute-sanitizer`` on PATH or in a CUDA toolkit under /usr/local, else None."""
    found = shutil.which("compute-sanitizer")
    if found:
        return found
    hits = sorted(glob.glob("/usr/local/cuda*/bin/compute-sanitizer")) + sorted(
        glob.glob("/usr/local/cuda*/compute-sanitizer/compute-sanitizer")
    )
    return hits[-1] if hits else None


def parse_sanitizer(text: str) -> tuple[int | None, str]:
    """(error count, first error with its location and thread/block) of compute-sanitizer's output."""
    m = re.search(r"ERROR SUMMARY: (\d+) error", text)
    lines = text.splitlines()
    for i, line in enumerate(lines):
        body = line.removeprefix("=========").strip()
        if line.startswith("========= ") and body and not line.startswith("=========  "):
            if re.match(r"(COMPUTE-SANITIZER|ERROR SUMMARY|Target application)", body):
                continue
            where = [x.removeprefix("=========").strip() for x in lines[i + 1 : i + 3]]
            return (int(m.group(1)) if m else None), " ".join([body, *where])
    return (int(m.group(1)) if m else None), ""


def sanitize_job(
    job: Any, env: dict[str, str], sanitizer: str, timeout: float, cancelled: Callable[[], bool] | None = None
) -> str:
    """Run trial ``job`` (a :class:`~dtune.tune.trials.TrialJob`) once in a worker under ``sanitizer``; one line
    saying what the sanitizer found (the first error and the count), that it found nothing, or why it could not.
    ``cancelled()`` true (checked under the lock that :func:`kill_running` takes): the search has stopped, and no run
    starts."""
    cmd = [sanitizer, "--tool", "memcheck", "--print-limit", "3", "--error-exitcode", "99"]
    cmd += [sys.executable, "-m", "dtune.tune.worker"]
    line = json.dumps(job.__dict__) + "\n"
    with _LOCK:
        if cancelled is not None and cancelled():
            return "compute-sanitizer: not run, the search stopped"
        try:
            proc = subprocess.Popen(
                cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
            )
        except OSError as e:
            return f"compute-sanitizer could not run: {e}"
        _RUNNING.add(proc)
    try:
        out, err = proc.communicate(line, timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        return f"compute-sanitizer: no answer within {timeout:g} s"
    finally:
        with _LOCK:
            _RUNNING.discard(proc)
    if proc.returncode < 0:
        return "compute-sanitizer: stopped before it finished"
    count, first = parse_sanitizer(out + "\n" + err)
    if first:
        return f"compute-sanitizer: {count if count is not None else '?'} error(s), first: {first}"[:600]
    return f"compute-sanitizer: no error found (exit code {proc.returncode})"
