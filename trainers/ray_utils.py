"""Starting a local Ray cluster the way CI and laptops need it."""

from __future__ import annotations

import os
import tempfile


def init_ray(num_cpus: int | None = None) -> None:
    """Start (or join) a local Ray cluster: no dashboard, no auth token, a private temp dir.

    Current Ray has no `local_mode`; a real local cluster costs ~3 s to start.
    """
    import ray

    if ray.is_initialized():
        return
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    ray.init(
        num_cpus=num_cpus or os.cpu_count() or 2,
        include_dashboard=False,
        ignore_reinit_error=True,
        log_to_driver=True,
        _temp_dir=os.environ.get("AGENTRL_RAY_TMP") or tempfile.mkdtemp(prefix="agentrl-ray-"),
    )
