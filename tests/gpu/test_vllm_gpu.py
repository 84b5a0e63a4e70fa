"""The vLLM backend's GPU-only paths for real: the NCCL weight broadcast from a trainer process
into a vLLM engine on another GPU, and a placed training run that syncs by it. Skipped without
CUDA and a CUDA build of vLLM 0.32 (`pip install 'agentrl[vllm]'`); the broadcast needs two
GPUs (NCCL puts each rank on a GPU of its own). On CPUs the same protocol runs over gloo
(tests/engine/test_vllm_tp.py, tests/trainers/test_weight_sync.py) and the NCCL calls against a
fake (tests/engine/test_vllm_engine.py).
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os

import pytest
import torch

from tests.trainers.conftest import make_cfg

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed"),
]
__all__ = ["make_cfg"]

TOL = 2e-3  # float32 on both sides; GPU kernels differ from a transformers forward in round-off


@pytest.fixture
def cuda_vllm():
    from vllm.platforms import current_platform

    if not current_platform.is_cuda():
        pytest.skip(f"vLLM here is its {current_platform.device_type} build, not CUDA's")


def _two_gpus() -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip("the NCCL broadcast needs two GPUs: one for the trainer, one for vLLM")


def _reference_logprobs(model, prompt, completion) -> list[float]:
    ids = torch.tensor([list(prompt) + completion.token_ids], device=model.device)
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits[0].float(), -1)
    n = len(prompt)
    return [float(logp[n + i - 1, t]) for i, t in enumerate(completion.token_ids)]


async def test_nccl_broadcast_into_vllm_on_another_gpu(cuda_vllm, tiny_tokenizer, tmp_path):
    """This process is the trainer on GPU 0; vLLM's engine and worker run on GPU 1."""
    _two_gpus()
    from agentrl.completion import SamplingParams
    from agentrl.engine import create_engine
    from agentrl.engine.weight_broadcast import WeightBroadcaster, receive_step
    from agentrl.models.tiny import tiny_model

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.cuda.set_device(0)  # CUDA starts here before the engine's processes see GPU 1 only
    model = tiny_model(tiny_tokenizer, hidden_size=128, seed=1, max_position_embeddings=1024)
    model.save_pretrained(tmp_path)
    tiny_tokenizer.save_pretrained(tmp_path)
    model = model.to("cuda:0").eval()
    before = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ["CUDA_VISIBLE_DEVICES"] = "1"
    try:
        engine = create_engine(str(tmp_path), backend="vllm", weight_transfer="nccl",
                               dtype="float32", gpu_memory_utilization=0.3, max_model_len=1024)
    finally:
        if before is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES")
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = before
    try:
        sender = WeightBroadcaster(functools.partial(receive_step, engine), backend="nccl",
                                   world_size=2)
        assert sender.device == torch.device("cuda", 0)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * p.std() * 0.25)
        sender.send(model.state_dict().items(), version=1)
        prompt = tiny_tokenizer.encode("The quick brown fox")
        cs = await engine.generate(prompt, SamplingParams(temperature=1.0, max_tokens=16, n=2,
                                                          seed=0))
        for c in cs:
            assert c.policy_version == 1
            want = _reference_logprobs(model, prompt, c)
            assert max(abs(a - b) for a, b in zip(c.logprobs, want, strict=True)) < TOL
        sender.close()
    finally:
        engine.close()


def test_placed_training_on_gpus_syncs_by_nccl(cuda_vllm, make_cfg, tiny_vllm_dir):
    """`--rollout.mode placed --rollout.engine vllm` under Ray on two GPUs: the plan is NCCL and
    every step samples from the weights of the step before."""
    _two_gpus()
    from trainers.controller import Trainer

    cfg = make_cfg(actor={"model": tiny_vllm_dir, "device": "cuda"}, steps=3, use_ray=True,
                   rollout={"engine": "vllm", "mode": "placed", "gpu_memory_utilization": 0.3})
    trainer = Trainer(cfg)
    summary = trainer.run()
    assert trainer.weight_sync == "nccl" and summary["steps"] == 3
    rows = [json.loads(x) for x in (trainer.run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "loss" in r]
    assert len(steps) == 3 and all(r["policy_lag"] == 0.0 for r in steps)
    # vLLM's log-probs of the sampled tokens are the trainer's, up to bf16/kernel round-off.
    assert all(abs(r["mismatch"]) < 0.05 for r in steps)
