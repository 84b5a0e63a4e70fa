"""play_scripted(): episodes played by a chat env's own scripted policy (`oracle_action`), as
trajectories to imitate: the actions as the policy would write them, the turn budget, episodes
the env discards, and an env without a scripted policy refused by name."""

from __future__ import annotations

import pytest

from agentrl.envs import ChatEnv, ChatTokenEnv
from agentrl.rollout.scripted import NoScriptedPolicyError, play_scripted


class Count(ChatEnv):
    """Count on from a seeded number, `turns` turns; reward 1 for the right next number. Seed
    13 makes the env discard its episode (as a failed browser does)."""

    def __init__(self, turns: int = 2) -> None:
        self.turns = turns

    def reset(self, *, seed=None, options=None):
        self.seed, self.n, self.turn = seed, int(self.np_random.integers(1, 50)), 0
        return [{"role": "user", "content": f"Say the number after {self.n}."}]

    def oracle_action(self) -> str:
        return str(self.n + 1)

    def step(self, text):
        self.turn += 1
        ok = text.strip() == str(self.n + 1)
        self.n += 1
        info = {"discard": True, "error": "the page died"} if self.seed == 13 else {}
        done = self.turn >= self.turns
        return ([] if done else [{"role": "user", "content": "And the next?"}]), float(ok), \
            done, False, info


class NoOracle(Count):
    oracle_action = ChatEnv.oracle_action


def test_actions_are_the_scripted_answers_as_the_policy_writes_them(tiny_tokenizer):
    made: list[ChatTokenEnv] = []

    def make():
        made.append(ChatTokenEnv(Count(turns=2), tiny_tokenizer))
        return made[-1]

    out = play_scripted(make, [1, 2, 3])
    assert len(made) == 1 and out.discarded == 0 and len(out.trajectories) == 3
    bridge = made[0].bridge
    for traj in out.trajectories:
        assert traj.terminated and not traj.truncated
        assert [t.reward for t in traj.turns] == [1.0, 1.0]
        actions = [traj.token_ids[t.start:t.end] for t in traj.turns]
        # The env's answers, tokenized as the bridge renders an assistant turn (end-of-turn
        # token included); the loss mask covers them and nothing else.
        texts = [tiny_tokenizer.decode(a, skip_special_tokens=True) for a in actions]
        first = int(texts[0])
        assert texts == [str(first), str(first + 1)]
        assert actions == [bridge.action_ids(t) for t in texts]
        assert sum(traj.loss_mask) == sum(len(a) for a in actions)
        assert all(traj.loss_mask[i] for t in traj.turns for i in range(t.start, t.end))


def test_the_turn_budget_truncates_and_the_episode_is_kept(tiny_tokenizer):
    out = play_scripted(lambda: ChatTokenEnv(Count(turns=5), tiny_tokenizer), [1, 2],
                        max_turns=3)
    assert [len(t.turns) for t in out.trajectories] == [3, 3]
    assert all(t.truncated and t.info["truncated_by"] == "max_turns" for t in out.trajectories)


def test_discarded_episodes_are_left_out_and_counted(tiny_tokenizer):
    out = play_scripted(lambda: ChatTokenEnv(Count(), tiny_tokenizer), [1, 13, 2])
    assert out.discarded == 1 and out.first_error == "the page died"
    assert len(out.trajectories) == 2


def test_an_env_without_a_scripted_policy_is_refused_by_name(tiny_tokenizer):
    closed = []

    class Tracked(NoOracle):
        def close(self):
            closed.append(True)

    with pytest.raises(NoScriptedPolicyError, match="Tracked has no scripted policy"):
        play_scripted(lambda: ChatTokenEnv(Tracked(), tiny_tokenizer), [1])
    assert closed == [True]  # the env is closed all the same
