"""Agent calls that set no max_tokens get the rollout's cap in a training run, and the step
counts the calls the cap cut (#32)."""

from __future__ import annotations

import json


def test_uncapped_agent_calls_get_the_rollout_cap_and_are_counted(make_cfg, tmp_path,
                                                                   tiny_tokenizer):
    from agentrl.engine.fakes import FakeEngine
    from trainers.episodes import collect_agent_episodes
    from trainers.rl_step import training_batch

    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("".join(json.dumps({"prompt": f"Count from {i}."}) + "\n" for i in range(2)))
    cfg = make_cfg(agent="tests.trainers.agent_fixture:uncapped_agent", agent_tasks=str(tasks),
                   agent_reward="tests.trainers.agent_fixture:digits_reward",
                   rollout={"n_samples_per_prompt": 2, "max_new_tokens": 6})
    # Without a cap the proxy's default is the rest of the context: the whole long reply.
    engine = FakeEngine(tiny_tokenizer, reply=" ".join(str(i) for i in range(200)))
    trajs = collect_agent_episodes(engine, cfg, tiny_tokenizer, seeds=[0, 1], step=0)
    assert len(trajs) == 4
    assert all([(t.end - t.start, t.finish_reason) for t in traj.turns] == [(6, "length")]
               for traj in trajs)
    _, _, metrics = training_batch(trajs, cfg.algo, max_new_tokens=6)
    assert metrics["agent_calls_capped"] == 4.0
