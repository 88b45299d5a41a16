"""benchmarks/autotune_cache.py: Triton's autotune results saved from one cache and restored into another, nothing
else carried, nothing overwritten, a foreign archive refused."""

from __future__ import annotations

import json
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "autotune_cache.py"
sys.path.insert(0, str(SCRIPT.parent))
import autotune_cache as ac  # noqa: E402


def fill(cache: Path) -> None:
    for h, name, best in (("aa11", "chunk_fwd_kernel_o", 1.5), ("bb22", "chunk_bwd_kernel_dqkwg", 2.5)):
        (cache / h).mkdir(parents=True)
        (cache / h / f"{name}.autotune.json").write_text(json.dumps({"key": [4096], "configs_timings": [[{}, best]]}))
        (cache / h / f"{name}.cubin").write_bytes(b"\x7fELF compiled")  # a compiled kernel: stays behind


def test_save_then_restore_carries_only_autotune_results(tmp_path: Path) -> None:
    src, dst, archive = tmp_path / "src", tmp_path / "dst", tmp_path / "out" / "autotune.tar.gz"
    fill(src)
    assert ac.save(src, archive) == 2
    with tarfile.open(archive) as tar:
        assert sorted(tar.getnames()) == [
            "aa11/chunk_fwd_kernel_o.autotune.json",
            "bb22/chunk_bwd_kernel_dqkwg.autotune.json",
        ]
    (dst / "bb22").mkdir(parents=True)
    mine = dst / "bb22" / "chunk_bwd_kernel_dqkwg.autotune.json"
    mine.write_text('{"key": [1], "configs_timings": []}')  # this machine's own result wins
    assert ac.restore(dst, archive) == (1, 1)
    assert json.loads((dst / "aa11" / "chunk_fwd_kernel_o.autotune.json").read_text())["configs_timings"][0][1] == 1.5
    assert json.loads(mine.read_text())["key"] == [1]
    assert not list(dst.glob("*/*.cubin"))
    assert [str(p) for p in ac.results(dst)] == [
        "aa11/chunk_fwd_kernel_o.autotune.json", "bb22/chunk_bwd_kernel_dqkwg.autotune.json",
    ]  # fmt: skip


@pytest.mark.parametrize("name", ["../evil.autotune.json", "aa11/run.sh", "aa11/deep/x.autotune.json"])
def test_a_foreign_archive_is_refused(tmp_path: Path, name: str) -> None:
    archive = tmp_path / "bad.tar.gz"
    payload = tmp_path / "payload"
    payload.write_text("{}")
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(payload, arcname=name)
    with pytest.raises(ValueError, match="is not an autotune result"):
        ac.restore(tmp_path / "cache", archive)
    assert not (tmp_path / "cache").exists() and not (tmp_path / "evil.autotune.json").exists()


def test_the_command_line(tmp_path: Path) -> None:
    src, dst, archive = tmp_path / "src", tmp_path / "dst", tmp_path / "a.tar.gz"
    fill(src)
    run = [sys.executable, str(SCRIPT)]
    out = subprocess.run([*run, "save", str(archive), "--cache-dir", str(src)], capture_output=True, text=True)
    assert out.returncode == 0 and "saved 2 autotune result(s)" in out.stdout
    out = subprocess.run([*run, "restore", str(archive), "--cache-dir", str(dst)], capture_output=True, text=True)
    assert out.returncode == 0 and "restored 2 autotune result(s)" in out.stdout
    out = subprocess.run([*run, "restore", str(tmp_path / "none.tar.gz")], capture_output=True, text=True)
    assert out.returncode == 2 and "no archive at" in out.stderr
