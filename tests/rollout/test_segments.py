"""collect() with a chat template that drops earlier reasoning (tiny-think, as Qwen3's): an
episode goes on in segments, each a trajectory whose prompt is exactly what the engine was
asked and whose action is exactly what it sampled; evaluation counts the episode once."""

from __future__ import annotations

import pytest

from agentrl.completion import SamplingParams
from agentrl.engine.fakes import FakeEngine
from agentrl.envs import ChatEnv, ChatTokenEnv
from agentrl.rollout import collect_sync
from agentrl.rollout.evaluate import score
from agentrl.segments import by_episode, dense_episode_ids

SAMPLING = SamplingParams(temperature=1.0, max_tokens=64, seed=0)


class ThreeQuestions(ChatEnv):
    """Three user turns; rewards 0.1, 0.2, 1.0; solved at the end."""

    def reset(self, *, seed=None, options=None):
        self.t = 0
        return [{"role": "user", "content": "One?"}]

    def step(self, text):
        self.t += 1
        if self.t == 3:
            return [], 1.0, True, False, {"correct": True}
        return [{"role": "user", "content": f"Turn {self.t + 1}?"}], 0.1 * self.t, False, False, {}


def _reply(prompt: str, choice: int) -> str:
    n = prompt.count("<|im_start|>user")
    return f"<think>plan {n}</think>ok {n}"


@pytest.fixture(scope="module")
def think_tok():
    from agentrl.models import load_tokenizer

    return load_tokenizer("tiny-think")


def test_an_episode_goes_on_in_segments_token_exact(think_tok):
    tok = think_tok
    engine = FakeEngine(tok, reply=_reply)
    trajs = collect_sync(engine, lambda: ChatTokenEnv(ThreeQuestions(), tok), num_prompts=2,
                         n_samples_per_prompt=2, sampling=SAMPLING, group_prefix="g")
    episodes = by_episode(trajs)
    assert len(trajs) == 12 and [len(e) for e in episodes] == [3, 3, 3, 3]
    assert dense_episode_ids(trajs) == [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3]  # in order
    asked = [r[0] for r in engine.requests]
    for segments in episodes:
        assert [t.info["segment"] for t in segments] == [0, 1, 2]
        assert [t.info["segment_cause"] for t in segments] == ["start", "template", "template"]
        assert len({t.group for t in segments}) == 1 and len({t.uid for t in segments}) == 3
        assert [t.rewards for t in segments] == [[pytest.approx(0.1)], [pytest.approx(0.2)],
                                                 [1.0]]
        for k, t in enumerate(segments):
            [turn] = t.turns
            prompt = t.token_ids[: turn.start]
            # The prompt is what the engine was asked: no earlier reasoning, nothing more.
            assert prompt in asked
            assert "plan" not in tok.decode(prompt) and (k == 0 or f"ok {k}" in tok.decode(prompt))
            # The action is what it sampled, exactly.
            sampled = tok.encode(f"<think>plan {k + 1}</think>ok {k + 1}",
                                 add_special_tokens=False) + [tok.eos_token_id]
            assert t.token_ids[turn.start:turn.end] == sampled
            assert t.loss_mask == [0] * turn.start + [1] * len(sampled)
            assert t.terminated and t.info["correct"] is True  # the episode's outcome
    result = score(trajs, k=2)
    assert (result.num_problems, result.num_samples) == (2, 4)
    assert result.pass_at_1 == 1.0 and result.mean_return == pytest.approx(1.3)


def test_report_mode_keeps_one_sequence_and_counts_drift(think_tok):
    engine = FakeEngine(think_tok, reply=_reply)
    [traj] = collect_sync(
        engine, lambda: ChatTokenEnv(ThreeQuestions(), think_tok, on_rewrite="report"),
        num_prompts=1, sampling=SAMPLING)
    assert len(traj.turns) == 3 and "episode" not in traj.info
    assert traj.info["drift_events"] == 3  # every step: the re-render drops reasoning
