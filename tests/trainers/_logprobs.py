"""The check that a rollout engine samples with the trainer's weights: the trainer's log-probs
of the tokens the engine sampled against the engine's own."""

from __future__ import annotations

from typing import Any

import torch


def sampled_logprob_gap(worker: Any, trajectories: list) -> tuple[float, int]:
    """Largest |trainer log-prob - engine log-prob| over the sampled tokens of `trajectories`,
    under `worker`'s current weights, and how many sampled tokens that covers."""
    from trainers.batch import add_images, collate

    batch = collate(trajectories, worker.pad_id)
    add_images(batch, trajectories, worker.vision, worker.model)
    batch = batch.to(worker.device)
    sampled = batch.mask.bool()
    with torch.no_grad():
        logp, _ = worker._logprobs(worker.policy, worker.model, batch,
                                   (torch.arange(batch.size, device=worker.device),
                                    int(batch.lengths.max())))
    return float((logp - batch.rollout_logp).abs()[sampled].max()), int(sampled.sum())
