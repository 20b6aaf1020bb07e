"""Copying one script into another project: the script and common/ in the same relative layout run without this
project on the path, and installing the project puts no top-level ``common`` module into other projects."""

import json
import math
import os
import shutil
import subprocess
import sys

import pytest

from conftest import ROOT

pytestmark = pytest.mark.run  # both start an interpreter: a bare one, or the copied script


def clean_env() -> dict:
    """The environment without anything that would put this repository on the module path."""
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONSTARTUP")} | {
        "PYTHONUNBUFFERED": "1",
        "OMP_NUM_THREADS": "1",
    }


def test_installing_the_project_adds_no_common_module(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-c", "import common"],
        cwd=tmp_path,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode != 0 and "No module named 'common'" in proc.stderr, proc.stdout + proc.stderr


@pytest.mark.parametrize("script", ["m2po.py", "dppo.py"])
def test_a_copied_script_runs_in_another_project(script, tiny_model_path, tmp_path):
    project = tmp_path / "my_project"  # outside the repository, with a different folder name for the script
    shutil.copytree(ROOT / "common", project / "common", ignore=shutil.ignore_patterns("__pycache__"))
    (project / "experiments").mkdir()
    shutil.copy(ROOT / "algorithms" / script, project / "experiments" / script)
    flags = [
        "--model",
        tiny_model_path,
        "--digits",
        "1",
        "--prompts-per-batch",
        "2",
        "--group-size",
        "4",
        "--max-new-tokens",
        "6",
        "--eval-size",
        "8",
        "--eval-every",
        "1",
        "--total-updates",
        "1",
        "--run-name",
        "copied",
    ]
    proc = subprocess.run(
        [sys.executable, str(project / "experiments" / script), *flags],
        cwd=project,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [json.loads(line) for line in (project / "runs" / "copied" / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if "losses/policy_loss" in r]
    assert [r["global_step"] for r in train] == [1] and all(math.isfinite(r["losses/policy_loss"]) for r in train)
    assert sorted(r["global_step"] for r in rows if "eval/accuracy" in r) == [0, 1]
    assert not (ROOT / "runs" / "copied").exists()
