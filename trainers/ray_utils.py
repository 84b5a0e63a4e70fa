"""Starting a local Ray cluster the way CI and laptops need it (or joining a running one), and
what each actor asks of it."""

from __future__ import annotations

import logging
import math
import os
import subprocess
import sys
import tempfile
from typing import Any

from agentrl import process_reaper
from trainers.config import TrainConfig

CONNECT_TIMEOUT_S = 5.0
_connected_here = False  # whether init_ray (not the caller) connected this process to Ray
_reaper: subprocess.Popen[bytes] | None = None  # ends the private cluster's leftovers
REAPER_WAIT_S = 10.0


def init_ray(num_cpus: int | None = None, address: str | None = None) -> None:
    """Join the Ray cluster at `address` (or $RAY_ADDRESS), or start a private local one: no
    dashboard, no auth token, a private temp dir.

    A HOST:PORT that does not answer fails within `CONNECT_TIMEOUT_S` with what to check,
    instead of Ray's own minute of retries. Current Ray has no `local_mode`; a real local
    cluster costs ~3 s to start.
    """
    import ray

    global _connected_here
    if ray.is_initialized():
        return
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    address = address or os.environ.get("RAY_ADDRESS") or None
    if address is not None:
        _check_answers(address)
        # A joined cluster's workers were started by `ray start`, not by this process: hand
        # them the settings that keep a run quiet (trainers.quiet.quiet_third_party).
        quiet = {k: os.environ[k] for k in ("DS_ACCELERATOR", "HF_HUB_DISABLE_PROGRESS_BARS")
                 if k in os.environ}
        try:
            ray.init(address=address, log_to_driver=True, logging_level=logging.WARNING,
                     runtime_env={"env_vars": quiet} if quiet else None)
        except ConnectionError as e:
            raise ValueError(f"--ray.address {address}: {e}. Start one with `ray start --head`, "
                             f"or leave --ray.address (and RAY_ADDRESS) unset for a private "
                             f"local cluster") from None
    else:
        temp_dir = os.environ.get("AGENTRL_RAY_TMP") or tempfile.mkdtemp(prefix="agentrl-ray-")
        ray.init(
            num_cpus=num_cpus or os.cpu_count() or 2,
            include_dashboard=False,
            ignore_reinit_error=True,
            log_to_driver=True,
            logging_level=logging.WARNING,  # not "Started a local Ray instance" every run
            _temp_dir=temp_dir,
        )
        _start_reaper(temp_dir)
    _connected_here = True  # only once connected: a failed join leaves nothing to shut down


def shutdown_ray() -> None:
    """Disconnect from Ray if `init_ray` connected this process (a private cluster stops with
    it, and its reaper ends the helpers Ray leaves, before this returns); a caller's own Ray
    is left."""
    global _connected_here, _reaper
    if _connected_here:
        import ray

        ray.shutdown()
        _connected_here = False
    reaper, _reaper = _reaper, None
    if reaper is not None:
        assert reaper.stdin is not None
        reaper.stdin.close()
        try:
            reaper.wait(timeout=REAPER_WAIT_S)
        except subprocess.TimeoutExpired:
            reaper.kill()
            reaper.wait()


def _start_reaper(temp_dir: str) -> None:
    """Start agentrl/process_reaper.py for the private Ray cluster in `temp_dir`: when this
    process ends, whatever way, it ends the cluster's processes (Ray's agents outlive a
    SIGKILLed driver by about a minute otherwise). Its own session, so a terminal's Ctrl-C
    reaches only us."""
    global _reaper
    if not os.path.isdir("/proc"):  # Linux only; elsewhere Ray's own clean-up is all there is.
        return
    _reaper = subprocess.Popen(
        [sys.executable, "-I", process_reaper.__file__, "ray", temp_dir, str(os.getpid())],
        stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        start_new_session=True,
    )


def _check_answers(address: str) -> None:
    """Fail fast when HOST:PORT has nobody listening ("auto" is Ray's to find)."""
    if address == "auto":
        return
    import socket

    host, _, port = address.rpartition(":")
    try:
        socket.create_connection((host, int(port)), timeout=CONNECT_TIMEOUT_S).close()
    except (OSError, ValueError) as e:
        raise ValueError(
            f"--ray.address {address}: nothing answers there ({e}). Check that the cluster's "
            f"head runs (`ray start --head --port {port}` on {host}) and that this machine "
            f"reaches it; leave --ray.address (and RAY_ADDRESS) unset for a private local cluster"
        ) from None


def current_node() -> str:
    """The Ray node id of this process ("local" outside Ray; Ray is not imported for it, so
    `--use_ray false` runs where Ray is not installed)."""
    ray = sys.modules.get("ray")
    if ray is None or not ray.is_initialized():
        return "local"
    return ray.get_runtime_context().get_node_id()


def actor_options(
    cfg: TrainConfig, *, rollout: bool
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Ray `.options(...)` for each policy rank and for each rollout engine's actor (if
    `rollout`: the rollout worker's first, then `--rollout.num_engines - 1` engine actors), from
    what the running cluster has.

    On GPUs every process gets one GPU; placed mode places the ranks and the rollout engine
    with the placement plan (trainers/placement.py: one STRICT_PACK group per node). On CPUs
    the actors split the cluster's CPUs between them: Ray sets each actor's OMP_NUM_THREADS
    (hence torch's threads) to its whole CPUs, so an actor that asked for none computes on one
    thread.
    """
    import ray

    total = ray.cluster_resources()
    gpus = int(total.get("GPU", 0))
    n_policy = cfg.num_policy_workers
    n_engines = cfg.rollout.num_engines if rollout else 0
    if not _wants_cuda(cfg.actor.device, gpus):
        share = float(total.get("CPU", 1)) / (n_policy + n_engines)
        cpus = math.floor(share) if share >= 1 else share
        return [{"num_cpus": cpus}] * n_policy, [{"num_cpus": cpus}] * n_engines
    if gpus == 0:
        raise ValueError(
            f"--actor.device {cfg.actor.device}: the Ray cluster has no GPUs; use --actor.device "
            "cpu, or join a cluster with GPUs"
        )
    if not rollout:
        return [{"num_gpus": 1, "num_cpus": 1}] * n_policy, []
    return _placed_on_gpus(n_policy, n_engines, cfg.rollout.tensor_parallel_size)


def _wants_cuda(device: str, cluster_gpus: int) -> bool:
    return device.startswith("cuda") or (device == "auto" and cluster_gpus > 0)


def _placed_on_gpus(n_policy: int, n_engines: int = 1, tp: int = 1,
                    ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    import ray
    from ray.util.placement_group import placement_group

    from trainers.placement import Node, plan_placement, ray_options

    nodes = [
        Node(num_gpus=int(n["Resources"].get("GPU", 0)),
             num_cpus=max(1, int(n["Resources"].get("CPU", 1))))
        for n in ray.nodes() if n.get("Alive")
    ]
    plan = plan_placement(nodes, num_policy_workers=n_policy, num_engines=n_engines,
                          tensor_parallel_size=tp, device="cuda", mode="placed")
    groups = {n: placement_group(plan.node_bundles(n), strategy=plan.strategy)
              for n in plan.used_nodes}
    ray.get([g.ready() for g in groups.values()])
    ranks = [ray_options(plan, groups[a.node], a) for a in plan.actors if a.role == "train"]
    engines = [plan.actor("engine", i) for i in range(n_engines)]
    return ranks, [ray_options(plan, groups[e.node], e) for e in engines]


def free_tcp_address() -> str:
    """A rendezvous address for a process group of ranks on this machine (tcp://host:port)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{sock.getsockname()[1]}"
