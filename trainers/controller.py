"""The controller: drives rollout -> update -> weight sync -> log -> checkpoint.

Workers are Ray actors by default (`use_ray=False` runs the same classes in this process).
Colocated mode: one `PolicyWorker` that also samples (its engine shares the trained module).
Placed mode: a `PolicyWorker` without an engine plus a `RolloutWorker` that receives the new
weights after every update, in buckets (or, vLLM on GPUs, by NCCL broadcast from the trainer's
rank 0: trainers/weight_sync.py); with `async_depth = K > 0` up to K rollout batches are
sampled ahead of training. An update does not wait for the batch being sampled (partial
rollout): the transformers engine loads the new weights between two decode steps and its
running requests go on with them, each token recording the version that sampled it
(`Turn.version_changes`) and its log-prob under that version (the behaviour log-prob the
off-policy corrections use, `--algo.mismatch_correction`).
"""

from __future__ import annotations

import collections
import functools
import itertools
import json
import logging
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

from agentrl.backends import DISTRIBUTED, NonFiniteLossError
from agentrl.types import Trajectory, dense_group_ids, iter_jsonl, save_jsonl
from trainers.checkpoint import (
    best_checkpoint,
    latest_checkpoint,
    load_checkpoint,
    mark_best,
    prune_checkpoints,
    remove_partial,
    rewind_run_files,
    save_checkpoint,
)
from trainers.config import TrainConfig
from trainers.metrics import MetricsLogger
from trainers.ray_utils import actor_options, free_tcp_address

logger = logging.getLogger(__name__)


class TrainingError(RuntimeError):
    """Training cannot go on; the last checkpoint is intact and named in the message."""


class StopRequested(TrainingError):
    """The run was asked to stop (`Trainer.request_stop`, SIGTERM in the CLI); it stopped
    between steps with a checkpoint of the last one."""


class _Handle:
    """Calls methods on a local object or a Ray actor with one interface."""

    def __init__(self, obj: Any, remote: bool) -> None:
        self.obj, self.remote = obj, remote

    def submit(self, method: str, *args: Any, group: str | None = None) -> Any:
        """Start `method`; on an actor, in its concurrency `group` if one is named."""
        if self.remote:
            call = getattr(self.obj, method)
            return (call.options(concurrency_group=group) if group else call).remote(*args)
        return getattr(self.obj, method)(*args)

    def result(self, future: Any) -> Any:
        if isinstance(future, _Ready):
            return future.value
        if not self.remote:
            return future
        import ray

        try:
            return ray.get(future)
        except ray.exceptions.RayActorError as e:
            raise TrainingError(f"a Ray worker died: {e}") from e

    def call(self, method: str, *args: Any, group: str | None = None) -> Any:
        return self.result(self.submit(method, *args, group=group))


class _Group:
    """Data-parallel policy ranks: every call goes to all of them (collectives inside need
    every rank); `call` gives rank 0's result, `call_all` every rank's. `train` gets each rank
    its slice of the batch, with the slice of the step's group ids (numbered once over the
    whole batch)."""

    remote = True

    def __init__(self, actors: list[Any]) -> None:
        self.actors = actors
        self.obj = actors[0]

    def call(self, method: str, *args: Any) -> Any:
        return self.call_all(method, *args)[0]

    def call_all(self, method: str, *args: Any) -> list[Any]:
        """Every rank's result, in rank order."""
        import ray

        if method == "train":
            trajs, kl_coef, group_ids = args
            # Contiguous, sizes differing by at most one (after discards the batch need not
            # divide evenly); losses use global counts, so the update is the same.
            n, ranks = len(trajs), len(self.actors)
            bounds = [n * i // ranks for i in range(ranks + 1)]
            futures = [
                a.train.remote(trajs[bounds[i] : bounds[i + 1]], kl_coef,
                               group_ids[bounds[i] : bounds[i + 1]])
                for i, a in enumerate(self.actors)
            ]
        else:
            futures = [getattr(a, method).remote(*args) for a in self.actors]
        try:
            return list(ray.get(futures))
        except ray.exceptions.RayActorError as e:
            raise TrainingError(f"a Ray worker died: {e}") from e


class Trainer:
    def __init__(self, cfg: TrainConfig) -> None:
        self.cfg = cfg
        self.run_dir = Path(cfg.run_dir)
        self.step = 0
        self.data_pos = 0
        self.kl_coef = cfg.algo.kl_coef
        self.bad_steps = 0
        self.queue: deque[tuple[int, Any]] = deque()
        self._eval_rates: dict[str, dict[int, float]] = {}  # eval name -> problem -> pass@1
        self._replay = iter_jsonl(cfg.replay) if cfg.replay else None
        self.policy: _Handle | _Group | None = None
        self.rollout: _Handle | None = None
        self.weight_sync = "rpc"  # how weights reach a rollout worker (trainers/weight_sync.py)
        self.nodes: dict[str, Any] = {}
        self._stop: str | None = None  # why the run was asked to stop (see request_stop)
        self.on_started: list[Callable[[], None]] = []
        """Called once the workers (and Ray) are up: the CLI installs its SIGTERM handler then,
        after Ray has installed its own."""

    @property
    def _policy(self) -> _Handle | _Group:
        """The policy worker(s), once `run` has started them."""
        if self.policy is None:
            raise RuntimeError("the workers are not started (Trainer.run starts them)")
        return self.policy

    @property
    def _rollout(self) -> _Handle:
        """The worker that samples: the rollout actor, or the colocated policy worker."""
        if self.rollout is None:
            raise RuntimeError("no worker samples (not started, or replaying rollouts)")
        return self.rollout

    # ------------------------------------------------------------------ set-up
    def _start_workers(self) -> None:
        from trainers.policy import PolicyWorker
        from trainers.sampling import WEIGHTS_GROUP, RolloutWorker
        from trainers.weight_sync import engine_weight_transfer, weight_sync_plan

        cfg = self.cfg
        placed = cfg.rollout.mode == "placed"
        self.engine_actors: list[Any] = []  # --rollout.num_engines' extra EngineWorker actors
        # The policy samples only when colocated and not replaying recorded rollouts ... and for
        # evals, which run on the rollout worker when there is one.
        engine = not placed and (cfg.replay is None or cfg.eval_problems > 0)
        if cfg.use_ray:
            import ray

            from trainers.ray_utils import init_ray

            init_ray(address=cfg.ray.address)
            gpus = int(ray.cluster_resources().get("GPU", 0))
            preflight(cfg, gpus)
            self.weight_sync = weight_sync_plan(cfg, gpus)
            rollout = placed and cfg.replay is None
            policy_opts, rollout_opts = actor_options(cfg, rollout=rollout)
            if cfg.backend in DISTRIBUTED:
                addr = free_tcp_address()
                ranks = [
                    ray.remote(PolicyWorker)
                    .options(**opts)
                    .remote(
                        cfg,
                        with_engine=False,
                        rank=r,
                        world_size=cfg.num_policy_workers,
                        dist_addr=addr,
                    )
                    for r, opts in enumerate(policy_opts)
                ]
                self.policy = _Group(ranks)
            else:
                policy = (
                    ray.remote(PolicyWorker)
                    .options(**policy_opts[0])
                    .remote(cfg, with_engine=engine)
                )
                self.policy = _Handle(policy, True)
            if rollout:
                from trainers.sampling import EngineWorker

                # Engines past the first live in actors of their own; the rollout worker routes
                # between its engine and theirs.
                transfer = engine_weight_transfer(self.weight_sync)
                extra = [ray.remote(EngineWorker).options(**opts).remote(cfg, transfer)
                         for opts in rollout_opts[1:]]
                # A weight update (or broadcast step) runs in its own concurrency group, while an
                # async batch is still being collected: its requests go on with the new weights
                # (partial rollout) instead of the update waiting for the longest of them.
                # (Ray's type stubs lack `concurrency_groups`, which only `ray.remote` takes.)
                remote = ray.remote(concurrency_groups={WEIGHTS_GROUP: 1})  # type: ignore[call-overload]
                worker = remote(RolloutWorker).options(**rollout_opts[0]).remote(
                    cfg, transfer, extra, rollout_opts[1:])
                self.engine_actors = extra
                self.rollout = _Handle(worker, True)
        else:
            import torch

            gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
            preflight(cfg, gpus)
            self.weight_sync = weight_sync_plan(cfg, gpus)
            self.policy = _Handle(PolicyWorker(cfg, with_engine=engine), False)
            if placed and cfg.replay is None:
                self.rollout = _Handle(RolloutWorker(cfg), False)
        if self.rollout is None and cfg.replay is None:
            # Colocated: the policy worker samples too (a single one: distributed backends are
            # placed, which the config checks).
            assert isinstance(self.policy, _Handle)
            self.rollout = self.policy
        self.nodes = self._nodes()
        logger.info("Ray nodes: %s", self.nodes)
        for callback in self.on_started:
            callback()

    def _nodes(self) -> dict[str, Any]:
        """Which Ray node each worker runs on: policy ranks in order, and the rollout worker."""
        policy = self._policy
        ranks = [policy.call("node")] if isinstance(policy, _Handle) else policy.call_all("node")
        out: dict[str, Any] = {"policy": ranks}
        if self.rollout is not None and self.rollout is not policy:
            out["rollout"] = self.rollout.call("node")
        return out

    # ------------------------------------------------------------------ the loop
    def request_stop(self, why: str) -> None:
        """Stop after the step in progress, with a checkpoint (safe from a signal handler: it
        only sets a flag that the loop reads between steps)."""
        self._stop = why

    def _stop_if_asked(self) -> None:
        if self._stop is not None:
            path = self.save()
            raise StopRequested(
                f"stopped by {self._stop} after step {self.step}; checkpoint {path}. Continue "
                f"with --resume auto (same --run_dir)")

    def run(self) -> dict[str, Any]:
        cfg = self.cfg
        self.run_dir.mkdir(parents=True, exist_ok=True)
        cfg.save(self.run_dir / "config.json")
        self._start_workers()
        if cfg.resume:
            self._resume(cfg.resume)
        log = MetricsLogger(
            self.run_dir,
            tensorboard=cfg.tensorboard,
            total_steps=cfg.steps,
            progress=cfg.progress,
            config=json.loads(cfg.to_json()),
        )
        summary: dict[str, Any] = {"run_dir": str(self.run_dir)}
        try:
            if cfg.eval_problems and self.step == 0:
                summary["eval_before"] = self._evaluate(log, "eval_before")
            evaluated = self.step
            while self.step < cfg.steps:
                self._stop_if_asked()
                metrics = self._train_step()
                log.log(self.step, metrics)
                log.progress(self.step, metrics)
                if self.step == cfg.steps:
                    break
                if cfg.eval_every and self.step % cfg.eval_every == 0 and self.step > evaluated:
                    evaluated = self.step  # (a skipped step leaves self.step where it was)
                    self._keep_if_best(self._evaluate(log, "eval"))
                elif cfg.save_every and self.step % cfg.save_every == 0:
                    self.save()
            self._stop_if_asked()
            path = self.save()
            remove_partial(self.run_dir)
            if cfg.eval_problems:
                summary["eval_after"] = self._evaluate(log, "eval_after")
                self._keep_if_best(summary["eval_after"], path)
                if "eval_before" in self._eval_rates:
                    summary["eval_change"] = self._eval_change()
            best = best_checkpoint(self.run_dir) if cfg.keep_best else None
            if best is not None:
                summary["best"] = best[1]
            hf_dir = self.run_dir / "hf"
            self._policy.call("export_hf", str(hf_dir))
            summary["hf_model"] = str(hf_dir)
        finally:
            log.close()
            self.close()
        summary["steps"] = self.step
        summary["nodes"] = self.nodes
        return summary

    def close(self) -> None:
        """Stop the workers' engines (a vLLM engine runs in processes of its own); the workers
        stay usable for `save`/`load` but sample no more."""
        for handle in {id(h): h for h in (self.policy, self.rollout) if h is not None}.values():
            try:
                handle.call("close")
            except Exception as e:  # noqa: BLE001 (the run stands; say what did not stop)
                logger.warning("could not stop a worker's engine: %s", e)

    @functools.cached_property
    def _image_token(self) -> int | None:
        """The policy's image placeholder token (None for a text-only model)."""
        from agentrl.models import load_tokenizer
        from agentrl.models.vision import vision_processor

        vision = vision_processor(load_tokenizer(self.cfg.actor.model))
        return vision.image_token_id if vision is not None else None

    def _discard_sampled_placeholders(self, trajectories: list[Trajectory]) -> None:
        """A vision-language policy that sampled its image placeholder token wrote something no
        model input can hold (the model puts an image wherever that token is): the episode is
        discarded (kept in the rollouts file, counted, not trained on). An env episode that went
        on after it already failed at its next turn; this catches the last turn's, and proxy
        sessions'."""
        token = self._image_token
        if token is None:
            return
        for t in trajectories:
            if not t.discard and any(i == token and m for i, m in zip(t.token_ids, t.loss_mask,
                                                                       strict=True)):
                t.discard = True
                t.info["error"] = ("the policy sampled its image placeholder token; the episode "
                                   "cannot be scored with images and is not trained on")

    def _train_step(self) -> dict[str, Any]:
        t0 = time.perf_counter()
        sampled, t_rollout = self._next_batch()
        self._discard_sampled_placeholders(sampled)
        if self.cfg.save_rollouts:  # discarded episodes too: nothing sampled is lost
            save_jsonl(sampled, self.run_dir / "rollouts" / f"step_{self.step + 1:06d}.jsonl")
        trajs = [t for t in sampled if not t.discard]
        if len(trajs) < self.cfg.num_policy_workers:
            return self._bad_step(TrainingError(
                f"{len(sampled) - len(trajs)} of {len(sampled)} episodes were discarded (their "
                f"environment or sandbox failed{_commonest_error(sampled)}; see info in the "
                f"step's rollouts file)"))
        scored = self._shape_rewards(trajs)
        try:
            metrics = self.policy.call(  # type: ignore[union-attr]
                "train", scored, self.kl_coef, dense_group_ids(scored)
            )
        except Exception as e:
            # Ray re-raises a worker's exception as an instance of its class too (and keeps it
            # as `.cause`), so this holds for local and remote workers alike.
            cause = getattr(e, "cause", None)
            if not (isinstance(e, NonFiniteLossError) or isinstance(cause, NonFiniteLossError)):
                raise
            return self._bad_step(e)
        self.step += 1
        self._sync_weights()
        if self.cfg.algo.kl_target is not None and "kl" in metrics:
            from agentrl.algorithms import adaptive_kl_coef

            self.kl_coef = adaptive_kl_coef(
                self.kl_coef,
                metrics["kl"],
                target=self.cfg.algo.kl_target,
                horizon=self.cfg.algo.kl_horizon,
                n_steps=len(trajs),
            )
        metrics.update(_rollout_metrics(trajs), discarded=float(len(sampled) - len(trajs)))
        versions = [v for t in trajs for v in t.policy_versions]
        # How many updates behind the policy the sampled tokens are (0 when on-policy).
        metrics["policy_lag"] = float(self.step - 1 - min(versions)) if versions else 0.0
        metrics.update(
            kl_coef=self.kl_coef, time_rollout=t_rollout, time_step=time.perf_counter() - t0
        )
        gen = sum(t.num_policy_tokens for t in trajs)
        metrics["tokens_per_s"] = gen / t_rollout if t_rollout > 0 else 0.0
        return metrics

    def _bad_step(self, error: Exception) -> dict[str, Any]:
        self.bad_steps += 1
        logger.warning("skipped step %d: %s", self.step + 1, error)
        if self.bad_steps > self.cfg.max_bad_steps:
            path = self.save()
            raise TrainingError(
                f"{self.bad_steps} steps were skipped (limit --max_bad_steps "
                f"{self.cfg.max_bad_steps}); the last: {error}. Stopped. Last checkpoint: {path}. "
                f"A non-finite loss: lower --actor.lr or check the rewards; discarded episodes: "
                f"check the environment."
            ) from error
        return {"skipped": 1, "bad_steps": self.bad_steps}

    # ------------------------------------------------------------------ rollouts
    def _seeds(self) -> list[int]:
        n = self.cfg.rollout.prompts_per_step
        seeds = [self.cfg.seed * 1_000_003 + self.data_pos + i for i in range(n)]
        self.data_pos += n
        return seeds

    def _next_batch(self) -> tuple[list[Trajectory], float]:
        t0 = time.perf_counter()
        if self._replay is not None:
            batch = list(itertools.islice(self._replay, self.cfg.rollout_batch_size))
            if len(batch) < self.cfg.rollout_batch_size:
                raise TrainingError(f"--replay {self.cfg.replay} ran out of trajectories")
            self.data_pos += self.cfg.rollout.prompts_per_step
            return batch, time.perf_counter() - t0
        depth = self.cfg.rollout.async_depth
        while len(self.queue) <= depth:
            step = self.step + len(self.queue)
            self.queue.append((step, self._rollout.submit("collect", self._seeds(), step)))
        _, future = self.queue.popleft()
        trajs = self._rollout.result(future)
        if self.cfg.algo.dynamic_filter != "none":
            trajs = self._refill(self._filter(trajs))
        return trajs, time.perf_counter() - t0

    def _filter(self, trajs: list[Trajectory]) -> list[Trajectory]:
        """DAPO dynamic filtering: drop groups whose rewards carry no signal (and discarded
        episodes, whose rewards mean nothing)."""
        import torch

        from agentrl.algorithms import dynamic_filter

        trajs = [t for t in trajs if not t.discard]
        if not trajs:
            return []
        keep = dynamic_filter(
            torch.tensor([t.total_reward for t in trajs]),
            torch.tensor(dense_group_ids(trajs)),
            criterion=self.cfg.algo.dynamic_filter,
        )
        return [t for t, k in zip(trajs, keep.tolist(), strict=True) if k]

    def _refill(self, kept: list[Trajectory], max_rounds: int = 4) -> list[Trajectory]:
        """Sample more prompts until the batch is full again (or give up after max_rounds and
        train on the accepted groups: unlike OpenRLHF, accepted groups are never dropped)."""
        want = self.cfg.rollout_batch_size
        for _ in range(max_rounds):
            if len(kept) >= want:
                break
            more = self._rollout.call("collect", self._seeds(), self.step)
            kept += self._filter(more)
        if not kept:
            raise TrainingError(
                "dynamic filtering rejected every group (all rewards equal); use "
                "--algo.dynamic_filter none or an easier/harder task"
            )
        n = self.cfg.rollout.n_samples_per_prompt
        return kept[: max(n, (min(len(kept), want) // n) * n)]

    def _shape_rewards(self, trajs: list[Trajectory]) -> list[Trajectory]:
        """DAPO overlong and ProRL truncation penalties, applied to the last turn's reward before
        any baseline; dynamic filtering is not applied here (see AlgoConfig.dynamic_filter)."""
        algo = self.cfg.algo
        if not algo.overlong_buffer and algo.truncation_penalty is None:
            return trajs
        import torch

        from agentrl.algorithms import overlong_penalty, truncation_penalty

        rewards = torch.tensor([t.turns[-1].reward if t.turns else 0.0 for t in trajs])
        if algo.overlong_buffer:
            lengths = torch.tensor([t.turns[-1].end - t.turns[-1].start for t in trajs])
            rewards = overlong_penalty(
                rewards,
                lengths,
                max_new_tokens=self.cfg.rollout.max_new_tokens,
                buffer=algo.overlong_buffer,
                factor=algo.overlong_factor,
            )
        if algo.truncation_penalty is not None:
            truncated = torch.tensor([t.turns[-1].finish_reason == "length" for t in trajs])
            rewards = truncation_penalty(rewards, truncated, algo.truncation_penalty)
        for t, r in zip(trajs, rewards.tolist(), strict=True):
            if t.turns:
                t.turns[-1].reward = float(r)
        return trajs

    def _sync_weights(self) -> None:
        if self.rollout is None or self.rollout is self.policy:
            return  # replay, or colocated: the engine already samples from the trained module
        if self.weight_sync == "nccl":
            # GPU to GPU: trainer rank 0 broadcasts into the workers of every engine.
            self.policy.call(  # type: ignore[union-attr]
                "broadcast_weights", self.rollout.obj, self.step)
            return
        from trainers.sampling import WEIGHTS_GROUP, weight_buckets

        weights = self._policy.call("named_weights")
        buckets = list(weight_buckets(weights, self.cfg.rollout.weight_sync_bucket_mb))
        for i, bucket in enumerate(buckets):
            self.rollout.call("update_weights", bucket, self.step, i == len(buckets) - 1,
                              group=WEIGHTS_GROUP)

    def _evaluate(self, log: MetricsLogger, name: str) -> dict[str, Any]:
        """A held-out eval, logged as `name`/<metric> at this step; its episodes go to
        run_dir/`name`.jsonl (periodic ones, `name` "eval", to run_dir/evals/step_N.jsonl)."""
        handle = self.rollout or self._policy
        result = handle.call("evaluate")
        out = (self.run_dir / "evals" / f"step_{self.step:06d}.jsonl" if name == "eval"
               else self.run_dir / f"{name}.jsonl")
        save_jsonl(result.pop("trajectories"), out)
        self._eval_rates[name] = {int(i): float(r) for i, r in result.pop("rates").items()}
        log.log(self.step, {f"{name}/{k}": v for k, v in result.items()})
        return result

    def _eval_change(self) -> dict[str, Any]:
        """pass@1 after minus before, on the problems both scored, with its 95% interval."""
        from agentrl.rollout.evaluate import paired_change
        from trainers.sampling import eval_setting

        change, half, n = paired_change(self._eval_rates["eval_before"],
                                        self._eval_rates["eval_after"])
        return {"pass@1": change, "ci95": half, "num_problems": n,
                "setting": eval_setting(self.cfg)}

    def _keep_if_best(self, result: dict[str, Any], path: Path | None = None) -> None:
        """With --keep_best: checkpoint this step (unless `path` already is it) and name it
        best if its eval beats every earlier one (a resumed run compares with the record)."""
        metric = self.cfg.keep_best
        if metric is None:
            return
        path = path or self.save()
        best = best_checkpoint(self.run_dir)
        if best is None or metric not in best[1] or float(result[metric]) > float(best[1][metric]):
            mark_best(self.run_dir, path, metric, float(result[metric]), self.step)
            prune_checkpoints(self.run_dir, self.cfg.keep_last)  # the former best may go now

    # ------------------------------------------------------------------ checkpoints
    def save(self) -> Path:
        # Rollouts already sampled ahead (async) are saved so a resume trains on them too.
        pending = [(s, self._rollout.result(f)) for s, f in self.queue] if self.queue else []
        self.queue = deque((s, _Ready(t)) for s, t in pending)
        state = {
            "step": self.step,
            "data_pos": self.data_pos,
            "kl_coef": self.kl_coef,
            "bad_steps": self.bad_steps,
            "queue_steps": [s for s, _ in pending],
            "queue_sizes": [len(t) for _, t in pending],
        }
        worker_state = self._policy.call("state_dict")
        flat = [traj for _, trajs in pending for traj in trajs]
        return save_checkpoint(self.run_dir, self.step, worker_state, state, flat,
                               keep=self.cfg.keep_last)

    def _resume(self, where: str) -> None:
        path = latest_checkpoint(self.run_dir) if where == "auto" else Path(where)
        if path is None:
            raise ValueError(f"--resume auto: no checkpoint in {self.run_dir / 'checkpoints'}")
        worker_state, state, queue = load_checkpoint(path)
        self._policy.call("load_state_dict", worker_state)
        self.step, self.data_pos = int(state["step"]), int(state["data_pos"])
        for partial in remove_partial(self.run_dir):
            logger.info("removed %s, left by a save that was cut short", partial)
        rewind_run_files(self.run_dir, self.step)
        self.kl_coef, self.bad_steps = float(state["kl_coef"]), int(state["bad_steps"])
        it = iter(queue)
        self.queue = deque(
            (s, _Ready([next(it) for _ in range(n)]))
            for s, n in zip(state["queue_steps"], state["queue_sizes"], strict=True)
        )
        if self._replay is not None:
            for _ in range(self.step * self.cfg.rollout_batch_size):
                next(self._replay, None)
        self._sync_weights()
        logger.info("resumed from %s at step %d", path, self.step)


def preflight(cfg: TrainConfig, gpus: int) -> None:
    """The checks that need to know the machine (`gpus` visible, or in the Ray cluster), run
    before any model loads."""
    device = cfg.actor.device
    if device.startswith("cuda") and gpus == 0:
        raise ValueError(f"--actor.device {device}: no CUDA device is visible (here or in the Ray "
                         f"cluster); use --actor.device cpu, or auto to take a GPU where there is "
                         f"one")
    tp = cfg.rollout.tensor_parallel_size
    cuda = device.startswith("cuda") or (device == "auto" and gpus > 0)
    # On CPUs vLLM's tensor-parallel workers need CPUs of their own: checked where the engine
    # starts (agentrl.engine.open_engine), which knows that machine.
    if cuda and tp > gpus:
        raise ValueError(f"--rollout.tensor_parallel_size {tp} is more than the {gpus} GPUs "
                         f"visible; use at most {gpus}")
    engines = cfg.rollout.num_engines
    if cuda and engines > 1:
        need = cfg.num_policy_workers + engines * tp
        if need > gpus:
            raise ValueError(
                f"--num_policy_workers {cfg.num_policy_workers} + --rollout.num_engines "
                f"{engines} x --rollout.tensor_parallel_size {tp} = {need} GPUs, but {gpus} are "
                f"visible; use at most {max((gpus - cfg.num_policy_workers) // tp, 0)} engines")


def _commonest_error(trajs: list[Trajectory]) -> str:
    """', most often with: <error> (k episodes)' for a message, or '' if none carries one."""
    errors = collections.Counter(str(t.info["error"]) for t in trajs
                                 if t.discard and "error" in t.info)
    if not errors:
        return ""
    error, k = errors.most_common(1)[0]
    return f", most often with: {error[:500]} ({k} episode{'s' if k > 1 else ''})"


class _Ready:
    """A rollout already in hand, standing in the queue where a future would."""

    def __init__(self, value: Any) -> None:
        self.value = value


def _rollout_metrics(trajs: list[Trajectory]) -> dict[str, float]:
    n = max(len(trajs), 1)
    rewards = [t.total_reward for t in trajs]
    mean = sum(rewards) / n
    return {
        "reward": mean,
        "reward_std": (sum((r - mean) ** 2 for r in rewards) / n) ** 0.5,
        "response_tokens": sum(t.num_policy_tokens for t in trajs) / n,
        "turns": sum(len(t.turns) for t in trajs) / n,
        "truncated": sum(t.truncated for t in trajs) / n,
        "drift_events": float(sum(int(t.info.get("drift_events", 0)) for t in trajs)),
        "env_errors": float(sum("error" in t.info for t in trajs)),
    }
