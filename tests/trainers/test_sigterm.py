"""Signals to the driver. SIGTERM to `agentrl train` (a scheduler's stop, `kill`): the run stops
after the step in progress with a checkpoint of it, says how to continue, exits 143, and leaves
no Ray process behind. SIGKILL, which nothing can handle: the private cluster's reaper still
ends every Ray process of it within seconds (Ray's agents lingered a minute)."""

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
    """Processes of the Ray session whose temp dir is `marker`: named in their command line,
    or holding files open there (Ray's agents, whose command line Ray rewrites)."""
    import psutil

    found = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        try:
            if (any(marker in part for part in p.info["cmdline"] or ())
                    or any(f.path.startswith(marker) for f in p.open_files())):
                found.append(p.info["pid"])
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


_DRIVER = """
import os, sys, time
import ray
from trainers.ray_utils import init_ray
init_ray(num_cpus=1)

@ray.remote
class Worker:
    def pid(self):
        return os.getpid()

worker = Worker.remote()
print(ray.get(worker.pid.remote()), flush=True)
time.sleep(600)
"""


def test_sigkill_of_the_driver_leaves_no_ray_process(tmp_path):
    """#19 item 9: after a SIGKILL of the driver, Ray's dashboard and runtime-env agents
    outlived it for about a minute (measured 60 s on this machine)."""
    ray_tmp = Path("/tmp") / f"agentrl-sigkill-{os.getpid()}"
    env = {**os.environ, "AGENTRL_RAY_TMP": str(ray_tmp), "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-c", _DRIVER], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True)
    try:
        assert proc.stdout is not None
        worker = int(proc.stdout.readline())
        running = _ray_processes(str(ray_tmp))
        assert len(running) >= 4, running  # GCS, raylet, agents ... and the worker is alive
        assert os.path.exists(f"/proc/{worker}")
        proc.kill()
        proc.wait()
        deadline = time.monotonic() + 10
        while (_ray_processes(str(ray_tmp)) or os.path.exists(f"/proc/{worker}")) and (
                time.monotonic() < deadline):
            time.sleep(0.2)
        assert not _ray_processes(str(ray_tmp))
        assert not os.path.exists(f"/proc/{worker}")
    finally:
        if proc.poll() is None:
            proc.kill()
        shutil.rmtree(ray_tmp, ignore_errors=True)


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

