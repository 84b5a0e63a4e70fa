"""What vLLM 0.32's CPU build needs to run tensor parallel, checked before it starts.

vLLM binds each CPU worker's threads (vllm/utils/ompmultiprocessing.py `OMPProcessManager`): by
default ("auto") to a NUMA node of its own, so on a host with fewer NUMA nodes than workers its
engine fails to start (after half a minute). `VLLM_CPU_OMP_THREADS_BIND` ("0-3|4-7": one CPU
list per worker, or "nobind") binds them by hand; its workers then talk through vLLM's shared-
memory CPU communicator (vllm/distributed/device_communicators/cpu_communicator.py).
"""

from __future__ import annotations

import os


def check_cpu_tensor_parallel(tp: int, flag: str = "tensor_parallel_size") -> None:
    """ValueError, saying what to set, unless vLLM's CPU build can run `tp` tensor-parallel
    workers in this process's environment."""
    if tp <= 1:
        return
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    cpus = cpus or list(range(os.cpu_count() or 1))
    if tp > len(cpus):
        raise ValueError(f"{flag} {tp} on a CPU: vLLM runs each tensor-parallel worker on CPUs of "
                         f"its own and this process may use {len(cpus)}; use {flag} <= {len(cpus)}")
    bind = os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto")
    lists = "|".join(_cpu_range(part) for part in _split(cpus, tp))
    if bind == "auto" and "VLLM_CPU_SIM_MULTI_NUMA" not in os.environ:
        from vllm.utils.cpu_resource_utils import get_visible_memory_node

        nodes = len(get_visible_memory_node())
        if nodes < tp:
            raise ValueError(
                f"{flag} {tp} on a CPU: vLLM binds each tensor-parallel worker to a NUMA node of "
                f"its own and this host has {nodes}. Bind them to CPUs instead, one list per "
                f"worker: VLLM_CPU_OMP_THREADS_BIND='{lists}' (or use {flag} <= {nodes})"
            )
    elif bind not in ("auto", "nobind") and len(bind.split("|")) != tp:
        raise ValueError(
            f"VLLM_CPU_OMP_THREADS_BIND={bind!r} gives {len(bind.split('|'))} CPU lists for {flag} "
            f"{tp}: give one per worker, separated by '|' (e.g. '{lists}')"
        )


def _split(items: list[int], parts: int) -> list[list[int]]:
    size = len(items) // parts
    return [items[i * size : (i + 1) * size] for i in range(parts)]


def _cpu_range(cpus: list[int]) -> str:
    if len(cpus) == 1:
        return str(cpus[0])
    if cpus == list(range(cpus[0], cpus[-1] + 1)):
        return f"{cpus[0]}-{cpus[-1]}"
    return ",".join(map(str, cpus))
