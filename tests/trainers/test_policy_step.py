"""The policy worker's one log-prob function against a plain forward: values and gradients, with
the cpu backend's shortcuts (fused log-prob/entropy pass, embedding rows added in place), with
the CPU kernels forced on and forced off."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.usefixtures("cpu_kernels")

LAYOUTS = {"packed": {"packing": True, "share_prefixes": False}, "padded": {"packing": False}}


@pytest.mark.parametrize("entropy_coef", [0.0, 0.1])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_forward_values_and_gradients_match_a_plain_forward(
    make_cfg, recorded_rollouts, layout, entropy_coef
):
    """`_forward` (logits view, one log-softmax, custom backward, embedding rows added in place)
    against one plain forward per row with autograd's log-softmax, softmax entropy and
    embedding gradient."""
    from agentrl.models import load_model
    from agentrl.trajectory_files import load_jsonl
    from trainers.batch import collate
    from trainers.policy import PolicyWorker

    cfg = make_cfg(
        algo={"entropy_coef": entropy_coef}, rollout={"temperature": 0.8}, **LAYOUTS[layout]
    )
    worker = PolicyWorker(cfg, with_engine=False)
    assert worker.policy.embedding_rows_in_place
    # The stock modules (the backend's stand-ins hold the same state_dict).
    plain = load_model(cfg.actor.model, dtype=cfg.actor.dtype).train()
    plain.load_state_dict(worker.model.state_dict())
    trajs = load_jsonl(recorded_rollouts)[:6]
    batch = collate(trajs, worker.pad_id)
    n = int(batch.lengths.max())
    w_logp, w_ent = torch.randn(2, 6, n - 1).mul(batch.mask[:, : n - 1]).unbind()

    logp, ent = worker._logprobs(
        worker.policy, worker.model, batch, (torch.arange(6), n), entropy=True
    )
    assert ent is not None and ent.requires_grad == (entropy_coef > 0)
    ((w_logp * logp).sum() + (w_ent * ent).sum()).backward()

    loss = torch.zeros(())
    for b, traj in enumerate(trajs):
        ids = torch.tensor([traj.token_ids])
        z = plain(input_ids=ids).logits[0, :-1] / 0.8
        logp_v = torch.log_softmax(z, -1)
        ref_logp = logp_v.gather(-1, ids[0, 1:, None])[:, 0]
        ref_ent = torch.logsumexp(z, -1) - (torch.softmax(z, -1) * z).sum(-1)
        sel = batch.mask[b, : len(traj.token_ids) - 1].bool()
        torch.testing.assert_close(logp[b, : len(sel)][sel], ref_logp[sel], atol=1e-5, rtol=0)
        torch.testing.assert_close(ent[b, : len(sel)][sel], ref_ent[sel], atol=1e-5, rtol=1e-5)
        loss = loss + (w_logp[b, : len(sel)] * ref_logp).sum()
        if entropy_coef > 0:
            loss = loss + (w_ent[b, : len(sel)] * ref_ent).sum()
    loss.backward()
    for (name, p), ref in zip(worker.model.named_parameters(), plain.parameters(), strict=True):
        assert p.grad is not None and p.grad.layout == torch.strided, name
        scale = float(ref.grad.abs().max()) + 1e-12
        torch.testing.assert_close(p.grad, ref.grad, atol=1e-5 * scale, rtol=1e-4, msg=name)


@pytest.mark.parametrize("lean_decode", [True, False])
def test_gradient_checkpointing_keeps_the_colocated_engine_exact(make_cfg, monkeypatch,
                                                                 lean_decode):
    """With `--actor.gradient_checkpointing` the engine samples from a module in training mode
    with checkpointing on, where transformers drops the KV cache: the engine must still decode
    with its whole context (through the lean step, or the model's forward) and sample with the
    trainer's weights."""
    from agentrl.backends.cpu import decode
    from trainers.policy import PolicyWorker

    from ._logprobs import sampled_logprob_gap

    if not lean_decode:  # the step declines: the engine runs the model's forward
        monkeypatch.setattr(decode, "decode_logits", lambda *a, **k: None)
    worker = PolicyWorker(make_cfg(actor={"gradient_checkpointing": True}))
    assert worker.model.training and worker.model.is_gradient_checkpointing
    trajs = worker.collect(list(range(4)), 0)
    gap, n = sampled_logprob_gap(worker, trajs)
    assert n > 20 and gap < 1e-4
    assert (worker.engine.counters["lean_decode_steps"] > 0) == lean_decode
    worker.close()
