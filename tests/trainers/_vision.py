"""Vision-language episodes as the trainer takes them, for the tests of any screenshot env:
sampled by the transformers engine from a policy's own model, placeholder-sampling episodes
discarded as the trainer does, whole groups kept."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np

from agentrl import ChatEnv, ChatTokenEnv
from agentrl.completion import SamplingParams
from agentrl.engine.transformers_engine import TransformersEngine
from agentrl.rollout import collect_sync
from agentrl.types import Trajectory


def blanked(trajs: list[Trajectory]) -> list[Trajectory]:
    """The same episodes with every screenshot blacked out (same tokens, other pixels)."""
    return [dataclasses.replace(t, images=[dataclasses.replace(im, pixels=np.zeros_like(im.pixels))
                                           for im in t.images]) for t in trajs]


def is_vision(name: str) -> bool:
    """A parameter of the vision tower or projector (Qwen2-VL, LLaVA, Idefics3 names)."""
    return any(part in name for part in ("visual", "vision_tower", "multi_modal_projector",
                                         "vision_model", "connector"))


def vision_rollout(
    model: Any, tok: Any, image_token: int, make_env: Callable[[], ChatEnv], *,
    num_prompts: int = 3, n: int = 2, max_tokens: int = 6, min_kept: int = 4,
) -> list[Trajectory]:
    """`num_prompts` x `n` episodes of `make_env()` sampled at T=1 from `model`. A random policy
    may sample its image placeholder token, and the trainer discards such episodes
    (rl_step.discard_placeholders); whole groups are kept, for the group baseline. At least
    `min_kept` episodes must remain."""
    from trainers.rl_step import discard_placeholders

    with TransformersEngine(model, tok, max_batch_size=8, seed=0) as engine:
        trajs = collect_sync(
            engine, lambda: ChatTokenEnv(make_env(), tok), num_prompts=num_prompts,
            n_samples_per_prompt=n,
            sampling=SamplingParams(temperature=1.0, max_tokens=max_tokens, seed=0),
        )
    discard_placeholders(trajs, image_token)
    spoilt = {t.group for t in trajs if t.discard}
    kept = [t for t in trajs if t.group not in spoilt]
    assert len(kept) >= min_kept, [t.info.get("error") for t in trajs]
    return kept
