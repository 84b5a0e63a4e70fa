"""Vision-language policies on a CUDA device: a multi-turn screenshot episode sampled by the
engine on the GPU, scored by the trainer on the GPU with the same pixels and positions, and a
bf16 training step through the vision tower. Skipped without a GPU (results in
benchmarks/results/gpu.md)."""

from __future__ import annotations

import pytest
import torch

from agentrl.models.tiny import TINY_VLMS
from tests.trainers._logprobs import sampled_logprob_gap
from tests.trainers._vision import is_vision
from tests.trainers.test_vision_training import _rollout

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("name", TINY_VLMS)
def test_cuda_screenshot_episode_logprobs_match_the_trainers(tmp_path, name):
    """fp32 on the GPU: cuDNN's convolutions (the patch embedding) may use TF32 unless told
    not to, which would put the engine and trainer apart by ~1e-3; both run the same kernels,
    so their log-probs agree to float32 round-off."""
    from tests.trainers.conftest import tiny_cfg
    from trainers.policy import PolicyWorker

    worker = PolicyWorker(tiny_cfg(tmp_path, actor={"model": name, "device": "cuda"}),
                          with_engine=False)
    assert next(worker.model.parameters()).device.type == "cuda"
    trajs = _rollout(name, worker.model, worker.tokenizer, worker.vision.image_token_id)
    assert all(len(t.images) == 3 for t in trajs)
    gap, n = sampled_logprob_gap(worker, trajs)
    print(f"{name}: max |trainer - engine| log-prob over {n} sampled tokens = {gap:.2e}")
    assert n > 40
    assert gap < 1e-4


@pytest.mark.parametrize("name", TINY_VLMS)
def test_a_bf16_cuda_step_on_screenshot_episodes(tmp_path, name):
    from tests.trainers.conftest import tiny_cfg
    from trainers.policy import PolicyWorker

    cfg = tiny_cfg(tmp_path, actor={"model": name, "device": "cuda", "mixed_precision": "bf16"})
    worker = PolicyWorker(cfg, with_engine=False)
    trajs = _rollout(name, worker.model, worker.tokenizer, worker.vision.image_token_id)
    before = {k: v.detach().clone() for k, v in worker.model.named_parameters()}
    metrics = worker.train(trajs, kl_coef=cfg.algo.kl_coef)
    assert torch.isfinite(torch.tensor(metrics["loss"])) and metrics["grad_norm"] > 0
    moved = [k for k, v in worker.model.named_parameters() if not torch.equal(v, before[k])]
    assert any(is_vision(k) for k in moved)
