"""Vision-language policies through the whole path: a multi-turn screenshot env rendered by the
chat bridge, episodes sampled by the engine with their images, and the trainer scoring exactly
what was sampled (same images, same mRoPE positions, packed or padded, prompts shared or not)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from agentrl import ChatEnv, ChatTokenEnv
from agentrl.models.tiny import TINY_VLMS
from agentrl.types import Trajectory

from ._logprobs import sampled_logprob_gap
from ._vision import blanked, is_vision, vision_rollout


class _Screens(ChatEnv):
    """Three turns, each showing a fresh random screenshot (sizes vary: Qwen2-VL gives them
    different token counts). The reward is irrelevant here."""

    def reset(self, *, seed=None, options=None):
        self.turn = 0
        return [self._screen("Click the red square.")]

    def step(self, text):
        self.turn += 1
        done = self.turn >= 3
        return ([] if done else [self._screen(f"Turn {self.turn}.")]), float(len(text) % 2), \
            done, False, {}

    def _screen(self, text):
        h, w = (56, 84) if self.turn % 2 == 0 else (112, 56)
        image = self.np_random.integers(0, 256, (h, w, 3), dtype=np.uint8)
        return {"role": "user", "content": [{"type": "text", "text": text},
                                            {"type": "image", "image": image}]}


@pytest.mark.parametrize("name", TINY_VLMS)
def test_screenshot_turns_are_appended_and_match_a_full_rerender(name):
    """The bridge expands each screenshot in the turn that brings it; a policy writing canonical
    tokens gets a running sequence equal to a full re-render with every image expanded."""
    from agentrl.models import load_tokenizer

    tok = load_tokenizer(name)
    env = ChatTokenEnv(_Screens(), tok)
    obs, _ = env.reset(seed=0)
    tokens = list(obs["tokens"])
    for _ in range(3):
        action = tok.encode("ok<|im_end|>", add_special_tokens=False)
        obs, _, terminated, _, info = env.step(np.asarray(action))
        assert info["drift_events"] == 0
        assert env.token_ids[: len(tokens)] == tokens  # earlier turns never re-tokenized
        tokens = env.token_ids
        if not terminated:
            assert len(obs["images"]) == 1
            vision = env.bridge._vision
            assert sum(t == vision.image_token_id for t in obs["tokens"]) == \
                vision.encode(obs["images"][0]).tokens.count(vision.image_token_id)


def _rollout(name: str, model, tok, image_token: int) -> list[Trajectory]:
    """Episodes of `_Screens` as the trainer takes them (`_vision.vision_rollout`)."""
    return vision_rollout(model, tok, image_token, _Screens)


@pytest.fixture(scope="module", params=TINY_VLMS)
def worker_and_rollouts(request, tmp_path_factory):
    from trainers.policy import PolicyWorker

    from .conftest import tiny_cfg

    cfg = tiny_cfg(tmp_path_factory.mktemp("vlm"), actor={"model": request.param})
    worker = PolicyWorker(cfg, with_engine=False)
    return worker, _rollout(request.param, worker.model, worker.tokenizer,
                            worker.vision.image_token_id)


def test_episodes_record_their_screenshots_where_their_tokens_sit(worker_and_rollouts):
    worker, trajs = worker_and_rollouts
    image_id = worker.vision.image_token_id
    for t in trajs:
        assert len(t.turns) == 3 and len(t.images) == 3, t.info
        # A random policy samples non-canonical tokenizations; the template never drifts.
        assert t.info.get("drift", {}).get("kind") != "template"
        for im in t.images:
            # Its span is its expansion: image tokens (and the family's marks around them).
            assert im.start >= 0 and image_id in t.token_ids[im.start:im.end]
            assert tuple(t.token_ids[im.start:im.end]) == worker.vision.encode(im.pixels).tokens
        # Observation tokens only: the policy never samples an image token.
        assert all(t.loss_mask[i] == 0 for im in t.images for i in range(im.start, im.end))
        assert Trajectory.from_json(t.to_json()).images[1].start == t.images[1].start


@pytest.mark.parametrize(("packing", "share_prefixes"), [(True, True), (True, False),
                                                           (False, False)])
def test_trainer_logprobs_equal_the_sampled_ones(worker_and_rollouts, packing, share_prefixes):
    worker, trajs = worker_and_rollouts
    worker.cfg = dataclasses.replace(worker.cfg, packing=packing, share_prefixes=share_prefixes)
    gap, n = sampled_logprob_gap(worker, trajs)
    assert n > 40
    assert gap < 1e-5
    # Prefix sharing saved the groups' first screenshot: it is the same within a group.
    if share_prefixes:
        assert worker.shared_tokens > 0


def test_blanked_images_change_the_logprobs(worker_and_rollouts):
    """The trainer really reads the pixels: the same tokens with other screenshots score
    differently."""
    worker, trajs = worker_and_rollouts
    blank = blanked(trajs)
    gap, _ = sampled_logprob_gap(worker, blank)
    assert gap > 1e-3


def test_a_training_step_on_screenshot_episodes(worker_and_rollouts):
    worker, trajs = worker_and_rollouts
    before = {k: v.detach().clone() for k, v in worker.model.named_parameters()}
    metrics = worker.train(trajs, kl_coef=worker.cfg.algo.kl_coef)
    assert np.isfinite(metrics["loss"]) and metrics["entropy"] > 0
    moved = [k for k, v in worker.model.named_parameters() if not torch.equal(v, before[k])]
    # The language model and the vision tower both learn from the screenshots.
    assert any("lm_head" in k or "embed_tokens" in k for k in moved)
    assert any(is_vision(k) for k in moved)


def test_a_text_policy_refuses_screenshot_episodes(worker_and_rollouts, tmp_path):
    from trainers.policy import PolicyWorker

    from .conftest import tiny_cfg

    _, trajs = worker_and_rollouts
    text = PolicyWorker(tiny_cfg(tmp_path), with_engine=False)
    with pytest.raises(ValueError, match="text-only"):
        text.train(trajs, kl_coef=0.0)


@pytest.mark.parametrize("name", TINY_VLMS)
def test_the_ppo_critic_sees_the_screenshots(name, tmp_path):
    """With gae the critic is the whole multimodal model plus a value head: a PPO step trains
    its vision tower too, and its values then depend on the pixels."""
    from trainers.policy import PolicyWorker

    from .conftest import tiny_cfg

    cfg = tiny_cfg(tmp_path, actor={"model": name}, algo={"estimator": "gae"})
    worker = PolicyWorker(cfg, with_engine=False)
    trajs = _rollout(name, worker.model, worker.tokenizer, worker.vision.image_token_id)
    assert worker.critic is not None
    critic = worker.critic.module
    before = {k: v.detach().clone() for k, v in critic.named_parameters()}
    # The value head starts at zero, so the first step moves only the head; the second reaches
    # the backbone.
    for _ in range(2):
        metrics = worker.train(trajs, kl_coef=0.0)
        assert np.isfinite(metrics["value_loss"])
    moved = {k for k, v in critic.named_parameters() if not torch.equal(v, before[k])}
    assert any(is_vision(k) for k in moved), sorted(moved)[:5]
    blank = blanked(trajs)

    def values(episodes):
        from trainers.batch import add_images, collate

        batch = collate(episodes, worker.pad_id, None)
        add_images(batch, episodes, worker.vision, worker.model)
        worker._fill(batch, "values", worker.critic)
        return batch.extras["values"]

    # The head is young (two steps), so values are small: compare with their own size.
    seen = values(trajs)
    assert (seen - values(blank)).abs().max() > 0.05 * seen.abs().max() > 0


def test_an_episode_whose_policy_sampled_the_image_token_is_discarded(tmp_path):
    """The model puts an image wherever its placeholder token is, so a sampled one makes the
    episode unscorable: it is kept in the rollouts but discarded, not a crashed step."""
    from agentrl.models.vision import vision_processor
    from agentrl.types import TrajectoryBuilder
    from trainers.controller import Trainer
    from trainers.rl_step import discard_placeholders

    from .conftest import tiny_cfg

    trainer = Trainer(tiny_cfg(tmp_path, actor={"model": "tiny-llava"}))
    from agentrl.models import load_tokenizer

    image = vision_processor(load_tokenizer("tiny-llava")).image_token_id

    def episode(action):
        b = TrajectoryBuilder()
        b.add_observation([1, 2, 3])
        b.add_action(action, [-0.1] * len(action))
        return b.build(terminated=True, truncated=False)

    fine, stray = episode([4, 5]), episode([4, image])
    assert trainer._image_token == image  # what the driver passes; a colocated worker, its own
    discard_placeholders([fine, stray], trainer._image_token)
    assert not fine.discard
    assert stray.discard and "image placeholder" in stray.info["error"]
