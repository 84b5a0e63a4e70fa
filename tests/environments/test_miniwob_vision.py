"""`agentrl/MiniWoB-v0` in `screenshot` mode trains the four vision-language families (#33 item
4): for each tiny VLM, multi-turn click-color episodes in a real headless Chromium (the task's
page as a 160 x 210 screenshot every turn), sampled through the token bridge by the transformers
engine, are scored by the trainer with the engine's log-probs, depend on their pixels, and one
update step moves the vision tower as well as the language model. Skips, saying why, without
Chromium, its driver or the Python packages."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from agentrl.models.tiny import TINY_VLMS
from tests.browsers import browser_unavailable
from tests.trainers._logprobs import sampled_logprob_gap
from tests.trainers._vision import blanked, is_vision, vision_rollout
from tests.trainers.conftest import tiny_cfg

UNAVAILABLE = browser_unavailable()
pytestmark = [pytest.mark.skipif(UNAVAILABLE is not None, reason=f"no browser here: {UNAVAILABLE}"),
              pytest.mark.slow]  # a VLM, four Chromiums and a rollout: ~20-40 s per family

TURNS = 3


def _click_color():
    """Four coloured boxes; the goal names one. A random tiny policy writes no action, so each
    episode runs its 3 turns, a new screenshot each, and ends with MiniWoB's -1."""
    from environments.miniwob.env import MiniWoBEnv

    return MiniWoBEnv(task="click-color", observation="screenshot", max_turns=TURNS)


@pytest.fixture(scope="module", params=TINY_VLMS)
def worker_and_episodes(request, tmp_path_factory):
    """A policy worker of one tiny VLM and 2 x 2 click-color episodes sampled from its weights.
    PPO (gae): every episode scores -1, so a group baseline would give each token a zero
    advantage and no gradient; the critic's values (zero at first) leave the return in it."""
    from trainers.policy import PolicyWorker

    cfg = tiny_cfg(tmp_path_factory.mktemp("miniwob-vlm"), actor={"model": request.param},
                   algo={"estimator": "gae"})
    worker = PolicyWorker(cfg, with_engine=False)
    episodes = vision_rollout(worker.model, worker.tokenizer, worker.vision.image_token_id,
                              _click_color, num_prompts=2, n=2, min_kept=2)
    return worker, episodes


def test_each_turn_brings_a_screenshot_of_the_page(worker_and_episodes):
    worker, episodes = worker_and_episodes
    image_id = worker.vision.image_token_id
    for t in episodes:
        assert t.info["task"] == "click-color" and not t.discard, t.info
        assert len(t.turns) == TURNS and len(t.images) == TURNS
        assert t.truncated and sum(t.rewards) == -1.0  # the turn budget ran out: MiniWoB's -1
        for im in t.images:
            assert im.pixels.shape == (210, 160, 3) and im.pixels.std() > 10  # a page, not blank
            assert tuple(t.token_ids[im.start:im.end]) == worker.vision.encode(im.pixels).tokens
            assert image_id in t.token_ids[im.start:im.end]
            assert not any(t.loss_mask[im.start:im.end])  # observation tokens only
    # The pages differ by seed: the groups saw different screenshots.
    firsts = {t.group: t.images[0].pixels for t in episodes}
    assert len(firsts) == 1 or not np.array_equal(*list(firsts.values())[:2])


def test_trainer_logprobs_equal_the_engines(worker_and_episodes):
    worker, episodes = worker_and_episodes
    gap, n = sampled_logprob_gap(worker, episodes)
    assert n >= 6 * TURNS * len(episodes) // 2  # most turns sampled their 6 tokens
    assert gap < 1e-5


def test_the_trainer_reads_the_screenshots(worker_and_episodes):
    """Blanked screenshots, same tokens: other log-probs (so the equality above is not one of
    a model that ignores its images)."""
    worker, episodes = worker_and_episodes
    gap, _ = sampled_logprob_gap(worker, blanked(episodes))
    assert gap > 1e-3


def test_one_update_moves_the_vision_tower(worker_and_episodes):
    worker, episodes = worker_and_episodes
    policy = worker.model
    before = {k: v.detach().clone() for k, v in policy.named_parameters()}
    metrics = worker.train(episodes, kl_coef=0.0)
    assert np.isfinite(metrics["loss"]) and metrics["grad_norm"] > 0
    moved = [k for k, v in policy.named_parameters() if not torch.equal(v, before[k])]
    assert any(is_vision(k) for k in moved), moved[:5]
    assert any(not is_vision(k) for k in moved), moved[:5]
