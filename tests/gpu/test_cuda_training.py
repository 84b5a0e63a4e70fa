"""The training core on a CUDA device: the same code path as on the CPU, with the device, the
process-group backend and bf16 as parameters. Skipped without a GPU; run them where one is lent
(results in benchmarks/results/gpu.md)."""

from __future__ import annotations

import pytest
import torch

from tests.trainers.conftest import make_cfg, recorded_rollouts

pytestmark = pytest.mark.gpu
__all__ = ["make_cfg", "recorded_rollouts"]


@pytest.mark.parametrize("mixed_precision", ["no", "bf16"])
def test_a_cuda_step_changes_the_weights_on_the_gpu(make_cfg, recorded_rollouts, mixed_precision):
    from agentrl.trajectory_files import load_jsonl
    from trainers.policy import PolicyWorker

    cfg = make_cfg(actor={"device": "cuda", "mixed_precision": mixed_precision})
    worker = PolicyWorker(cfg, with_engine=False)
    assert worker.device.type == "cuda" and type(worker.policy).__name__ == "LocalBackend"
    assert all(p.device.type == "cuda" for p in worker.model.parameters())
    before = {k: v.clone() for k, v in worker.model.state_dict().items()}
    metrics = worker.train(load_jsonl(recorded_rollouts)[:16], 0.0)
    assert torch.isfinite(torch.tensor(metrics["loss"])) and metrics["grad_norm"] > 0
    changed = [k for k, v in worker.model.state_dict().items() if not torch.equal(v, before[k])]
    assert len(changed) > len(before) // 2


def test_cuda_matches_cpu_on_one_update(make_cfg, recorded_rollouts):
    """float32 on both: the update agrees up to the devices' float32 round-off."""
    from agentrl.trajectory_files import load_jsonl
    from trainers.policy import PolicyWorker

    trajs = load_jsonl(recorded_rollouts)[:16]
    got = {}
    for device, backend in (("cpu", "local"), ("cuda", "local")):
        worker = PolicyWorker(make_cfg(backend=backend, actor={"device": device}),
                              with_engine=False)
        metrics = worker.train(trajs, 0.0)
        got[device] = (metrics["loss"], {k: v.cpu() for k, v in worker.named_weights().items()})
    assert got["cuda"][0] == pytest.approx(got["cpu"][0], rel=1e-3, abs=1e-5)
    for k, v in got["cpu"][1].items():
        torch.testing.assert_close(got["cuda"][1][k], v, rtol=1e-3, atol=1e-4)


def test_the_colocated_engine_samples_on_the_gpu(make_cfg):
    from trainers.policy import PolicyWorker

    worker = PolicyWorker(make_cfg(actor={"device": "cuda"}), with_engine=True)
    try:
        assert worker.engine.device.type == "cuda"
        trajs = worker.collect([0, 1], 0)
        assert trajs and all(t.num_policy_tokens > 0 for t in trajs)
        assert all(t.policy_versions == [0] * len(t.turns) for t in trajs)
        metrics = worker.train(trajs, 0.0)
        assert torch.isfinite(torch.tensor(metrics["loss"])) and worker.engine.version == 1
    finally:
        worker.engine.close()


@pytest.mark.parametrize("mixed_precision", ["no", "bf16"])
def test_a_qlora_step_on_the_gpu_trains_adapters_whose_merge_is_the_model(make_cfg,
                                                                          recorded_rollouts,
                                                                          mixed_precision):
    """QLoRA on CUDA: the base's linear layers packed in 4 bits on the GPU, an update moves
    only the adapters, and the merged weights an engine would load compute what the 4-bit
    model computes (the same path the CPU tests run, on bitsandbytes' CUDA kernels)."""
    pytest.importorskip("bitsandbytes", reason="QLoRA needs bitsandbytes (a dependency of agentrl)")
    from agentrl.models import load_model
    from agentrl.trajectory_files import load_jsonl
    from trainers.policy import PolicyWorker

    cfg = make_cfg(actor={"device": "cuda", "mixed_precision": mixed_precision, "lora_rank": 4,
                          "lora_alpha": 8, "lr": 1e-2, "load_in_4bit": True})
    worker = PolicyWorker(cfg, with_engine=False)
    packed = [p for p in worker.model.parameters() if p.dtype == torch.uint8]
    assert packed and all(p.device.type == "cuda" for p in packed)
    metrics = worker.train(load_jsonl(recorded_rollouts)[:16], 0.0)
    assert torch.isfinite(torch.tensor(metrics["loss"])) and metrics["grad_norm"] > 0
    merged = worker.named_weights()
    plain = load_model("tiny").cuda().eval()
    plain.load_state_dict(merged)
    ids = torch.tensor([[1, 5, 9, 20, 33, 7]], device="cuda")
    with torch.no_grad():
        want = worker.model.eval()(input_ids=ids).logits
        torch.testing.assert_close(plain(input_ids=ids).logits, want, rtol=0, atol=1e-3)
