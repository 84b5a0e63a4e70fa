"""Joining a running Ray cluster (`--ray.address`): a real two-raylet local cluster, a run whose
policy and rollout workers land on different nodes with weight sync between them, and an
address that never answers (the connect times out) or refuses."""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path

import pytest

from trainers.controller import Trainer

pytestmark = [pytest.mark.ray, pytest.mark.slow]


@pytest.fixture
def two_node_cluster(monkeypatch):
    """A head and a second raylet, one CPU each, so two one-CPU workers cannot share a node."""
    import shutil
    import tempfile

    import ray
    from ray.cluster_utils import Cluster

    from trainers.ray_utils import shutdown_ray

    shutdown_ray()  # a private cluster of an earlier test in this process, and its reaper
    if ray.is_initialized():
        ray.shutdown()
    tmp = tempfile.mkdtemp(prefix="ray2-")  # short: Ray's socket paths must fit in 107 bytes
    monkeypatch.setenv("RAY_TMPDIR", tmp)  # where the cluster notes its address (for "auto")
    Path(tmp, "ray").mkdir()
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 1, "include_dashboard": False, "temp_dir": tmp})
    cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    try:
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)


def test_a_placed_run_spreads_over_the_nodes_of_a_joined_cluster(two_node_cluster, make_cfg):
    import ray

    cfg = make_cfg(use_ray=True, steps=3, ray={"address": two_node_cluster.address},
                   rollout={"mode": "placed"})
    summary = Trainer(cfg).run()
    nodes = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
    assert len(nodes) == 2
    [policy], rollout = summary["nodes"]["policy"], summary["nodes"]["rollout"]
    assert {policy, rollout} == nodes  # one worker on each node
    rows = [json.loads(x) for x in (Path(cfg.run_dir) / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "reward" in r] == [1, 2, 3]
    # Each step's episodes were sampled on the other node with the weights of the step before:
    # the sync crossed nodes every step.
    from agentrl.trajectory_files import load_jsonl

    versions = [{v for t in load_jsonl(Path(cfg.run_dir) / "rollouts" / f"step_{s:06d}.jsonl")
                 for v in t.policy_versions} for s in (1, 2, 3)]
    assert versions == [{0}, {1}, {2}]


@pytest.fixture
def silent_port():
    """A loopback port whose connects neither succeed nor fail: a listener that never accepts,
    its accept queue filled, so the kernel drops every further SYN (as a firewall that drops
    packets, or a head behind a wrong route, does). A refused port would fail at once and
    never reach the connect timeout."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    port = listener.getsockname()[1]
    held = []
    try:
        for _ in range(16):  # Linux queues one connection on a backlog of 0
            try:
                held.append(socket.create_connection(("127.0.0.1", port), timeout=0.2))
            except TimeoutError:
                break
        else:
            pytest.skip("this kernel accepts every connection to a full backlog")
        yield port
    finally:
        for s in held:
            s.close()
        listener.close()


def test_an_address_that_never_answers_fails_after_the_connect_timeout(make_cfg, silent_port):
    import ray

    from trainers.ray_utils import CONNECT_TIMEOUT_S, shutdown_ray

    shutdown_ray()
    if ray.is_initialized():
        ray.shutdown()
    port = silent_port
    cfg = make_cfg(use_ray=True, ray={"address": f"127.0.0.1:{port}"})
    start = time.monotonic()
    with pytest.raises(ValueError, match=rf"--ray.address 127.0.0.1:{port}: nothing answers "
                                         rf"there \(timed out\).*`ray start --head --port {port}`"):
        Trainer(cfg).run()
    elapsed = time.monotonic() - start
    # The connect waited out its timeout (5 s), and no longer.
    assert CONNECT_TIMEOUT_S <= elapsed < CONNECT_TIMEOUT_S + 3, elapsed
    assert not ray.is_initialized()


def test_a_refused_address_fails_at_once(make_cfg):
    import ray

    from trainers.ray_utils import CONNECT_TIMEOUT_S, shutdown_ray

    shutdown_ray()
    if ray.is_initialized():
        ray.shutdown()
    with socket.socket() as s:  # a port nobody listens on: the connect is refused
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg = make_cfg(use_ray=True, ray={"address": f"127.0.0.1:{port}"})
    start = time.monotonic()
    with pytest.raises(ValueError, match=rf"--ray.address 127.0.0.1:{port}: nothing answers "
                                         rf"there \(.*refused\)"):
        Trainer(cfg).run()
    assert time.monotonic() - start < CONNECT_TIMEOUT_S  # without waiting for the timeout
    assert not ray.is_initialized()


def test_a_malformed_address_is_refused_before_anything_starts():
    from trainers.cli import build_config

    with pytest.raises(ValueError, match=r"--ray.address 'headnode': use auto, or HOST:PORT"):
        build_config(["--env", "digits", "--ray.address", "headnode"])
