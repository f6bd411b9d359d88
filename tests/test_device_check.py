"""``bash bench/device_check.sh --dry-run``: the GPU machine's check, run on the CPU at toy sizes.

The real mode needs a GPU and so never runs here; its dry run goes through the same steps,
scripts and result checks, so a change that breaks the device check fails this test. The
driver's own rules (a failing, crashing or hanging step is a ``FAIL`` row, the table is printed
anyway, the exit status is non-zero) are tested on stand-in steps.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

import device_check  # noqa: E402

STEP_NAMES = ["cuda-tests", "cuda-smoke", "bench-single", "compile", "moe", "memory"]


def table_rows(stdout: str) -> list[list[str]]:
    """The rows of the printed result table (step, status, key figure, seconds)."""
    lines = [line for line in stdout.splitlines() if line.startswith("| ")]
    assert lines and lines[0] == "| step | status | key figure | seconds |", stdout
    return [[cell.strip() for cell in line.strip("|").split(" | ")] for line in lines[1:]]


@pytest.mark.slow  # ~40 s: runs every step of the script on the CPU; the default suite keeps the two below
def test_dry_run_passes_every_step(tmp_path, request):
    # plait's cache (the compiled kernels of the toy model, the CPU's measured peak) persists
    # between test runs in pytest's cache directory, apart from the user's own cache
    cache = request.config.cache.mkdir("device-check-plait-cache") if request.config.cache else tmp_path / "cache"
    env = dict(os.environ, PYTHON=sys.executable, PLAIT_CACHE=str(cache))
    script = ROOT / "bench" / "device_check.sh"
    proc = subprocess.run(["bash", str(script), "--dry-run", "--out", str(tmp_path / "out")],
                          capture_output=True, text=True, env=env, cwd=tmp_path, timeout=900)
    output = proc.stdout + proc.stderr
    rows = table_rows(proc.stdout)
    assert [row[0] for row in rows] == STEP_NAMES == [s.name for s in device_check.STEPS], output
    failed = [row for row in rows if row[1] != "ok"]
    assert not failed, f"{failed}\n{output[-4000:]}"
    assert proc.returncode == 0, output[-4000:]
    assert all(row[2] and float(row[3]) > 0 for row in rows), rows
    for name in STEP_NAMES:
        assert (tmp_path / "out" / f"{name}.log").is_file(), name


def _stand_in(name: str, code: str, check=None) -> device_check.Step:
    return device_check.Step(name, 10, lambda ctx: [[sys.executable, "-c", code]],
                             check or (lambda ctx, log: log.strip().splitlines()[-1]))


def _failing_check(ctx, log):
    raise device_check.CheckFailed("wrong figure")


def test_a_failing_crashing_or_hanging_step_is_a_fail_row_and_the_exit_status_is_one(tmp_path, monkeypatch, capsys):
    steps = [_stand_in("fine", "print('42 things')"),
             _stand_in("crash", "import sys; print('boom'); sys.exit(3)"),
             _stand_in("hang", "import time; time.sleep(60)"),
             _stand_in("wrong", "print('x')", _failing_check),
             _stand_in("after", "print('still run')")]
    monkeypatch.setattr(device_check, "STEPS", steps)
    monkeypatch.setattr(device_check, "DRY_LIMIT_S", 3.0)
    assert device_check.main(["--dry-run", "--out", str(tmp_path)]) == 1
    rows = {row[0]: row for row in table_rows(capsys.readouterr().out)}
    assert list(rows) == ["fine", "crash", "hang", "wrong", "after"]
    assert rows["fine"][1:3] == ["ok", "42 things"] and rows["after"][1:3] == ["ok", "still run"]
    assert rows["crash"][1] == "FAIL" and rows["crash"][2] == "exit status 3: boom"
    assert rows["hang"][1] == "FAIL" and rows["hang"][2].startswith("timed out after 3 s")
    assert float(rows["hang"][3]) < 10
    assert rows["wrong"][1:3] == ["FAIL", "wrong figure"]


def test_the_real_mode_refuses_to_start_without_a_gpu(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # also on a machine with a GPU
    assert device_check.main(["--out", str(tmp_path)]) == 2
    assert "no CUDA device" in capsys.readouterr().err
