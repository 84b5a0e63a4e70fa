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

import functools
import itertools
import json
import logging
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

from agentrl.backends import NonFiniteLossError
from agentrl.seeding import derive_seed
from agentrl.trained_files import save_trained, trained_file_of
from agentrl.trajectory_files import iter_jsonl, save_jsonl
from trainers.checkpoint import (
    best_checkpoint,
    latest_checkpoint,
    load_checkpoint,
    mark_best,
    prune_checkpoints,
    remove_partial,
    rewind_run_files,
    save_checkpoint,
    set_aside_earlier_run,
)
from trainers.config import TrainConfig, check_model
from trainers.metrics import MetricsLogger
from trainers.rl_step import (
    MAX_REFILLS,
    Sampled,
    discard_placeholders,
    informative,
    next_kl_coef,
    refill,
    summarize,
    training_batch,
)
from trainers.workers import (
    Handle,
    PolicyRanks,
    Ready,
    TrainingError,
    start_workers,
    visible_gpus,
    worker_nodes,
)

logger = logging.getLogger(__name__)


class StopRequested(TrainingError):
    """The run was asked to stop (`Trainer.request_stop`, SIGTERM in the CLI); it stopped
    between steps with a checkpoint of the last one."""


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
        self.policy: Handle | PolicyRanks | None = None
        self.rollout: Handle | None = None
        self.weight_sync = "rpc"  # how weights reach a rollout worker (trainers/weight_sync.py)
        self.engine_actors: list[Any] = []  # --rollout.num_engines' extra EngineWorker actors
        self.nodes: dict[str, Any] = {}
        self._stop: str | None = None  # why the run was asked to stop (see request_stop)
        self.on_started: list[Callable[[], None]] = []
        """Called once the workers (and Ray) are up: the CLI installs its SIGTERM handler then,
        after Ray has installed its own."""

    @property
    def _policy(self) -> Handle | PolicyRanks:
        """The policy worker(s), once `run` has started them."""
        if self.policy is None:
            raise RuntimeError("the workers are not started (Trainer.run starts them)")
        return self.policy

    @property
    def _rollout(self) -> Handle:
        """The worker that samples: the rollout actor, or the colocated policy worker."""
        if self.rollout is None:
            raise RuntimeError("no worker samples (not started, or replaying rollouts)")
        return self.rollout

    # ------------------------------------------------------------------ set-up
    def _start_workers(self) -> None:
        from trainers.weight_sync import weight_sync_plan

        gpus = visible_gpus(self.cfg)  # (starting Ray if the run uses it)
        preflight(self.cfg, gpus)
        self.weight_sync = weight_sync_plan(self.cfg, gpus)
        workers = start_workers(self.cfg, self.weight_sync)
        self.policy, self.rollout = workers.policy, workers.rollout
        self.engine_actors = workers.engine_actors
        self.nodes = worker_nodes(workers)
        logger.info("Ray nodes: %s", self.nodes)
        for callback in self.on_started:
            callback()

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
        check_model(cfg)  # as `agentrl train` does: Python callers get the same refusals
        if not cfg.resume and (aside := set_aside_earlier_run(self.run_dir)) is not None:
            logger.warning("%s held an earlier run: moved it to %s (to continue that run "
                           "instead, pass --resume auto)", self.run_dir, aside)
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
            # The scripted episodes are played first: an env without a scripted policy is
            # refused before any eval or update.
            played = self._play_warmup() if cfg.warmup.episodes and self.step == 0 else None
            if cfg.eval_problems and self.step == 0:
                summary["eval_before"] = self._evaluate(log, "eval_before")
            if played is not None:
                summary["warmup"] = self._warm_up(log, *played)
                if cfg.eval_problems and cfg.warmup.evaluate:
                    summary["eval_warmup"] = self._evaluate(log, "eval_warmup")
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

    @property
    def _colocated(self) -> bool:
        """The policy worker samples: the batch stays in it for the step's computation."""
        return self.rollout is not None and self.rollout is self.policy

    @functools.cached_property
    def _tokenizer(self) -> Any:
        """The policy's tokenizer (or processor), loaded once in this process."""
        from agentrl.models import load_tokenizer

        return load_tokenizer(self.cfg.actor.model)

    @functools.cached_property
    def _image_token(self) -> int | None:
        """The policy's image placeholder token (None for a text-only model)."""
        from agentrl.models.vision import vision_processor

        vision = vision_processor(self._tokenizer)
        return vision.image_token_id if vision is not None else None

    def _train_step(self) -> dict[str, Any]:
        t0 = time.perf_counter()
        sampled, t_rollout = self._next_batch()
        rollouts = self.run_dir / "rollouts" / f"step_{self.step + 1:06d}.jsonl"
        if self.cfg.save_rollouts:  # discarded episodes too: nothing sampled is lost
            assert sampled.trajectories is not None
            save_jsonl(sampled.trajectories, rollouts)
        if sampled.num_kept < self.cfg.num_policy_workers:
            return self._bad_step(TrainingError(
                f"{sampled.num_episodes - sampled.num_kept} of {sampled.num_episodes} episodes "
                f"were discarded (their environment or sandbox failed{sampled.discard_error}; "
                f"see info in the step's rollouts file)"))
        try:
            metrics = self._train(sampled)
        except Exception as e:
            # Ray re-raises a worker's exception as an instance of its class too (and keeps it
            # as `.cause`), so this holds for local and remote workers alike.
            cause = getattr(e, "cause", None)
            if not (isinstance(e, NonFiniteLossError) or isinstance(cause, NonFiniteLossError)):
                raise
            return self._bad_step(e)
        if self.cfg.save_rollouts:
            self._save_trained(sampled, rollouts)
        self.step += 1
        self._sync_weights()
        if "kl" in metrics:
            self.kl_coef = next_kl_coef(self.kl_coef, metrics["kl"], self.cfg.algo,
                                        n_steps=sampled.num_kept)
        metrics["discarded"] = float(sampled.num_episodes - sampled.num_kept)
        # How many updates behind the policy the sampled tokens are (0 when on-policy).
        lag = self.step - 1 - sampled.min_version if sampled.min_version is not None else 0
        metrics["policy_lag"] = float(lag)
        metrics.update(
            kl_coef=self.kl_coef, time_rollout=t_rollout, time_step=time.perf_counter() - t0
        )
        tokens = sampled.policy_tokens
        metrics["tokens_per_s"] = tokens / t_rollout if t_rollout > 0 else 0.0
        return metrics

    def _train(self, sampled: Sampled) -> dict[str, Any]:
        """One update on the step's batch; the metrics include the rollout's. Colocated, the
        worker trains on the batch it kept; otherwise the batch is here, on its way to the
        policy ranks, and its episodes are chosen and shaped here."""
        if self._colocated:
            return self._policy.call("train_collected", self.kl_coef)
        assert sampled.trajectories is not None
        trajs, group_ids, rollout = training_batch(
            sampled.trajectories, self.cfg.algo, max_new_tokens=self.cfg.rollout.max_new_tokens)
        metrics = self._policy.call("train", trajs, self.kl_coef, group_ids)
        metrics.update(rollout)
        return metrics

    def _save_trained(self, sampled: Sampled, rollouts: Path) -> None:
        """The trainer's side of the step's rollouts file (`agentrl.trained_files`): each
        policy rank's records of its slice of the batch, in rank order, joined by uid to the
        file's lines (written as sampled, never rewritten)."""
        assert sampled.trajectories is not None
        records = [r for part in self._policy.call_all("trained") for r in part]
        save_trained(trained_file_of(rollouts), sampled.trajectories, records)

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
    def _seeds(self, rounds: int) -> list[list[int]]:
        """The prompt seeds of the next `rounds` rounds, one list a round (not yet used)."""
        n = self.cfg.rollout.prompts_per_step
        return [[derive_seed(self.cfg.seed, "prompt", self.data_pos + r * n + i) for i in range(n)]
                for r in range(rounds)]

    def _use_seeds(self) -> list[int]:
        """The next round's prompt seeds, counted as used."""
        [seeds] = self._seeds(1)
        self.data_pos += len(seeds)
        return seeds

    def _next_batch(self) -> tuple[Sampled, float]:
        t0 = time.perf_counter()
        algo = self.cfg.algo
        if self._colocated:  # sampled, filtered and kept in the worker
            rounds = 1 + (MAX_REFILLS if algo.dynamic_filter != "none" else 0)
            sampled = self._rollout.call("collect_step", self._seeds(rounds), self.step)
            self.data_pos += sampled.rounds * self.cfg.rollout.prompts_per_step
            self._check_filtered(sampled.num_episodes)
            return sampled, time.perf_counter() - t0
        if self._replay is not None:
            batch = list(itertools.islice(self._replay, self.cfg.rollout_batch_size))
            if len(batch) < self.cfg.rollout_batch_size:
                raise TrainingError(f"--replay {self.cfg.replay} ran out of trajectories")
            self.data_pos += self.cfg.rollout.prompts_per_step
        else:
            while len(self.queue) <= self.cfg.rollout.async_depth:
                step = self.step + len(self.queue)
                self.queue.append((step, self._rollout.submit("collect", self._use_seeds(), step)))
            batch = self._rollout.result(self.queue.popleft()[1])
            if algo.dynamic_filter != "none":
                batch = refill(
                    informative(batch, algo.dynamic_filter),
                    lambda: self._rollout.call("collect", self._use_seeds(), self.step),
                    criterion=algo.dynamic_filter, want=self.cfg.rollout_batch_size,
                    group_size=self.cfg.rollout.n_samples_per_prompt)
                self._check_filtered(len(batch))
        discard_placeholders(batch, self._image_token)
        return summarize(batch), time.perf_counter() - t0

    def _play_warmup(self) -> tuple[Any, float]:
        """The warm-up's scripted episodes, saved to run_dir/warmup.jsonl, and the seconds
        they took."""
        from trainers.episodes import warmup_episodes

        t0 = time.perf_counter()
        played = warmup_episodes(self.cfg, self._tokenizer)
        if not played.trajectories:
            raise TrainingError(f"the warm-up's {played.discarded} scripted episodes were all "
                                f"discarded by the env (first: {played.first_error})")
        save_jsonl(played.trajectories, self.run_dir / "warmup.jsonl")
        return played, time.perf_counter() - t0

    def _warm_up(self, log: MetricsLogger, played: Any, t_play: float) -> dict[str, Any]:
        """The supervised warm-up (`--warmup.*`): the policy imitates the scripted episodes;
        the rollout worker gets the new weights."""
        w = self.cfg.warmup
        metrics: dict[str, Any] = self._policy.call("imitate", played.trajectories, w.epochs,
                                                    w.batch_size)
        self._sync_weights()
        metrics.update(time_play=t_play, discarded=float(played.discarded))
        log.log(0, {f"warmup/{k}": v for k, v in metrics.items()})
        logger.warning("warm-up: imitated %d scripted episodes (%d epochs, %d optimizer steps): "
                       "loss %.3f -> %.3f per action token; played in %.0f s, trained in %.0f s",
                       len(played.trajectories), w.epochs, metrics["optimizer_steps"],
                       metrics["loss_first_epoch"], metrics["loss_last_epoch"], t_play,
                       metrics["time_warmup"])
        return metrics

    def _check_filtered(self, kept: int) -> None:
        if kept == 0 and self.cfg.algo.dynamic_filter != "none":
            raise TrainingError(
                "dynamic filtering rejected every group (all rewards equal); use "
                "--algo.dynamic_filter none or an easier/harder task"
            )

    def _sync_weights(self) -> None:
        if self.rollout is None or self.rollout is self.policy:
            return  # replay, or colocated: the engine already samples from the trained module
        if self.weight_sync == "nccl":
            # GPU to GPU: trainer rank 0 broadcasts into the workers of every engine.
            self.policy.call(  # type: ignore[union-attr]
                "broadcast_weights", self.rollout.obj, self.step)
            return
        from trainers.rollout_worker import WEIGHTS_GROUP, weight_buckets

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
        from trainers.episodes import eval_setting

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
        self.queue = deque((s, Ready(t)) for s, t in pending)
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
            (s, Ready([next(it) for _ in range(n)]))
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
