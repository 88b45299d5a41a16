"""A crashed trial is run again under compute-sanitizer and its first error lands in the trial's message.

No GPU here: a stand-in for compute-sanitizer runs the real worker command it is given (the job on stdin, exactly
as the real tool would) and then prints memcheck's report format, taken from the H200 log of 2026-11-30.
"""

from __future__ import annotations

import os
import stat
import sys
from pathlib import Path
from types import ModuleType

from dtune.tune import sanitize
from dtune.tune.executor import Evaluator
from dtune.tune.search import worker_env
from dtune.tune.trials import TrialJob

SHAPE = {"B": 1, "T": 2, "H": 1, "HV": 1, "K": 16, "V": 16}
REPORT = """========= COMPUTE-SANITIZER
========= Out-of-range shared or local address
=========     at chunk_intra_kernel+0x11030 in intra.py:263
=========     by thread (0,0,0) in block (322,2,0)
=========     Saved host backtrace up to driver entry point at kernel launch time
=========         Host Frame: launch [0x2780] in __triton_launcher.cpython-312-x86_64-linux-gnu.so
========= ERROR SUMMARY: 898 errors
"""


def job(mode: str) -> TrialJob:
    return TrialJob("fake_recurrent", SHAPE, "fp32", {"MODE": mode, "BV": 8}, 1e-4, device="cpu", warmup=1, repeats=1)


def fake_sanitizer(tmp_path: Path) -> tuple[str, Path]:
    """An executable that checks its options, runs the program after them with our stdin, logs the call, prints the
    report and exits 99 (``--error-exitcode 99``)."""
    calls = tmp_path / "calls.log"
    script = tmp_path / "compute-sanitizer"
    script.write_text(
        f"""#!{sys.executable}
import subprocess, sys
args = sys.argv[1:]
assert args[:6] == ["--tool", "memcheck", "--print-limit", "3", "--error-exitcode", "99"], args
stdin = sys.stdin.read()
done = subprocess.run(args[6:], input=stdin, capture_output=True, text=True)
with open({str(calls)!r}, "a") as f:
    f.write(" ".join(args[6:]) + " rc=" + str(done.returncode) + " job=" + stdin.strip() + "\\n")
sys.stdout.write({REPORT!r})
sys.exit(99)
"""
    )
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return str(script), calls


def test_parse_the_h200_report() -> None:
    count, first = sanitize.parse_sanitizer(REPORT)
    assert count == 898
    assert first == (
        "Out-of-range shared or local address at chunk_intra_kernel+0x11030 in intra.py:263 "
        "by thread (0,0,0) in block (322,2,0)"
    )
    assert sanitize.parse_sanitizer("========= COMPUTE-SANITIZER\n========= ERROR SUMMARY: 0 errors\n") == (0, "")


def test_sanitize_job_runs_the_worker_under_the_tool(fake: ModuleType, tmp_path: Path) -> None:
    tool, calls = fake_sanitizer(tmp_path)
    line = sanitize.sanitize_job(job("crash"), worker_env(interpret=True), tool, timeout=120)
    assert line.startswith("compute-sanitizer: 898 error(s), first: Out-of-range shared or local address at ")
    assert "intra.py:263" in line and "block (322,2,0)" in line
    (call,) = calls.read_text().splitlines()
    assert "-m dtune.tune.worker" in call and "rc=3" in call and '"MODE": "crash"' in call  # the real crash ran


def test_a_crashed_trial_carries_the_sanitizer_line_and_others_do_not(fake: ModuleType, tmp_path: Path) -> None:
    tool, calls = fake_sanitizer(tmp_path)
    ev = Evaluator(worker_env(interpret=True), tmp_path, trial_timeout=60, sanitizer=tool)
    try:
        crashed = ev.submit(job("crash")).result().outcome
        assert crashed.reason == "crash"
        assert "exit code 3" in crashed.message  # what the worker said stays first
        assert "| compute-sanitizer: 898 error(s), first: Out-of-range" in crashed.message
        ok = ev.submit(job("ok")).result().outcome
        assert ok.ok and "compute-sanitizer" not in (ok.message or "")
        wrong = ev.submit(job("wrong")).result().outcome  # a gate failure is no crash: no sanitizer run
        assert wrong.reason == "gate" and "compute-sanitizer" not in (wrong.message or "")
    finally:
        ev.close()
    assert len(calls.read_text().splitlines()) == 1


def test_no_sanitizer_no_extra_run(fake: ModuleType, tmp_path: Path) -> None:
    ev = Evaluator(worker_env(interpret=True), tmp_path, trial_timeout=60)
    try:
        crashed = ev.submit(job("crash")).result().outcome
    finally:
        ev.close()
    assert crashed.reason == "crash" and "compute-sanitizer" not in crashed.message
    assert os.environ.get("DTUNE_PLUGINS")  # the fake kernel reached the workers


def test_a_stopping_search_kills_a_sanitizer_run_in_flight(tmp_path: Path) -> None:
    """A sanitizer run can take minutes on a GPU: a search whose budget ends (Evaluator.abort/close) must not wait."""
    import threading
    import time

    hang = tmp_path / "compute-sanitizer"
    hang.write_text(f"#!{sys.executable}\nimport time\ntime.sleep(60)\n")
    hang.chmod(hang.stat().st_mode | stat.S_IEXEC)
    got: list[str] = []
    t = threading.Thread(target=lambda: got.append(sanitize.sanitize_job(job("crash"), {}, str(hang), timeout=120)))
    t0 = time.monotonic()
    t.start()
    while not sanitize._RUNNING and time.monotonic() - t0 < 10:
        time.sleep(0.05)
    sanitize.kill_running()
    t.join(timeout=10)
    assert not t.is_alive() and time.monotonic() - t0 < 20
    assert got == ["compute-sanitizer: stopped before it finished"]
    assert (
        sanitize.sanitize_job(job("crash"), {}, str(hang), timeout=0.5) == "compute-sanitizer: no answer within 0.5 s"
    )


def test_a_trial_whose_worker_the_search_killed_is_cancelled_not_sanitized(fake: ModuleType, tmp_path: Path) -> None:
    """abort() at a bucket's end kills the busy worker: that is no crash of the trial, so no sanitizer run starts
    after it (on the H200 such a run held the next bucket's GPU and the search's close for minutes)."""
    import time

    hang = tmp_path / "compute-sanitizer"
    hang.write_text(f"#!{sys.executable}\nimport time\ntime.sleep(60)\n")
    hang.chmod(hang.stat().st_mode | stat.S_IEXEC)
    ev = Evaluator(worker_env(interpret=True), tmp_path, trial_timeout=60, sanitizer=str(hang))
    try:
        fut = ev.submit(job("hang"))
        t0 = time.monotonic()
        while not ev._busy and time.monotonic() - t0 < 30:
            time.sleep(0.05)
        time.sleep(1.0)  # the worker is in the trial now
        ev.abort()
        outcome = fut.result(timeout=20).outcome
        assert outcome.reason == "cancelled" and "compute-sanitizer" not in outcome.message
        assert not sanitize._RUNNING
        assert ev.submit(job("ok")).result(timeout=60).outcome.ok  # the next job of the next bucket runs
    finally:
        t1 = time.monotonic()
        ev.close()
    assert time.monotonic() - t1 < 20


def test_a_sanitizer_run_does_not_start_once_the_search_stopped(tmp_path: Path) -> None:
    hang = tmp_path / "compute-sanitizer"
    hang.write_text(f"#!{sys.executable}\nimport time\ntime.sleep(60)\n")
    hang.chmod(hang.stat().st_mode | stat.S_IEXEC)
    line = sanitize.sanitize_job(job("crash"), {}, str(hang), timeout=120, cancelled=lambda: True)
    assert line == "compute-sanitizer: not run, the search stopped" and not sanitize._RUNNING
