"""The run's episode budgets reach the one place that enforces them, the rollout loop, for
training rollouts and evals alike."""

from __future__ import annotations

import dataclasses


def test_rollout_budgets_end_training_and_eval_episodes(make_cfg, tiny_tokenizer):
    from agentrl.engine.fakes import FakeEngine
    from trainers.episodes import collect_for_step, evaluate_engine

    engine = FakeEngine(tiny_tokenizer, reply="123")
    cfg = make_cfg(env_kwargs={"turns": 5}, rollout={"max_turns": 2, "n_samples_per_prompt": 2})
    trajs = collect_for_step(engine, cfg, tiny_tokenizer, seeds=[0, 1], step=0)
    assert [(len(t.turns), t.truncated, t.info["truncated_by"]) for t in trajs] == [
        (2, True, "max_turns")] * 4
    assert [t.group for t in trajs] == ["s0-0", "s0-0", "s0-1", "s0-1"]

    budget = len(trajs[0].token_ids) + 1  # two turns, and no room for a third question
    cfg = dataclasses.replace(cfg, rollout=dataclasses.replace(
        cfg.rollout, max_turns=None, max_episode_tokens=budget))
    result = evaluate_engine(engine, dataclasses.replace(cfg, eval_problems=1), tiny_tokenizer)
    [t] = result["trajectories"]
    assert (len(t.turns), t.info["truncated_by"]) == (2, "max_episode_tokens")
    assert len(t.token_ids) < budget


def test_an_env_with_its_own_turn_rule_is_told_the_runs_turn_budget(make_cfg, tiny_tokenizer):
    """math-tir's last turn must answer, so it learns the run's turn budget
    (`--rollout.max_turns 3` means three math-tir turns, not its default 4); env_kwargs win."""
    from trainers.episodes import env_factory

    cfg = make_cfg(env="math-tir", env_kwargs={"split": "eval", "num_problems": 4},
                   rollout={"max_turns": 3})
    assert env_factory(cfg, tiny_tokenizer)().unwrapped.chat_env.max_turns == 3
    cfg = dataclasses.replace(cfg, env_kwargs={**cfg.env_kwargs, "max_turns": 1})
    assert env_factory(cfg, tiny_tokenizer)().unwrapped.chat_env.max_turns == 1
    # An env without such a rule gets nothing (gym.make would refuse max_turns).
    digits = make_cfg(rollout={"max_turns": 3})
    assert not hasattr(env_factory(digits, tiny_tokenizer)().unwrapped, "max_turns")
