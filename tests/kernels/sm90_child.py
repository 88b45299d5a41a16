"""A compile test's case run in a child process: compiled Triton and the interpreter (on in the test process) do not
mix in one process. The child, the test file run as a script, prints its result as JSON on its last line, or exits
with :data:`SKIP_CODE` where this Triton cannot build CUDA code."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import pytest

from dtune._env import child_env

SKIP_CODE = 77


def run(script: str, *args: str, timeout: int = 300) -> Any:
    """``python script *args`` without TRITON_INTERPRET, this checkout's dtune first on its path: its last line as
    JSON (the test skipped where the child could not compile, failed where it failed)."""
    env = child_env({k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"})
    proc = subprocess.run(
        [sys.executable, script, *args], env=env, capture_output=True, text=True, timeout=timeout, check=False
    )
    if proc.returncode == SKIP_CODE:
        pytest.skip(proc.stdout.strip()[-500:])
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])
