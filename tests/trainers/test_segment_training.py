"""#32 item 5, training: episodes that a chat template split into segments (tiny-think drops
earlier reasoning, as Qwen3's) train as separate sequences with their episode's outcome
advantage; one update moves the log-probs of every segment's tokens; the step's metrics count
segments per episode apart from drift."""

from __future__ import annotations

import itertools

import pytest
import torch

from agentrl.completion import SamplingParams
from agentrl.engine.fakes import FakeEngine
from agentrl.envs import ChatEnv, ChatTokenEnv
from agentrl.rollout import collect_sync
from agentrl.segments import by_episode, episode_reward


class TwoQuestions(ChatEnv):
    """Two user turns; the outcome (set by the test) comes at the end."""

    def reset(self, *, seed=None, options=None):
        self.t = 0
        return [{"role": "user", "content": f"Count to {seed}."}]

    def step(self, text):
        self.t += 1
        if self.t == 2:
            return [], 0.0, True, False, {}
        return [{"role": "user", "content": "Again?"}], 0.0, False, False, {}


def _replies():
    """Replies that differ call by call (samples of one prompt must differ, or their
    advantages, which sum to zero in a group, cancel in the gradient)."""
    calls = itertools.count()

    def reply(prompt: str, choice: int) -> str:
        k = next(calls)
        return f"<think>count {k % 5}</think>{' '.join(str(i) for i in range(k % 7 + 1))}"

    return reply


@pytest.fixture(scope="module")
def segmented():
    """2 prompts x 4 samples, each episode in 2 segments (the template dropped the first
    reply's reasoning); outcomes 1, 0, 0.5, 0 within each group, on the last segment."""
    from agentrl.models import load_tokenizer

    tok = load_tokenizer("tiny-think")
    trajs = collect_sync(FakeEngine(tok, reply=_replies()),
                         lambda: ChatTokenEnv(TwoQuestions(), tok), num_prompts=2,
                         n_samples_per_prompt=4, group_prefix="s0-",
                         sampling=SamplingParams(temperature=1.0, max_tokens=64, seed=0))
    episodes = by_episode(trajs)
    assert [len(e) for e in episodes] == [2] * 8
    for i, segments in enumerate(episodes):
        segments[-1].turns[-1].reward = [1.0, 0.0, 0.5, 0.0][i % 4]
    return trajs


def _expected_advantages(trajs) -> dict[str, float]:
    """GRPO over episodes, by hand: (R - mean) / (unbiased std + 1e-9) within each group."""
    episodes = by_episode(trajs)
    out = {}
    for segments in episodes:
        group = [episode_reward(e) for e in episodes if e[0].group == segments[0].group]
        mean = sum(group) / len(group)
        std = (sum((r - mean) ** 2 for r in group) / (len(group) - 1)) ** 0.5
        out[segments[0].info["episode"]] = (episode_reward(segments) - mean) / (std + 1e-9)
    return out


def test_every_segment_gets_its_episodes_advantage(make_cfg, segmented):
    from trainers.batch import collate
    from trainers.rl_step import batch_advantages, training_batch

    cfg = make_cfg()
    trajs, group_ids, metrics = training_batch(segmented, cfg.algo, max_new_tokens=64)
    assert metrics["segments_per_episode"] == 2.0 and metrics["template_segments"] == 8.0
    assert metrics["drift_events"] == 0.0
    assert metrics["reward"] == pytest.approx(0.375)  # over the 8 episodes, not 16 segments
    batch = collate(trajs, pad_id=0, group_ids=group_ids)
    adv, _ = batch_advantages(cfg.algo, batch, None, 0.0)
    expected = _expected_advantages(trajs)
    assert len(set(expected.values())) > 1
    for row, t in enumerate(trajs):
        on = batch.mask[row].bool()
        assert int(on.sum()) == t.num_policy_tokens > 0
        torch.testing.assert_close(adv[row][on], torch.full((int(on.sum()),),
                                   expected[t.info["episode"]]), rtol=1e-5, atol=1e-5)


def test_one_update_moves_the_logprobs_of_every_segments_tokens(make_cfg, segmented):
    from trainers.batch import collate
    from trainers.policy import PolicyWorker
    from trainers.rl_step import training_batch

    cfg = make_cfg(algo={"kl_coef": 0.0}, actor={"lr": 1e-3})
    worker = PolicyWorker(cfg, with_engine=False)
    trajs, group_ids, _ = training_batch(segmented, cfg.algo, max_new_tokens=64)
    batch = collate(trajs, worker.pad_id, group_ids)
    worker._fill(batch, "logp", worker.policy)
    before = batch.extras.pop("logp")
    metrics = worker.train(trajs, 0.0, group_ids)
    assert all(torch.isfinite(torch.tensor(v)) for v in metrics.values())
    worker._fill(batch, "logp", worker.policy)
    after = batch.extras["logp"]
    expected = _expected_advantages(trajs)
    for row, t in enumerate(trajs):
        on = batch.mask[row].bool()
        # Each segment's sampled tokens are scored where they sit in its own sequence.
        assert batch.input_ids[row, 1:][on].tolist() == [
            i for i, m in zip(t.token_ids[1:], t.loss_mask[1:], strict=True) if m]
        moved = (after[row][on] - before[row][on]).abs().max()
        assert moved > 1e-5, (row, t.info["segment"], float(moved))
    # The update follows the advantages: to first order it raises sum_t A_t * logp_t (the
    # segments of better episodes gain, of worse ones lose, on balance).
    adv = torch.tensor([expected[t.info["episode"]] for t in trajs])[:, None] * batch.mask
    assert float((adv * (after - before)).sum()) > 0
