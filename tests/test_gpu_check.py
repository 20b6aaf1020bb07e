"""reproduce/gpu_check/run.py in its reduced form on CPUs (--cpu): every check of the GPU check passes."""

import os
import subprocess
import sys

import pytest

from conftest import ROOT

pytestmark = [pytest.mark.run, pytest.mark.torchrun]  # its checks start the scripts and torchrun


def test_gpu_check_passes_in_its_cpu_form(tmp_path):
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, str(ROOT / "reproduce" / "gpu_check" / "run.py"), "--cpu", "--workdir", str(tmp_path)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    assert "--cpu: the reduced form on CPUs" in proc.stdout
    table = proc.stdout[proc.stdout.index("-" * 120) :]
    for check in [
        "grpo.py",
        "dapo.py",
        "m2po.py",
        "dppo.py",
        "ppo_stale.py",
        "tba.py",
        "vineppo.py",
        "torchrun",
        "resume",
    ]:
        assert check in table, check
    assert "FAIL" not in table and "all 12 checks passed in" in proc.stdout
    assert "trainer tokens/s  generated tokens/s" in proc.stdout
    assert sorted(os.listdir(tmp_path / "runs")) == sorted(
        ["grpo", "dapo", "m2po", "dppo", "ppo_stale", "tba", "vineppo", "torchrun", "full", "part", "speed"]
    )
