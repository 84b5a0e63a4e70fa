"""Rollouts for the trainer: env episodes against an engine, and the placed-mode rollout worker
that receives weights in buckets.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch

from agentrl.plugins import load_callable
from agentrl.seeding import derive_seed
from agentrl.types import SamplingParams, Trajectory
from trainers.config import TrainConfig

logger = logging.getLogger(__name__)


def make_engine(
    cfg: TrainConfig, model: Any, tokenizer: Any, device: torch.device,
    weight_transfer: str | None = None,
) -> Any:
    """The rollout engine `cfg.rollout.engine` names. transformers samples from `model` itself
    (colocated, the module being trained); vllm loads its own copy of `cfg.actor.model` (and
    takes broadcast weight updates with `weight_transfer`: trainers/weight_sync.py)."""
    from agentrl.engine import create_engine, open_engine

    ro = cfg.rollout
    if ro.engine == "transformers":
        return create_engine(model, tokenizer=tokenizer, device=str(device))
    return open_engine(
        cfg.actor.model, engine=ro.engine, device=str(device), tokenizer=tokenizer,
        tensor_parallel_size=ro.tensor_parallel_size,
        gpu_memory_utilization=ro.gpu_memory_utilization, enable_sleep=ro.enable_sleep,
        weight_transfer=weight_transfer, flag_prefix="--rollout.",
    )


def env_kwargs(cfg: TrainConfig, *, eval_split: bool = False) -> dict[str, Any]:
    """The keyword arguments the run's env (its training or held-out split) is made with."""
    from agentrl.envs import resolve_env_id
    from agentrl.envs.registry import env_takes

    kwargs: dict[str, Any] = dict(cfg.env_kwargs)
    if cfg.dataset.path:
        kwargs.update(cfg.single_turn_kwargs(eval_split=eval_split))
    if eval_split:
        kwargs.update(cfg.eval_env_kwargs)
    # The rollout loop enforces the run's turn and token budgets. An env whose own task rule
    # depends on its turn limit (math-tir: the last turn must answer) is told the turn budget.
    if cfg.rollout.max_turns is not None and env_takes(resolve_env_id(cfg.env), "max_turns"):
        kwargs.setdefault("max_turns", cfg.rollout.max_turns)
    return kwargs


def env_factory(cfg: TrainConfig, tokenizer: Any, *, eval_split: bool = False) -> Callable[[], Any]:
    import gymnasium as gym

    from agentrl.envs import resolve_env_id

    env_id = resolve_env_id(cfg.env)
    kwargs = env_kwargs(cfg, eval_split=eval_split)
    return lambda: gym.make(env_id, tokenizer=tokenizer, **kwargs)


def eval_setting(cfg: TrainConfig) -> dict[str, Any]:
    """What the run's evals measure, for the record: the env and the arguments that choose its
    held-out problems (split, tasks, difficulty, ...), how many, and how they are sampled."""
    import json

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
    import asyncio

    from servers.agents import remote_agent_reward, run_agents
    from servers.app import create_app
    from servers.config import ProxyConfig

    agent_fn = load_callable(cfg.agent)
    if cfg.agent_reward:
        reward_fn = load_callable(cfg.agent_reward)
    else:  # the config checked that one of the two is set
        assert cfg.reward.url is not None
        reward_fn = remote_agent_reward(cfg.reward.url, timeout_s=cfg.reward.timeout_s,
                                        retries=cfg.reward.retries, max_batch=cfg.reward.max_batch)
    tasks = load_tasks(cfg.agent_tasks)
    _warn_unused_budgets(cfg)
    picked = [tasks[s % len(tasks)] for s in seeds]
    # Agents may name the policy "agentrl" or by its model name; both are served.
    app = create_app(engine, tokenizer, config=ProxyConfig(aliases=(cfg.actor.model,)))
    return asyncio.run(
        run_agents(
            agent_fn,
            picked,
            app=app,
            reward_fn=reward_fn,
            concurrency=cfg.rollout.max_concurrency,
            n_samples_per_task=cfg.rollout.n_samples_per_prompt,
            group_prefix=group_prefix(step),
        )
    )


_budget_warned = False


def _warn_unused_budgets(cfg: TrainConfig) -> None:
    global _budget_warned
    ro = cfg.rollout
    if _budget_warned or (ro.max_turns is None and ro.max_episode_tokens is None):
        return
    _budget_warned = True
    logger.warning(
        "--rollout.max_turns and --rollout.max_episode_tokens apply to env rollouts only; an "
        "--agent runs its own loop through the proxy (limit its turns in the agent, its tokens "
        "per call with max_tokens)"
    )


def load_tasks(path: str | None) -> list[Any]:
    import json
    from pathlib import Path

    if not path or not Path(path).is_file():
        raise ValueError(f"--agent_tasks {path!r} does not exist")
    tasks = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    if not tasks:
        raise ValueError(f"--agent_tasks {path} holds no tasks")
    return tasks


def evaluate_engine(engine: Any, cfg: TrainConfig, tokenizer: Any) -> dict[str, Any]:
    """pass@1 / pass@k on the env's held-out split (`eval_env_kwargs`)."""
    from agentrl.rollout.evaluate import evaluate

    result = evaluate(
        engine,
        env_factory(cfg, tokenizer, eval_split=True),
        num_problems=cfg.eval_problems,
        k=cfg.eval_samples,
        sampling=sampling_params(cfg, purpose="eval", temperature=cfg.eval_temperature),
        max_turns=cfg.rollout.max_turns,
        max_episode_tokens=cfg.rollout.max_episode_tokens,
        progress=cfg.progress,
        env_timeout_s=cfg.rollout.env_timeout_s,
    )
    return {
        "pass@1": result.pass_at_1,
        "pass@1_ci95": result.pass_at_1_ci95,
        f"pass@{cfg.eval_samples}": result.pass_at_k,
        "mean_return": result.mean_return,
        "num_problems": result.num_problems,
        "num_samples": result.num_samples,
        "trajectories": result.trajectories,
        "rates": result.rates(),
    }


def weight_buckets(
    named: dict[str, torch.Tensor], bucket_mb: int
) -> Iterator[dict[str, torch.Tensor]]:
    """Split a state dict into buckets of about `bucket_mb` MiB (one transfer each), instead of
    one parameter at a time (slow) or everything at once (a full extra copy in flight)."""
    limit = bucket_mb * 2**20
    bucket: dict[str, torch.Tensor] = {}
    size = 0
    for name, t in named.items():
        bucket[name] = t
        size += t.numel() * t.element_size()
        if size >= limit:
            yield bucket
            bucket, size = {}, 0
    if bucket:
        yield bucket


def _own_engine(cfg: TrainConfig, tokenizer: Any,
                weight_transfer: str | None = None) -> tuple[Any, Any]:
    """(model, engine): an engine with its own copy of the weights (vLLM loads them itself;
    the transformers engine samples from the returned model)."""
    from agentrl.backends import resolve_device
    from agentrl.models import load_model

    device = resolve_device(cfg.actor.device)
    model = None
    if cfg.rollout.engine == "transformers":
        model = load_model(cfg.actor.model).eval().to(device)
    return model, make_engine(cfg, model, tokenizer, device, weight_transfer)


class EngineWorker:
    """One more engine of a placed run (`--rollout.num_engines`), in its own Ray actor: the
    rollout worker's router calls it like a local engine (`RemoteEngine`)."""

    def __init__(self, cfg: TrainConfig, weight_transfer: str | None = None) -> None:
        """`weight_transfer`: the engine also takes broadcast updates (trainers/weight_sync.py)."""
        from agentrl.models import load_tokenizer

        self.model, self.engine = _own_engine(cfg, load_tokenizer(cfg.actor.model),
                                              weight_transfer)

    async def generate(self, prompt_ids: list[int], params: SamplingParams,
                       images: Any = None) -> list[Any]:
        return list(await self.engine.generate(prompt_ids, params, images))

    def update_weights(self, named: list[tuple[str, torch.Tensor]], version: int) -> int:
        self.engine.update_weights(named, version)
        return version

    def weight_transfer(self, step: str, *args: Any) -> None:
        """One step of a broadcast update (agentrl.engine.weight_broadcast.RECEIVER_STEPS)."""
        from agentrl.engine.weight_broadcast import receive_step

        receive_step(self.engine, step, *args)

    def info(self) -> tuple[int, int]:
        """(version, max_context)."""
        return int(self.engine.version), int(self.engine.max_context)

    def node(self) -> str:
        from trainers.ray_utils import current_node

        return current_node()

    def close(self) -> None:
        self.engine.close()


class RemoteEngine:
    """An `EngineWorker` actor as an engine (what the router needs of one)."""

    def __init__(self, actor: Any) -> None:
        import ray

        self.actor = actor
        self.version, self.max_context = ray.get(actor.info.remote())

    async def generate(self, prompt_ids: Any, params: SamplingParams,
                       images: Any = None) -> list[Any]:
        import ray

        from agentrl.engine.router import EngineGone

        try:
            return list(await self.actor.generate.remote(list(prompt_ids), params, images))
        except ray.exceptions.RayActorError as e:
            raise EngineGone(f"engine actor died: {e}") from e

    def start_update(self, named: Any, version: int) -> Any:
        """Send the weights and return at once (the router waits for several together)."""
        items = list(named.items()) if hasattr(named, "items") else list(named)
        return self.actor.update_weights.remote(items, version)

    def finish_update(self, pending: Any, version: int) -> None:
        import ray

        from agentrl.engine.router import EngineGone

        try:
            ray.get(pending)
        except ray.exceptions.RayActorError as e:
            raise EngineGone(f"engine actor died: {e}") from e
        self.version = version

    def update_weights(self, named: Any, version: int) -> None:
        self.finish_update(self.start_update(named, version), version)

    def weight_transfer(self, step: str, *args: Any) -> None:
        """One step of a broadcast update, in the actor (`EngineWorker.weight_transfer`)."""
        import ray

        from agentrl.engine.router import EngineGone

        try:
            ray.get(self.actor.weight_transfer.remote(step, *args))
        except ray.exceptions.RayActorError as e:
            raise EngineGone(f"engine actor died: {e}") from e
        if step == "finish_weight_transfer":
            self.version = int(args[0])

    def sleep(self) -> None:
        pass

    def wake(self) -> None:
        pass

    def close(self) -> None:
        import ray

        ray.get(self.actor.close.remote())


WEIGHTS_GROUP = "weights"
"""The Ray concurrency group of `RolloutWorker.update_weights` and `weight_transfer`: they run
beside a `collect` in flight (partial rollout), while collects and evals, in the default group,
still run one at a time."""


class RolloutWorker:
    """Placed mode: an engine with its own copy of the weights, updated by `update_weights` (or,
    made with `weight_transfer`, by the trainer's broadcast: `weight_transfer`). With
    `extra_engines` (EngineWorker actors) or `--rollout.num_engines` > 1 in one process, its
    episodes go through a router (agentrl/engine/router.py) over all of them."""

    def __init__(self, cfg: TrainConfig, weight_transfer: str | None = None,
                 extra_engines: list[Any] | None = None,
                 extra_options: list[dict[str, Any]] | None = None) -> None:
        """`extra_engines`: EngineWorker actors, made with `extra_options` (with which a dead
        one is restarted)."""
        from agentrl.models import load_tokenizer

        self.cfg = cfg
        self.tokenizer = load_tokenizer(cfg.actor.model)
        self.model, engine = _own_engine(cfg, self.tokenizer, weight_transfer)
        self._transfer = weight_transfer
        self._extra_options = list(extra_options or [{} for _ in extra_engines or ()])
        self._last_weights: list[tuple[str, torch.Tensor]] | None = None
        self._pending: dict[str, torch.Tensor] = {}  # weight-sync buckets of the next version
        # A broadcast sync: the engines in the current weight group, and engines restarted
        # since (they join at the next group, and sample once an update has reached them).
        self._group_lock = threading.Lock()
        self._group_epoch = 0
        self._fan: Any = None
        self._members: list[tuple[int, Any]] = []
        self._joining: dict[int, Any] = {}
        engines = [engine]
        if extra_engines:
            engines += [RemoteEngine(a) for a in extra_engines]
        elif cfg.rollout.num_engines > 1:  # no Ray: the engines share this process
            engines += [_own_engine(cfg, self.tokenizer, weight_transfer)[1]
                        for _ in range(cfg.rollout.num_engines - 1)]
        if len(engines) > 1:
            from agentrl.engine.router import EngineRouter

            self.engine: Any = EngineRouter(
                engines, restart=self._restart_engine if extra_engines else None)
        else:
            self.engine = engine

    def _restart_engine(self, i: int) -> Any:
        """A new EngineWorker in place of engine `i` (a dead actor), with the current weights:
        this worker's model copy holds them (transformers), or the last update's (vLLM). Under a
        broadcast sync this worker never holds the weights: the new engine joins the trainer's
        next weight group and the router gets it once that update has reached it (None now)."""
        import ray

        if self._transfer is not None:
            with self._group_lock:  # the group spanning the dead engine is over
                self._group_epoch += 1
        actor = (ray.remote(EngineWorker).options(**self._extra_options[i - 1])
                 .remote(self.cfg, self._transfer))
        fresh = RemoteEngine(actor)
        if self._transfer is not None:
            with self._group_lock:
                self._joining[i] = fresh
                self._group_epoch += 1
            return None
        version = self.engine.version
        weights = (list(self.model.state_dict().items()) if self.model is not None
                   else self._last_weights)
        if weights is not None and version != fresh.version:
            fresh.update_weights(weights, version)
        return fresh

    def collect(self, seeds: list[int], step: int) -> list[Trajectory]:
        fn = collect_agent_episodes if self.cfg.agent else collect_for_step
        return fn(self.engine, self.cfg, self.tokenizer, seeds, step)

    def update_weights(self, bucket: dict[str, torch.Tensor], version: int, last: bool) -> int:
        """Receive one bucket of `version`; the engine loads them all at the last one, so no
        request samples from a mix of two versions' weights."""
        self._pending.update(bucket)
        if last:
            pending, self._pending = self._pending, {}
            self.engine.update_weights(pending, version)
            if self.model is None and self._extra_options:
                # vLLM keeps its weights in its processes: a restarted engine needs these.
                self._last_weights = list(pending.items())
        return version

    def weight_group(self) -> tuple[int, int]:
        """(epoch, size) of the weight group the trainer's broadcast should open: its rank 0
        and the workers of every live engine and every restarted one. The epoch changes when
        an engine is restarted; the trainer then opens a new group."""
        with self._group_lock:
            return self._group_epoch, 1 + len(self._group_engines()) * self._tp

    @property
    def _tp(self) -> int:
        return self.cfg.rollout.tensor_parallel_size

    def _group_engines(self) -> list[tuple[int, Any]]:
        """(router index, engine) of every engine a new weight group spans (caller holds
        `_group_lock`)."""
        from agentrl.engine.router import EngineRouter

        if not isinstance(self.engine, EngineRouter):
            return [(0, self.engine)]
        router = self.engine
        return sorted([(i, e) for i, e in enumerate(router.engines) if router.alive[i]]
                      + list(self._joining.items()), key=lambda ie: ie[0])

    def weight_transfer(self, step: str, *args: Any) -> None:
        """One step of a broadcast weight update that the trainer's rank 0 drives into every
        engine at once (trainers/weight_sync.py; the steps:
        agentrl.engine.weight_broadcast.RECEIVER_STEPS; `FanOut` gives each engine its ranks).
        Engines restarted since the group opened join it and go back to the router once an
        update has reached them."""
        import functools

        from agentrl.engine.weight_broadcast import FanOut, receive_step

        if step == "init_weight_transfer":
            with self._group_lock:
                self._members = self._group_engines()
            calls = [e.weight_transfer if isinstance(e, RemoteEngine)
                     else functools.partial(receive_step, e) for _, e in self._members]
            self._fan = FanOut(calls, [self._tp] * len(calls))
        if self._fan is None:
            raise RuntimeError(f"{step} before init_weight_transfer")
        self._fan(step, *args)
        if step == "finish_weight_transfer":
            with self._group_lock:
                joined = {i: e for i, e in self._members if self._joining.get(i) is e}
                for i in joined:
                    del self._joining[i]
            for i, engine in joined.items():
                self.engine.readmit(i, engine)

    def evaluate(self) -> dict[str, Any]:
        return evaluate_engine(self.engine, self.cfg, self.tokenizer)

    def version(self) -> int:
        return int(self.engine.version)

    def engine_stats(self) -> dict[str, Any]:
        """The router's counts (calls per engine), or {} with one engine."""
        stats = getattr(self.engine, "stats", None)
        return stats() if callable(stats) else {}

    def named_weights(self) -> dict[str, torch.Tensor]:
        if self.model is None:
            raise ValueError("the vllm engine keeps its weights in its own processes")
        return {k: v.detach().clone() for k, v in self.model.state_dict().items()}

    def node(self) -> str:
        """The Ray node this worker runs on."""
        from trainers.ray_utils import current_node

        return current_node()

    def close(self) -> None:
        """Stop the engine (vLLM's engine process with it) before the actor goes away."""
        self.engine.close()
