"""`agentrl eval`: pass@1 and pass@k of a model on an environment's eval split.

    agentrl eval --env math-tir --model smollm2-135m-instruct --num-problems 32 -k 4 \\
        --temperature 1.0 --out eval.jsonl

Problem i of the split is episode i's reset option `{"index": i}` (envs without problem
indices ignore it and differ by seed). Each problem gets n samples (default n = k), and
pass@k is the unbiased estimator of Chen et al. 2021 ("Evaluating Large Language Models
Trained on Code", eq. 1): 1 - C(n-c, k) / C(n, k), averaged over problems.

A trajectory is solved if `info["correct"]` is True, or, for envs that do not set that key,
if its total reward is >= 1 (so shaping bonuses cannot pass for solves in the math envs).
Discarded trajectories (`Trajectory.discard`: the env or its sandbox failed, e.g. math-tir's
`sandbox_error`) are infrastructure failures: they are excluded from the estimates and counted
separately; a problem left with no samples is dropped.

`evaluate(...)` is the reusable part (the trainer calls it for its before/after evals).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import tyro

from agentrl.command_line import (
    EpisodeOptions,
    check_positive,
    parse_flags,
    validation_deferred,
)
from agentrl.completion import SamplingParams
from agentrl.models import DEFAULT_MODEL
from agentrl.models.named import check_engine_loads
from agentrl.segments import by_episode
from agentrl.types import Trajectory

if TYPE_CHECKING:
    import gymnasium as gym

    from agentrl.engine import Engine

logger = logging.getLogger(__name__)


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples with c correct (Chen et al. 2021), for k <= n.

    Computed as 1 - prod_{i=n-c+1}^{n} (1 - k/i), which avoids huge binomials.
    """
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass_at_k needs 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}")
    if n - c < k:
        return 1.0
    prob_all_fail = 1.0
    for i in range(n - c + 1, n + 1):
        prob_all_fail *= 1.0 - k / i
    return 1.0 - prob_all_fail


def is_solved(traj: Trajectory) -> bool:
    """`info["correct"]` when the env reports it, else total reward >= 1."""
    if "correct" in traj.info:
        return bool(traj.info["correct"])
    return traj.total_reward >= 1.0


@dataclass(frozen=True, kw_only=True)
class EvalResult:
    """Metrics of one evaluation, and the trajectories they came from."""

    pass_at_1: float
    pass_at_k: float
    k: int
    num_problems: int
    """Problems in the estimates (those with at least one scorable sample)."""
    num_samples: int
    """Scorable episodes (discarded ones excluded; an episode in segments counts once)."""
    num_discarded: int
    """Episodes marked `discard` (env or sandbox failures), excluded."""
    num_env_errors: int
    """Scored episodes with `info["error"]` (scored as unsolved)."""
    mean_return: float = 0.0
    """Mean total reward of the scorable trajectories (partial credit: e.g. the fraction of
    targets hit, where pass@1 counts only episodes solved outright)."""
    trajectories: list[Trajectory] = field(repr=False)
    per_problem: list[tuple[int, int]] = field(repr=False)
    """(samples, solved) per problem in the estimates."""
    problem_indices: list[int] = field(default_factory=list, repr=False)
    """The problem index (`info["prompt_index"]`) of each `per_problem` entry."""

    @property
    def pass_at_1_interval(self) -> tuple[float, float]:
        """95% interval for pass@1: Wilson's, over problems (the samples of one problem are not
        independent, so problems are the unit). See `wilson_interval`."""
        return wilson_interval(self.pass_at_1, len(self.per_problem))

    def rates(self) -> dict[int, float]:
        """Solve rate (pass@1) of each problem, by problem index."""
        return {i: c / n for i, (n, c) in zip(self.problem_indices, self.per_problem, strict=True)}

    def summary(self) -> str:
        extra = ""
        if self.num_discarded:
            extra += f", {self.num_discarded} discarded (env or sandbox failures) excluded"
        if self.num_env_errors:
            extra += f", {self.num_env_errors} env errors"
        return (
            f"pass@1 {self.pass_at_1:.4f} {format_interval(self.pass_at_1_interval, 4)} (95%)  "
            f"pass@{self.k} "
            f"{self.pass_at_k:.4f}  mean return {self.mean_return:.4f}  on "
            f"{self.num_problems} problems ({self.num_samples} samples{extra})"
        )


def wilson_interval(rate: float, n: int, z: float = 1.96) -> tuple[float, float]:
    """Wilson's score interval (z = 1.96: 95%) for a success rate measured on `n` units:

        (p + z^2/2n -+ z sqrt(p(1-p)/n + z^2/4n^2)) / (1 + z^2/n)

    Unlike the normal approximation p -+ z sqrt(p(1-p)/n) it stays inside [0, 1] and does not
    shrink to a point at p = 0 or 1 (0 of 64 gives [0, 0.057], not "0 +- 0"). With several
    samples per problem, `rate` is the mean of the problems' rates and `n` the problems: a mean
    of n values in [0, 1] varies at most as much as a proportion of n, so the interval is, if
    anything, wide. (0, 1) for n = 0."""
    if n <= 0:
        return 0.0, 1.0
    if not 0.0 <= rate <= 1.0:
        raise ValueError(f"wilson_interval: rate={rate} is not in [0, 1]")
    z2 = z * z
    centre = (rate + z2 / (2 * n)) / (1 + z2 / n)
    half = z * (rate * (1 - rate) / n + z2 / (4 * n * n)) ** 0.5 / (1 + z2 / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def format_interval(bounds: tuple[float, float], digits: int = 3) -> str:
    """`[low, high]`, as evaluation lines print an interval."""
    return f"[{bounds[0]:.{digits}f}, {bounds[1]:.{digits}f}]"


def ci95(values: Sequence[float]) -> float:
    """Half-width of the normal-approximation 95% interval of the mean of `values` (the
    problems' before/after differences of `paired_change`, which may be negative: no rate for
    Wilson's interval); 0 for fewer than two."""
    n = len(values)
    if n < 2:
        return 0.0
    mean = sum(values) / n
    var = sum((v - mean) ** 2 for v in values) / (n - 1)
    return 1.96 * (var / n) ** 0.5


def paired_change(before: dict[int, float], after: dict[int, float]) -> tuple[float, float, int]:
    """(mean change of pass@1, its 95% half-width, problems) over the problems both evals
    scored, from the per-problem differences: the same problems before and after, so the
    interval is narrower than either eval's own."""
    common = sorted(before.keys() & after.keys())
    diffs = [after[i] - before[i] for i in common]
    return (sum(diffs) / len(diffs) if diffs else 0.0), ci95(diffs), len(common)


def score(trajectories: Sequence[Trajectory], k: int) -> EvalResult:
    """Group episodes by `info["prompt_index"]` and compute pass@1 and pass@k. An episode in
    segments (`agentrl.segments`) is one sample: its reward is their sum, its info its last's,
    discarded if any of them is."""
    groups: dict[int, list[bool]] = {}
    discarded = env_errors = 0
    returns: list[float] = []
    for segments in by_episode(trajectories):
        traj = _whole(segments)
        index = int(traj.info.get("prompt_index", len(groups)))
        if traj.discard:
            discarded += 1
            groups.setdefault(index, [])
            continue
        env_errors += "error" in traj.info
        returns.append(traj.total_reward)
        groups.setdefault(index, []).append(is_solved(traj))
    scored = [(i, v) for i, v in sorted(groups.items()) if v]
    per_problem = [(len(v), sum(v)) for _, v in scored]
    p1 = [c / n for n, c in per_problem]
    # A problem that lost samples to discards and has fewer than k left: pass@n.
    pk = [pass_at_k(n, c, min(k, n)) for n, c in per_problem]
    return EvalResult(
        pass_at_1=sum(p1) / len(p1) if p1 else 0.0,
        pass_at_k=sum(pk) / len(pk) if pk else 0.0,
        k=k,
        num_problems=len(per_problem),
        num_samples=sum(n for n, _ in per_problem),
        num_discarded=discarded,
        num_env_errors=env_errors,
        mean_return=sum(returns) / len(returns) if returns else 0.0,
        trajectories=list(trajectories),
        per_problem=per_problem,
        problem_indices=[i for i, _ in scored],
    )


def score_by_task(trajectories: Sequence[Trajectory], k: int) -> dict[str, EvalResult]:
    """`score` of each task's episodes, for envs that name an episode's task in
    `info["task"]` (MiniWoB-v0); {} when none does. Discarded episodes count with their task
    where they name it."""
    tasks: dict[str, list[Trajectory]] = {}
    for segments in by_episode(trajectories):
        task = segments[-1].info.get("task")
        if task is not None:
            tasks.setdefault(str(task), []).extend(segments)
    return {task: score(trajs, k) for task, trajs in sorted(tasks.items())}


def task_lines(by_task: dict[str, EvalResult]) -> list[str]:
    """One line per task: pass@1 with its 95% Wilson interval over the task's problems."""
    width = max((len(t) for t in by_task), default=0)
    return [f"  {task:<{width}}  pass@1 {r.pass_at_1:.3f} {format_interval(r.pass_at_1_interval)}"
            f" (95%) on {r.num_problems} problems"
            + (f", {r.num_discarded} discarded" if r.num_discarded else "")
            for task, r in by_task.items()]


def _whole(segments: list[Trajectory]) -> Trajectory:
    """An episode's segments as one trajectory for scoring: the last one's, with every
    segment's turns' rewards (its tokens are not the episode's; only rewards and info count)."""
    if len(segments) == 1:
        return segments[0]
    last = segments[-1]
    return dataclasses.replace(last, turns=[t for s in segments for t in s.turns],
                               discard=any(s.discard for s in segments))


def evaluate(
    engine: Engine,
    env_fn: Callable[[], gym.Env],
    *,
    num_problems: int,
    k: int = 1,
    sampling: SamplingParams,
    n_samples: int | None = None,
    max_turns: int | None = None,
    max_episode_tokens: int | None = None,
    max_concurrency: int = 64,
    progress: bool = False,
    group_prefix: str = "eval-",
    env_timeout_s: float | None = None,
) -> EvalResult:
    """Run problems 0..num_problems-1 of the env's split, n_samples each (default k).

    `env_fn` should build the eval split, e.g.
    `lambda: gym.make("agentrl/MathTIR-v0", tokenizer=tok, split="eval")`. With greedy
    sampling every sample is the same, so one is drawn and pass@k = pass@1. `max_turns`,
    `max_episode_tokens` and `env_timeout_s` (an env call's deadline) are what `collect`
    enforces; an episode past a budget or a deadline counts as failed.
    """
    from agentrl.rollout import collect_sync

    n = k if n_samples is None else n_samples
    if num_problems < 1 or k < 1 or n < k:
        raise ValueError(
            f"evaluate needs num_problems >= 1 and 1 <= k <= n_samples; got num_problems="
            f"{num_problems}, k={k}, n_samples={n}"
        )
    if sampling.greedy and n > 1:
        logger.warning("greedy sampling: drawing 1 sample per problem (pass@%d = pass@1)", k)
        n = 1
    trajs = collect_sync(
        engine,
        env_fn,
        num_prompts=num_problems,
        n_samples_per_prompt=n,
        sampling=sampling,
        seeds=list(range(num_problems)),
        reset_options=[{"index": i} for i in range(num_problems)],
        max_turns=max_turns,
        max_episode_tokens=max_episode_tokens,
        max_concurrency=max_concurrency,
        env_timeout_s=env_timeout_s,
        progress=progress,
        group_prefix=group_prefix,
    )
    return score(trajs, k)


@dataclass(frozen=True, kw_only=True)
class EvalArgs(EpisodeOptions):
    """Evaluate a model on an environment: pass@1 and pass@k over its eval split."""

    env: str = "math-tir"
    """Environment id or alias (`agentrl envs` lists them)."""
    model: str = DEFAULT_MODEL
    """Model name (smollm2-135m-instruct, tiny) or a local Hugging Face model directory."""
    split: str = "eval"
    """Split of the env's problems (math envs: train | eval)."""
    num_problems: int = 32
    """Problems 0..N-1 of the split."""
    k: Annotated[int, tyro.conf.arg(aliases=("-k",))] = 1
    """The k of pass@k."""
    samples: Annotated[int | None, tyro.conf.arg(aliases=("-n",))] = None
    """Samples per problem (default k; k <= n)."""
    temperature: float = 0.0
    """Sampling temperature (0 = greedy: one sample per problem)."""
    max_episode_tokens: int | None = 2048
    """Most tokens per episode (prompt, actions, observations); the episode ends truncated."""
    seed: int = 0
    """Sampling seed (a rerun gives the same samples)."""
    env_kwargs: str = "{}"
    """The env's constructor arguments as JSON: its own options, e.g. math-tir's
    '{"tasks": "gsm_symbolic", "difficulty": "medium", "max_turns": 3}' or
    '{"data_path": "problems.jsonl"}' (`help(gym.spec(ID).kwargs["target"])` lists them)."""
    task: str | None = None
    """The env's `task` argument, for envs that take one: MiniWoB-v0's --task
    click-button,enter-text (a task, a suite or a comma list). Success is then also reported
    per task."""
    out: Path | None = None
    """Write the trajectories here as JSON lines."""

    def __post_init__(self) -> None:
        if validation_deferred():
            return
        EpisodeOptions.__post_init__(self)
        check_positive(self, "num_problems", "k")
        check_engine_loads(self.engine, self.model, engine_flag="--engine", model_flag="--model")
        if self.samples is not None and self.samples < self.k:
            raise ValueError(f"-n/--samples ({self.samples}) must be >= -k ({self.k})")


def env_kwargs_for(args: EvalArgs, env_id: str) -> dict[str, Any]:
    """Constructor arguments for `env_id`: split and data options only if it takes them."""
    return env_arguments(env_id, args.env_kwargs, task=args.task, split=args.split,
                         max_turns=args.max_turns)


def env_arguments(env_id: str, env_kwargs: str, *, task: str | None = None,
                  split: str | None = None, max_turns: int | None = None) -> dict[str, Any]:
    """An env's constructor arguments from the --env_kwargs JSON, --task, a split (passed
    only if the env takes one) and --max_turns (`with_turn_budget`); a ValueError naming the
    flag for what the env cannot take."""
    from agentrl.envs.registry import with_turn_budget

    try:
        extra = json.loads(env_kwargs)
    except json.JSONDecodeError as e:
        raise ValueError(f"--env-kwargs must be a JSON object: {e}") from e
    if not isinstance(extra, dict):
        raise ValueError(  # noqa: TRY004 - a bad flag value
            f"--env-kwargs must be a JSON object, got {env_kwargs!r}"
        )
    accepted = _constructor_params(env_id)
    if task is not None:
        if accepted is not None and "task" not in accepted:
            raise ValueError(f"--task {task!r}: {env_id} takes no task argument (its arguments: "
                             f"{', '.join(sorted(accepted - {'self'})) or 'none'}); use "
                             f"--env_kwargs for its own options")
        if extra.get("task", task) != task:
            raise ValueError(f"--task {task!r} and --env_kwargs' task {extra['task']!r} "
                             f"differ: give one")
        extra["task"] = task
    takes_split = split is not None and (accepted is None or "split" in accepted)
    return with_turn_budget(env_id, {**({"split": split} if takes_split else {}), **extra},
                            max_turns)


def preflight_env(env: str, env_id: str, kwargs: dict[str, Any]) -> None:
    """The env class's `preflight(**kwargs)`, if it has one: the checks of building it that
    start nothing (MiniWoB: Chromium and its driver installed, the task names), so that what
    is missing is one line (a ValueError naming --env) before a model loads."""
    from agentrl.envs.registry import env_factory

    preflight = getattr(env_factory(env_id), "preflight", None)
    if callable(preflight):
        try:
            preflight(**kwargs)
        except (RuntimeError, ValueError) as e:
            raise ValueError(f"--env {env}: {e}") from None


def _constructor_params(env_id: str) -> set[str] | None:
    import inspect

    from agentrl.envs.registry import env_factory

    target = env_factory(env_id)
    if target is None:  # not registered through agentrl
        return None
    try:
        params = inspect.signature(target).parameters
    except (TypeError, ValueError):
        return None
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return None
    return set(params)


def main(argv: list[str]) -> int:
    try:
        if section := next((a for a in argv if a.startswith("--data.")), None):
            # tyro's refusal of a dotted flag suggests nothing; eval has no sections.
            raise ValueError(f"{section.partition('=')[0]} is not a flag of eval: an env's own "
                             """options go in --env_kwargs, e.g. --env_kwargs '{"tasks": ...}'""")
        args = parse_flags(EvalArgs, argv, prog="agentrl eval", doc=__doc__,
                           renamed={"--max_tokens": "--max_new_tokens"})
    except ValueError as e:
        print(f"agentrl eval: {e}", file=sys.stderr)
        return 2
    return run(args)


def run(args: EvalArgs) -> int:
    import gymnasium as gym

    import agentrl  # noqa: F401 - registers the built-in env ids
    from agentrl.envs import resolve_env_id
    from agentrl.models import load_tokenizer
    from agentrl.trajectory_files import save_jsonl

    try:
        env_id = resolve_env_id(args.env)
        kwargs = env_kwargs_for(args, env_id)
        preflight_env(args.env, env_id, kwargs)
        tokenizer = load_tokenizer(args.model)
        gym.make(env_id, tokenizer=tokenizer, **kwargs).close()  # fail fast on bad options
        engine = args.open_engine(args.model, tokenizer)
    except ValueError as e:
        print(f"agentrl eval: {e}", file=sys.stderr)
        return 2
    sampling = args.sampling()
    with contextlib.closing(engine):
        result = evaluate(
            engine, lambda: gym.make(env_id, tokenizer=tokenizer, **kwargs),
            num_problems=args.num_problems, k=args.k, sampling=sampling,
            n_samples=args.samples, max_turns=args.max_turns,
            max_episode_tokens=args.max_episode_tokens,
            max_concurrency=args.max_batch_size, progress=args.progress,
        )
    print(f"{env_id} ({args.split}) with {args.model}, temperature {args.temperature}: "
          f"{result.summary()}")
    by_task = score_by_task(result.trajectories, args.k)
    if args.task is not None or len(by_task) > 1:
        print("per task (95% Wilson intervals over each task's problems):")
        print("\n".join(task_lines(by_task)))
    if args.out is not None:
        save_jsonl(result.trajectories, args.out)
        print(f"wrote {len(result.trajectories)} trajectories to {args.out}")
    return 0
