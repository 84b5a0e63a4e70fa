"""collect(): single- and multi-turn toy envs, groups, per-step rewards, token exactness,
budgets, and an env that raises."""

from __future__ import annotations

import threading

import gymnasium as gym
import pytest
import torch

import agentrl  # noqa: F401 - registers the toy env ids
from agentrl.completion import SamplingParams
from agentrl.engine.fakes import FakeEngine
from agentrl.envs import ChatEnv, ChatTokenEnv
from agentrl.rollout import collect, collect_sync

SAMPLING = SamplingParams(temperature=1.0, max_tokens=8, seed=0)


class Recorder:
    """env_fn that keeps every env it made, to compare with what the trajectories say."""

    def __init__(self, make):
        self.make, self.envs, self.lock = make, [], threading.Lock()

    def __call__(self):
        env = self.make()
        with self.lock:
            self.envs.append(env)
        return env


class FlakyEnv(ChatEnv):
    """Two turns; step raises on the second turn for odd seeds."""

    def reset(self, *, seed=None, options=None):
        self.seed, self.turn = seed, 0
        return [{"role": "user", "content": "hello"}]

    def step(self, text):
        self.turn += 1
        if self.turn == 2 and self.seed % 2:
            raise RuntimeError("grader crashed")
        return [{"role": "user", "content": "again"}], 0.5, self.turn >= 2, False, {"t": self.turn}


async def test_single_turn_groups_and_order(engine, tiny_tokenizer):
    env_fn = Recorder(lambda: gym.make("agentrl/Reverse-v0", tokenizer=tiny_tokenizer))
    trajs = await collect(
        engine,
        env_fn,
        num_prompts=3,
        n_samples_per_prompt=2,
        sampling=SAMPLING,
        seeds=[10, 11, 12],
        group_prefix="step0-",
    )
    assert [t.group for t in trajs] == [
        "step0-0",
        "step0-0",
        "step0-1",
        "step0-1",
        "step0-2",
        "step0-2",
    ]
    assert [(t.info["prompt_index"], t.info["sample_index"]) for t in trajs] == [
        (i, j) for i in range(3) for j in range(2)
    ]
    assert [t.info["seed"] for t in trajs] == [10, 10, 11, 11, 12, 12]
    for t in trajs:
        assert len(t.turns) == 1 and t.terminated and not t.truncated
        assert "target" in t.info  # the env's last info is kept
        assert 0.0 <= t.rewards[0] <= 1.0 and t.turns[0].end - t.turns[0].start <= 8
    # Both samples of a group saw the same prompt; the samples themselves differ.
    assert trajs[0].token_ids[: trajs[0].prompt_len] == trajs[1].token_ids[: trajs[1].prompt_len]
    assert trajs[0].token_ids != trajs[1].token_ids
    assert len(env_fn.envs) == 6


async def test_multi_turn_token_exact(engine, tiny_model, tiny_tokenizer):
    env_fn = Recorder(lambda: gym.make("agentrl/Digits-v0", tokenizer=tiny_tokenizer, turns=3))
    trajs = await collect(engine, env_fn, num_prompts=2, n_samples_per_prompt=2, sampling=SAMPLING)
    by_seed = {}
    for env in env_fn.envs:
        by_seed.setdefault(env.unwrapped.np_random_seed, []).append(env.unwrapped.token_ids)
    for t in trajs:
        t.validate()
        assert len(t.turns) == 3 and t.terminated
        assert t.token_ids in by_seed[t.info["seed"]]  # exactly the env's running sequence
        assert t.rewards == pytest.approx([t.rewards[0], t.rewards[1], t.rewards[2]])
        assert all(0.0 <= r <= 1.0 for r in t.rewards)
        for turn in t.turns:
            assert turn.policy_version == 0 and turn.obs_start < turn.start
        # loss_mask marks exactly the sampled tokens: their logprobs are the sampler's, which
        # a trainer's forward pass over the whole trajectory reproduces.
        ids = torch.tensor([t.token_ids])
        with torch.no_grad():
            lp = torch.log_softmax(tiny_model(ids).logits[0, :-1].float(), -1)
        lp = lp.gather(-1, ids[0, 1:, None]).squeeze(-1)
        mask = torch.tensor(t.loss_mask[1:], dtype=torch.bool)
        assert int(mask.sum()) == sum(x.end - x.start for x in t.turns)
        torch.testing.assert_close(lp[mask], torch.tensor(t.logprobs[1:])[mask], atol=1e-4, rtol=0)
        assert all(x == 0.0 for x, m in zip(t.logprobs, t.loss_mask, strict=True) if not m)


async def test_raising_step_recorded_without_losing_others(engine, tiny_tokenizer):
    trajs = await collect(
        engine, lambda: ChatTokenEnv(FlakyEnv(), tiny_tokenizer), num_prompts=4, sampling=SAMPLING
    )
    assert len(trajs) == 4
    for i, t in enumerate(trajs):
        if i % 2:
            assert "grader crashed" in t.info["error"] and t.truncated and not t.terminated
            assert len(t.turns) == 2 and t.rewards == [0.5, 0.0]
            assert t.discard  # the env failed, not the policy: never trained on
        else:
            assert "error" not in t.info and t.terminated and t.rewards == [0.5, 0.5]
            assert not t.discard
        t.validate()


async def test_an_env_that_cannot_be_built_fails_the_collection(engine, tiny_tokenizer):
    """A missing sandbox (say) is the machine's fault, not an episode's: it is raised with its
    fix-it message instead of turning every episode into a discarded one."""
    from agentrl.sandbox import SandboxUnavailableError

    def env_fn():
        raise SandboxUnavailableError("bubblewrap was not found. Fix: install bubblewrap")

    with pytest.raises(SandboxUnavailableError, match="install bubblewrap"):
        await collect(engine, env_fn, num_prompts=3, sampling=SAMPLING)


async def test_token_budgets(engine, tiny_tokenizer):
    env_fn = lambda: gym.make("agentrl/Digits-v0", tokenizer=tiny_tokenizer, turns=50)
    trajs = await collect(engine, env_fn, num_prompts=2, sampling=SAMPLING, max_episode_tokens=100)
    for t in trajs:
        assert t.truncated and not t.terminated
        assert len(t.token_ids) <= 100
        assert all(x.end - x.start <= SAMPLING.max_tokens for x in t.turns)
        assert t.info["truncated_by"] == "max_episode_tokens" and len(t.turns) >= 2


async def test_turn_budget_ends_chat_env_episodes(tiny_tokenizer):
    """The rollout loop owns the turn budget: a bridged chat env that would go on for 50 turns
    ends after max_turns, truncated, without the observation no action follows."""
    engine = FakeEngine(tiny_tokenizer, reply="12345")
    env_fn = Recorder(lambda: gym.make("agentrl/Digits-v0", tokenizer=tiny_tokenizer, turns=50))
    trajs = await collect(engine, env_fn, num_prompts=2, n_samples_per_prompt=2,
                          sampling=SAMPLING, max_turns=3)
    for t in trajs:
        t.validate()
        assert len(t.turns) == 3 and t.truncated and not t.terminated
        assert t.info["truncated_by"] == "max_turns" and t.rewards == [1.0, 1.0, 1.0]
        assert t.turns[-1].end == len(t.token_ids)  # the 4th question is not appended
    assert len(engine.requests) == 4 * 3
    # The bridge itself never truncated: it rendered the 4th question (question, then 3 x
    # answer + question), which the loop dropped.
    assert [len(env.unwrapped.messages) for env in env_fn.envs] == [7] * 4


async def test_token_budget_caps_each_turn_then_truncates(tiny_tokenizer):
    engine = FakeEngine(tiny_tokenizer, reply="1 2 3 4 5 6 7 8 9 10 11 12")
    env_fn = lambda: gym.make("agentrl/Digits-v0", tokenizer=tiny_tokenizer, turns=50)
    [free] = await collect(engine, env_fn, num_prompts=1, sampling=SAMPLING, max_turns=2)
    budget = free.turns[1].start + 3  # room for 3 tokens in the second turn
    engine.requests.clear()
    [t] = await collect(engine, env_fn, num_prompts=1, sampling=SAMPLING,
                        max_episode_tokens=budget)
    assert t.truncated and t.info["truncated_by"] == "max_episode_tokens"
    assert [x.end - x.start for x in t.turns] == [8, 3] and len(t.token_ids) == budget
    assert t.token_ids == free.token_ids[:budget]
    # Each request may sample what the turn allows, within what the episode has left.
    assert [params.max_tokens for _, params, _ in engine.requests] == [8, 3]


def test_collect_sync_from_a_thread(engine, tiny_tokenizer):
    out = {}

    def work():
        out["trajs"] = collect_sync(
            engine,
            lambda: gym.make("agentrl/Reverse-v0", tokenizer=tiny_tokenizer),
            num_prompts=2,
            sampling=SAMPLING,
            progress=True,
        )

    th = threading.Thread(target=work)
    th.start()
    th.join(60)
    assert [t.group for t in out["trajs"]] == ["0", "1"]


async def test_seeded_collection_repeats(engine, tiny_tokenizer):
    env_fn = lambda: gym.make("agentrl/Reverse-v0", tokenizer=tiny_tokenizer)
    a = await collect(engine, env_fn, num_prompts=2, n_samples_per_prompt=2, sampling=SAMPLING)
    b = await collect(engine, env_fn, num_prompts=2, n_samples_per_prompt=2, sampling=SAMPLING)
    assert [t.token_ids for t in a] == [t.token_ids for t in b]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"num_prompts": -1}, "num_prompts"),
        ({"n_samples_per_prompt": 0}, "n_samples_per_prompt"),
        ({"seeds": [1]}, "seeds has 1"),
        ({"max_concurrency": 0}, "max_concurrency"),
        ({"max_turns": 0}, "max_turns must be an integer >= 1"),
        ({"max_episode_tokens": 0}, "max_episode_tokens must be an integer >= 1"),
    ],
)
async def test_bad_arguments(engine, kwargs, match):
    args = {"num_prompts": 2, "sampling": SAMPLING, **kwargs}
    with pytest.raises(ValueError, match=match):
        await collect(engine, lambda: None, **args)
