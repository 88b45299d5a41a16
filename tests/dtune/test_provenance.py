"""The commit recorded with every result: $DTUNE_COMMIT first (a GPU machine's copy of the tree can carry an older
.git: the H200 runs of 2026-11-30 recorded that stale commit until this rule), else the checkout's HEAD."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from dtune.provenance import ENV, git_commit


def test_env_commit_wins_over_the_checkout(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV, "e30dd91")
    assert git_commit() == "e30dd91"


def test_checkout_head_without_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV, raising=False)
    root = Path(__file__).resolve().parents[2]
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, check=False)
    if head.returncode != 0:
        pytest.skip("not a git checkout")
    got = git_commit()
    assert got is not None and re.fullmatch(r"[0-9a-f]{40}", got)
    assert got == head.stdout.strip()
