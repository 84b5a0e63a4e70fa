"""The trainer with agentrl's compiled CPU kernels forced on and forced off: the same update,
within the tolerance stated below (and in the README's CPU section)."""

from __future__ import annotations

import math

import pytest
import torch

from agentrl.backends.cpu import fused, kernels


def _update(make_cfg, trajs, monkeypatch, env):
    """One policy update on `trajs` with AGENTRL_CPU_KERNELS=`env`: the log-probs and entropies
    before it, its metrics, the gradients it applied and the weights after it."""
    from trainers.batch import collate
    from trainers.policy import PolicyWorker

    monkeypatch.setenv(kernels.ENV, env)
    calls = []
    fused_logprobs = fused.logprobs_and_entropy
    monkeypatch.setattr(
        fused, "logprobs_and_entropy", lambda *a, **k: calls.append(1) or fused_logprobs(*a, **k)
    )
    worker = PolicyWorker(make_cfg(algo={"entropy_coef": 0.01}), with_engine=False)
    fused_modules = sum(
        isinstance(m, (fused.FusedRMSNorm, fused.FusedSwiGLUMLP)) for m in worker.model.modules()
    )
    batch = collate(trajs, worker.pad_id)
    n = int(batch.lengths.max())
    with torch.no_grad():
        logp, ent = worker._logprobs(
            worker.policy, worker.model, batch, (torch.arange(len(trajs)), n), entropy=True
        )
    grads = {}
    step = worker.policy.optimizer.step

    def snapshot(*args, **kwargs):
        named = worker.model.named_parameters(remove_duplicate=False)  # the tied lm_head too
        grads.update({k: p.grad.clone() for k, p in named})
        return step(*args, **kwargs)

    monkeypatch.setattr(worker.policy.optimizer, "step", snapshot)
    metrics = worker.train(trajs, 0.0)
    sel = batch.mask[:, : logp.shape[1]].bool()
    return {
        "logp": logp[sel], "entropy": ent[sel], "metrics": metrics, "grads": grads,
        "weights": worker.model.state_dict(), "fused_modules": fused_modules,
        "fused_logprob_calls": len(calls), "lr": worker.cfg.actor.lr,
    }  # fmt: skip


def test_kernels_on_and_off_give_the_same_update(make_cfg, recorded_rollouts, monkeypatch):
    """One GRPO update of the tiny model on 32 recorded trajectories, with every kernel family
    forced on (`AGENTRL_CPU_KERNELS=1`: fused RMSNorm, SiLU gating, log-prob/entropy) and off
    (`=0`: torch). The kernels sum in other orders and use a polynomial exp, so float32 results
    agree to round-off. Stated tolerance (measured on the AVX2 EPYC dev VM in brackets):

    - log-probs and entropies at the policy tokens: within 1e-5 absolute (1e-6, 2e-6);
    - loss, entropy and gradient norm: within 1e-5 relative (6e-8, 0, 0);
    - each gradient tensor: within 1e-5 of its largest entry (5e-7);
    - weights after the AdamW step (lr 3e-3): within 1e-6 absolute wherever the gradient is at
      least 1e-6 (1.5e-8); AdamW's first step moves a weight by lr * g / (|g| + 1e-8), so where
      |g| is near round-off the two may move apart, by at most 2 lr: at most 0.1% of the weights
      differ by more than 1e-6 (0.008%, at most 2.9e-6).
    """
    from agentrl.trajectory_files import load_jsonl

    if kernels.module() is None:
        pytest.skip(f"agentrl's CPU kernels could not be built here: {kernels.build_error}")
    trajs = load_jsonl(recorded_rollouts)[:32]
    on = _update(make_cfg, trajs, monkeypatch, "1")
    off = _update(make_cfg, trajs, monkeypatch, "0")
    # Each run took its path: every norm and MLP of the tiny model through the kernels, or none.
    assert on["fused_modules"] > 0 and on["fused_logprob_calls"] > 0
    assert off["fused_modules"] == 0 and off["fused_logprob_calls"] == 0

    torch.testing.assert_close(on["logp"], off["logp"], atol=1e-5, rtol=0)
    torch.testing.assert_close(on["entropy"], off["entropy"], atol=1e-5, rtol=0)
    for key in ("loss", "entropy", "grad_norm"):
        assert math.isfinite(off["metrics"][key])
        assert on["metrics"][key] == pytest.approx(off["metrics"][key], rel=1e-5, abs=0), key
    for name, g in off["grads"].items():
        scale = float(g.abs().max())
        torch.testing.assert_close(on["grads"][name], g, atol=1e-5 * scale, rtol=0, msg=name)

    lr, apart, total = on["lr"], 0, 0
    for name, w in off["weights"].items():
        diff = (on["weights"][name] - w).abs()
        grad = off["grads"][name]
        assert float(diff.max()) <= 2 * lr, name
        assert float(torch.where(grad.abs() >= 1e-6, diff, 0).max()) <= 1e-6, name
        apart += int((diff > 1e-6).sum())
        total += diff.numel()
    assert apart <= 1e-3 * total, (apart, total)
    # The kernels ran: not bit-identical to torch.
    assert not torch.equal(on["logp"], off["logp"])
