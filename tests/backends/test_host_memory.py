"""agentrl.backends.cpu.host_memory: the allocator settings that keep freed memory for the next
step, and the trainer giving the heap back only after the engine freed a large KV cache."""

from __future__ import annotations

import pytest

from agentrl.backends.cpu import backend, host_memory


class _RecordingLibc:
    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def mallopt(self, param: int, value: int) -> int:
        self.calls.append(("mallopt", param, value))
        return 1

    def malloc_trim(self, pad: int) -> int:
        self.calls.append(("malloc_trim", pad))
        return 1


def test_keep_freed_memory_sets_glibc_thresholds(monkeypatch):
    libc = _RecordingLibc()
    monkeypatch.setattr(host_memory, "_libc", lambda: libc)
    assert host_memory.keep_freed_memory()
    # M_MMAP_THRESHOLD (-3) at glibc's 32 MiB maximum, M_TRIM_THRESHOLD (-1) out of reach.
    assert libc.calls == [("mallopt", -3, 32 << 20), ("mallopt", -1, 2**31 - 1)]
    host_memory.trim()
    assert libc.calls[-1] == ("malloc_trim", 0)
    monkeypatch.setattr(host_memory, "_libc", lambda: None)  # not glibc: nothing to do
    assert not host_memory.keep_freed_memory()
    host_memory.trim()


@pytest.mark.skipif(host_memory._libc() is None, reason="glibc only")
def test_glibc_takes_the_settings():
    assert host_memory.keep_freed_memory()


def test_trainer_trims_only_after_a_large_kv_cache(make_cfg, recorded_rollouts, monkeypatch):
    from agentrl.trajectory_files import load_jsonl
    from trainers import policy

    trims = []
    monkeypatch.setattr(host_memory, "trim", lambda: trims.append(1))
    worker = policy.PolicyWorker(make_cfg(replay=str(recorded_rollouts)), with_engine=True)
    trajs = load_jsonl(recorded_rollouts)[:8]
    worker.engine.prefix_cache.nbytes = 1 << 20  # as if 1 MiB of KV were cached
    worker.train(trajs, 0.0)
    assert trims == []
    worker.engine.prefix_cache.nbytes = backend.TRIM_AFTER_KV_BYTES
    worker.train(trajs, 0.0)
    assert trims == [1]
    worker.engine.close()
