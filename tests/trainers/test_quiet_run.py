"""A run's output is agentrl's own: third-party chatter is off by default."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.ray, pytest.mark.slow]


def test_a_run_prints_nothing_unasked(tmp_path):
    """#17 item 7: DeepSpeed's "Setting accelerator to CPU" warning, a "Writing model shards"
    bar per save and Ray's "Started a local Ray instance" came with every run; and the eval's
    progress bar ran inside the policy actor and reached the terminal through Ray's log
    forwarding, one `(PolicyWorker pid=...)` line per refresh: the driver draws it now."""
    ray_tmp = Path("/tmp") / f"agentrl-quiet-{os.getpid()}"
    env = {**os.environ, "AGENTRL_RAY_TMP": str(ray_tmp)}
    for var in ("DS_ACCELERATOR", "HF_HUB_DISABLE_PROGRESS_BARS"):
        env.pop(var, None)
    try:
        done = subprocess.run(
            [sys.executable, "-m", "agentrl.cli", "train", "--env", "reverse", "--actor.model",
             "tiny", "--steps", "1", "--eval_problems", "8", "--run_dir", str(tmp_path / "run"),
             "--tensorboard", "false"], env=env, capture_output=True, text=True, timeout=300,
            check=False)
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    assert done.returncode == 0, done.stderr
    for noise in ("real_accelerator", "Writing model shards", "Started a local Ray",
                  "PolicyWorker"):
        assert noise not in done.stderr + done.stdout, done.stderr
    assert "eval tok_s=" in done.stderr, done.stderr  # the eval bar, drawn by the driver
