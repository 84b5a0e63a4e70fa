"""SIGTERM to `agentrl train` (a scheduler's stop, `kill`): the run stops after the step in
progress with a checkpoint of it, says how to continue, exits 143, and leaves no Ray process
behind."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from trainers.checkpoint import latest_checkpoint, load_checkpoint

pytestmark = [pytest.mark.ray, pytest.mark.slow]


def _ray_processes(marker: str) -> list[int]:
    """Processes started for the Ray session whose temp dir is `marker`."""
    import psutil

    found = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        try:
            if any(marker in part for part in p.info["cmdline"] or ()):
                found.append(p.info["pid"])
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


def test_sigterm_stops_between_steps_with_a_checkpoint_and_no_ray_left(tmp_path):
    # Ray's socket paths must fit in 107 bytes: a short temp dir of its own, not tmp_path.
    run_dir, ray_tmp = tmp_path / "run", Path("/tmp") / f"agentrl-sigterm-{os.getpid()}"
    env = {**os.environ, "AGENTRL_RAY_TMP": str(ray_tmp), "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "agentrl.cli", "train", "--env", "digits", "--steps", "200",
         "--run_dir", str(run_dir), "--progress", "false", "--tensorboard", "false"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        metrics = run_dir / "metrics.jsonl"
        deadline = time.monotonic() + 180
        while not (metrics.exists() and '"reward"' in metrics.read_text()):
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "no step finished in 180 s"
            time.sleep(0.2)
        assert _ray_processes(str(ray_tmp))  # the run's own Ray cluster is up
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
        shutil.rmtree(ray_tmp, ignore_errors=True)
    assert proc.returncode == 128 + signal.SIGTERM, err
    rows = [json.loads(x) for x in metrics.read_text().splitlines()]
    steps = [r["step"] for r in rows if "reward" in r]
    last = steps[-1]
    assert 1 <= last < 200 and steps == list(range(1, last + 1))
    assert f"stopped by SIGTERM after step {last}; checkpoint" in err and "--resume auto" in err
    assert load_checkpoint(latest_checkpoint(run_dir))[1]["step"] == last
    deadline = time.monotonic() + 20
    while _ray_processes(str(ray_tmp)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not _ray_processes(str(ray_tmp))
