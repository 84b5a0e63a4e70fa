"""On-policy distillation in the trainer (--algo.teacher): the teacher's engine, and its
log-probs of the tokens a step's episodes sampled, laid out as the batch's per-target tensors.

The teacher is an engine like the policy's sampler (`--rollout.engine`), asked only to score
(`Engine.score`: a prefill, nothing sampled), so every backend that serves a policy serves a
teacher, vLLM's batching included. It reads each trajectory whole, with its images, whatever
produced it (env rollouts, agent sessions through the proxy, a replayed file); an episode in
segments is scored segment by segment, as it is trained. The advantages that use the scores
are `agentrl.algorithms.distillation_advantages` (trainers/rl_step.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from agentrl.engine import Engine
from agentrl.types import Trajectory
from trainers.config import TrainConfig


def teacher_engine(cfg: TrainConfig, device: torch.device) -> Engine:
    """An engine over --algo.teacher, of the kind --rollout.engine names, on the policy's
    device; the teacher never trains (eval mode: no dropout)."""
    from agentrl.engine import create_engine, open_engine
    from agentrl.models import load_model, load_tokenizer

    teacher = cfg.algo.teacher
    assert teacher is not None
    ro = cfg.rollout
    if ro.engine == "transformers":
        model = load_model(teacher).eval().requires_grad_(False)
        return create_engine(model, tokenizer=load_tokenizer(teacher), device=str(device),
                             prefix_cache_bytes=0)
    return open_engine(teacher, engine=ro.engine, device=str(device),
                       tensor_parallel_size=ro.tensor_parallel_size,
                       gpu_memory_utilization=ro.gpu_memory_utilization,
                       flag_prefix="--rollout.")


def teacher_logprobs(engine: Engine, trajectories: Sequence[Trajectory], width: int) -> Tensor:
    """[B, width] float32: at t, the teacher's log-prob of token t+1 of trajectory b, from its
    first policy token on (0 before it and past its end); the `RolloutBatch` layout
    (trainers/batch.py), which the caller masks to the policy's tokens."""
    out = torch.zeros(len(trajectories), width)
    scores = asyncio.run(_score_all(engine, trajectories))
    for b, (traj, got) in enumerate(zip(trajectories, scores, strict=True)):
        if got:
            start = max(traj.prompt_len, 1)
            out[b, start - 1 : start - 1 + len(got)] = torch.tensor(got)
    return out


async def _score_all(engine: Engine, trajectories: Sequence[Trajectory]) -> list[list[float]]:
    async def one(traj: Trajectory) -> list[float]:
        if not any(traj.loss_mask):
            return []
        images: Any = [im.pixels for im in traj.images] or None
        return await engine.score(traj.token_ids, images, start=max(traj.prompt_len, 1))

    return list(await asyncio.gather(*(one(t) for t in trajectories)))
