"""A training step's episodes: the env each episode runs (the train or the held-out split), the
step's sampling, and collecting them against an engine: env rollouts, agent sessions through the
proxy (`--agent`), and the held-out evaluation."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from agentrl.completion import SamplingParams
from agentrl.plugins import load_callable
from agentrl.seeding import derive_seed
from agentrl.types import Trajectory
from trainers.config import TrainConfig, load_tasks

logger = logging.getLogger(__name__)


def env_kwargs(cfg: TrainConfig, *, eval_split: bool = False) -> dict[str, Any]:
    """The keyword arguments the run's env (its training or held-out split) is made with."""
    from agentrl.envs import resolve_env_id
    from agentrl.envs.registry import with_turn_budget

    kwargs: dict[str, Any] = dict(cfg.env_kwargs)
    if cfg.dataset.path:
        kwargs.update(cfg.single_turn_kwargs(eval_split=eval_split))
    if eval_split:
        kwargs.update(cfg.eval_env_kwargs)
    return with_turn_budget(resolve_env_id(cfg.env), kwargs, cfg.rollout.max_turns)


def env_factory(cfg: TrainConfig, tokenizer: Any, *, eval_split: bool = False) -> Callable[[], Any]:
    import gymnasium as gym

    from agentrl.envs import resolve_env_id

    env_id = resolve_env_id(cfg.env)
    kwargs = env_kwargs(cfg, eval_split=eval_split)
    return lambda: gym.make(env_id, tokenizer=tokenizer, **kwargs)


def warmup_episodes(cfg: TrainConfig, tokenizer: Any) -> Any:
    """The warm-up's scripted episodes (`agentrl.rollout.scripted.Scripted`): the training
    env with --warmup.env_kwargs over its own, seeded from --seed apart from the prompts."""
    import gymnasium as gym

    from agentrl.envs import resolve_env_id
    from agentrl.rollout.scripted import play_scripted

    env_id = resolve_env_id(cfg.env)
    kwargs = {**env_kwargs(cfg), **cfg.warmup.env_kwargs}
    turns = kwargs.get("max_turns", cfg.rollout.max_turns)
    seeds = [derive_seed(cfg.seed, "warmup", i) for i in range(cfg.warmup.episodes)]
    return play_scripted(lambda: gym.make(env_id, tokenizer=tokenizer, **kwargs), seeds,
                         max_turns=turns if isinstance(turns, int) else None)


def eval_setting(cfg: TrainConfig) -> dict[str, Any]:
    """What the run's evals measure, for the record: the env and the arguments that choose its
    held-out problems (split, tasks, difficulty, ...), how many, and how they are sampled. An
    agent run's: the agent, its held-out task file, and the agent's own sampling."""
    import json

    if cfg.agent_run:
        return {"env": f"agent {cfg.agent or cfg.agent_cmd}", "tasks": cfg.agent_eval_tasks,
                "problems": cfg.eval_problems, "samples_per_problem": cfg.eval_samples,
                "temperature": "as the agent sets it"}
    chosen = {k: v for k, v in env_kwargs(cfg, eval_split=True).items()
              if isinstance(v, str | int | float | bool | list | dict)}
    return {"env": cfg.env, **json.loads(json.dumps(chosen, default=str)),
            "problems": cfg.eval_problems, "samples_per_problem": cfg.eval_samples,
            "temperature": cfg.eval_temperature}


def sampling_params(
    cfg: TrainConfig, *, purpose: int | str, temperature: float | None = None
) -> SamplingParams:
    """The run's sampling, seeded from --seed and `purpose` (a training step, or "eval"): the
    collector derives each episode's and turn's seed from it, so the same seed, config and
    machine sample the same tokens, and a resumed run samples what an uninterrupted one would.
    Evals before and after training share their seeds (common random numbers)."""
    return SamplingParams(
        temperature=cfg.rollout.temperature if temperature is None else temperature,
        top_p=cfg.rollout.top_p,
        max_tokens=cfg.rollout.max_new_tokens,
        seed=derive_seed(cfg.seed, purpose),
    )


def collect_for_step(
    engine: Any, cfg: TrainConfig, tokenizer: Any, seeds: list[int], step: int
) -> list[Trajectory]:
    from agentrl.rollout import collect_sync

    return collect_sync(
        engine,
        env_factory(cfg, tokenizer),
        num_prompts=len(seeds),
        n_samples_per_prompt=cfg.rollout.n_samples_per_prompt,
        sampling=sampling_params(cfg, purpose=step),
        seeds=seeds,
        max_turns=cfg.rollout.max_turns,
        max_episode_tokens=cfg.rollout.max_episode_tokens,
        max_concurrency=cfg.rollout.max_concurrency,
        group_prefix=group_prefix(step),
        env_timeout_s=cfg.rollout.env_timeout_s,
    )


def group_prefix(step: int) -> str:
    """Prefix of the groups of a training step's rollouts (env episodes and agent sessions):
    prompt i of step s is group "s{s}-{i}", distinct across steps (and async rollouts)."""
    return f"s{step}-"


def collect_agent_episodes(
    engine: Any, cfg: TrainConfig, tokenizer: Any, seeds: list[int], step: int
) -> list[Trajectory]:
    """Run the configured black-box agent through the recording proxy: prompt i of the step is
    task `seeds[i] % len(tasks)`, run n_samples_per_prompt times as one group, each episode
    scored by --agent_reward or by the reward service of --reward.url."""
    tasks = load_tasks(cfg.agent_tasks, "--agent_tasks")
    _warn_unused_budgets(cfg)
    picked = [tasks[s % len(tasks)] for s in seeds]
    return run_agent_episodes(engine, cfg, tokenizer, picked,
                              n_samples=cfg.rollout.n_samples_per_prompt,
                              group_prefix=group_prefix(step), purpose=step)


def run_agent_episodes(
    engine: Any, cfg: TrainConfig, tokenizer: Any, tasks: list[Any], *, n_samples: int,
    group_prefix: str, purpose: int | str,
) -> list[Trajectory]:
    """The run's agent on `tasks` (n_samples episodes each, task i's a group), each episode a
    session of a proxy over `engine`, scored by --agent_reward or --reward.url. The sessions
    are seeded from --seed and `purpose` (a training step, or "eval"), as env rollouts are: the
    agent's calls that set no seed sample alike on every run of the same seed."""
    import asyncio

    from servers.agent_processes import CommandAgent
    from servers.agents import remote_agent_reward, run_agents
    from servers.app import create_app
    from servers.config import ProxyConfig

    agent_fn = CommandAgent(cfg.agent_cmd) if cfg.agent_cmd else load_callable(cfg.agent or "")
    if cfg.agent_reward:
        reward_fn = load_callable(cfg.agent_reward)
    else:  # the config checked that one of the two is set
        assert cfg.reward.url is not None
        reward_fn = remote_agent_reward(cfg.reward.url, timeout_s=cfg.reward.timeout_s,
                                        retries=cfg.reward.retries, max_batch=cfg.reward.max_batch)
    # Agents may name the policy "agentrl" or by its model name; both are served. A call that
    # sets no max_tokens gets the rollout's cap, not the rest of the context (#32: a 135M
    # model's ramble ran to thousands of tokens a call).
    app = create_app(engine, tokenizer, config=ProxyConfig(
        aliases=(cfg.actor.model,), max_tokens_default=cfg.rollout.max_new_tokens))
    trajs = asyncio.run(
        run_agents(
            agent_fn,
            tasks,
            app=app,
            reward_fn=reward_fn,
            concurrency=cfg.agent_concurrency or cfg.rollout.max_concurrency,
            n_samples_per_task=n_samples,
            group_prefix=group_prefix,
            timeout_s=cfg.agent_timeout_s,
            seed=derive_seed(cfg.seed, purpose),
        )
    )
    _warn_capped(trajs, cfg.rollout.max_new_tokens)
    return trajs


_cap_warned = False


def _warn_capped(trajs: list[Trajectory], cap: int) -> None:
    """Say once a run that agent calls ran into the per-call cap (counted every step as
    `agent_calls_capped` in metrics.jsonl)."""
    global _cap_warned
    from trainers.rl_step import capped_calls

    capped = capped_calls(trajs, cap)
    if capped and not _cap_warned:
        _cap_warned = True
        logger.warning("%d agent calls stopped at the %d-token limit: their own max_tokens, or "
                       "--rollout.max_new_tokens for a call that sets none (raise the one that "
                       "applies); counted each step as agent_calls_capped", capped, cap)


_budget_warned = False


def _warn_unused_budgets(cfg: TrainConfig) -> None:
    global _budget_warned
    ro = cfg.rollout
    if _budget_warned or (ro.max_turns is None and ro.max_episode_tokens is None):
        return
    _budget_warned = True
    logger.warning(
        "--rollout.max_turns and --rollout.max_episode_tokens apply to env rollouts only; an "
        "agent (--agent, --agent_cmd) runs its own loop through the proxy (limit its turns in "
        "the agent, its tokens per call with max_tokens)"
    )


def evaluate_engine(engine: Any, cfg: TrainConfig, tokenizer: Any) -> dict[str, Any]:
    """pass@1 / pass@k on the env's held-out split (`eval_env_kwargs`), or an agent run's on
    its held-out tasks (--agent_eval_tasks)."""
    from agentrl.rollout.evaluate import evaluate

    if cfg.agent_run:
        return _eval_record(cfg, evaluate_agent(engine, cfg, tokenizer))
    return _eval_record(cfg, evaluate(
        engine,
        env_factory(cfg, tokenizer, eval_split=True),
        num_problems=cfg.eval_problems,
        k=cfg.eval_samples,
        sampling=sampling_params(cfg, purpose="eval", temperature=cfg.eval_temperature),
        max_turns=cfg.rollout.max_turns,
        max_episode_tokens=cfg.rollout.max_episode_tokens,
        max_concurrency=cfg.rollout.max_concurrency,
        progress=cfg.progress,
        env_timeout_s=cfg.rollout.env_timeout_s,
    ))


def _eval_record(cfg: TrainConfig, result: Any) -> dict[str, Any]:
    return {
        "pass@1": result.pass_at_1,
        "pass@1_low": result.pass_at_1_interval[0],
        "pass@1_high": result.pass_at_1_interval[1],
        f"pass@{cfg.eval_samples}": result.pass_at_k,
        "mean_return": result.mean_return,
        "num_problems": result.num_problems,
        "num_samples": result.num_samples,
        "trajectories": result.trajectories,
        "rates": result.rates(),
    }


def evaluate_agent(engine: Any, cfg: TrainConfig, tokenizer: Any) -> Any:
    """The agent on the first --eval_problems tasks of --agent_eval_tasks, --eval_samples
    episodes each, through the proxy as in training: an `EvalResult` (pass@1 with its interval,
    pass@k, mean return) over episodes, an episode solved when its reward is >= 1. A session
    split in segments counts once, by the segment holding its reward; all are kept."""
    import dataclasses

    from agentrl.rollout.evaluate import score

    tasks = load_tasks(cfg.agent_eval_tasks, "--agent_eval_tasks")[: cfg.eval_problems]
    trajs = run_agent_episodes(engine, cfg, tokenizer, tasks, n_samples=cfg.eval_samples,
                               group_prefix="eval-", purpose="eval")
    by_session: dict[str, Trajectory] = {}
    for t in trajs:
        t.info["prompt_index"] = int(t.info.get("task_index", 0))
        sid = str(t.info.get("session_id", t.uid))
        held = by_session.get(sid)
        if held is None or abs(t.total_reward) > abs(held.total_reward):
            by_session[sid] = t
    return dataclasses.replace(score(list(by_session.values()), cfg.eval_samples),
                               trajectories=trajs)
