"""Math environments graded with math-verify: tool-integrated (`MathTIREnv`) and single-turn
(`MathEnv`).

`MathTIREnv` (agentrl/MathTIR-v0, CLI `math-tir`): the policy writes Python (a Hermes tool
call or a ```python block), the env runs it in a per-episode sandbox session and answers with
the output (control and bidi characters written as escapes, `agentrl.terminal_safe`); the
episode ends at a `\\boxed{}` answer (terminated) or after `max_turns` policy turns
(truncated). `max_turns` is a rule of this task: the last turn must answer, and code written in
it is not run (its output could never be read). The run's budgets (turns and tokens,
`agentrl.rollout.collect(max_turns=, max_episode_tokens=)`, `--rollout.max_turns`) are
enforced by the rollout loop on top of it; whichever runs out first ends the episode.

Reward (final step): 1.0 if the boxed answer is equivalent to the reference (math-verify:
`\\frac{1}{2}` = `0.5`), else 0.0; plus `format_reward` for any parseable boxed answer and
`call_reward` per code call that ran without error (both 0 by default).

info (every step; the last one ends up in `Trajectory.info`):
- `correct` (bool): the final answer was right. Use this, not the reward, to count solves
  when shaping is on.
- `answer` (str | None), `gold` (str), `grade_error` (why an answer could not be compared).
- `problem_index`, `problem_id`, `source`, `split`: which problem this episode was.
- `num_calls`, `call_statuses`: code executions so far and their sandbox statuses.
- `sandbox_error` (bool): the sandbox itself failed. The episode ends (truncated, reward 0)
  with `discard` set, so trainers and evaluators drop it instead of counting a wrong answer.
- `truncated_by`: "max_turns" | "sandbox_error" when the env ended the episode early (the
  rollout loop sets "max_turns" | "max_episode_tokens" when a run budget ends it).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from agentrl.envs import ChatEnv
from agentrl.envs.chat import StepResult
from agentrl.terminal_safe import visible
from environments.math_tir import protocol
from environments.math_tir.data import (
    DEFAULT_EVAL_FRACTION,
    Problem,
    generate_problems,
    load_problems,
)
from environments.math_tir.grading import Grade, extract_boxed, grade, parse_gold
from environments.math_tir.prompts import (
    MATH_SYSTEM_PROMPT,
    NO_ACTION_HINT,
    PYTHON_TOOL,
    TIR_EXAMPLE,
    TIR_SYSTEM_PROMPT,
)

if TYPE_CHECKING:
    from agentrl.sandbox import ExecResult, SandboxConfig

logger = logging.getLogger(__name__)

Message = dict[str, Any]
DEFAULT_NUM_PROBLEMS = {"train": 2000, "eval": 200}


class SessionLike(Protocol):
    def run(self, code: str, timeout_s: float | None = None) -> ExecResult: ...
    def close(self) -> None: ...


class SandboxLike(Protocol):
    """What the env needs of `agentrl.sandbox.Sandbox` (tests pass fakes)."""

    def session(self) -> SessionLike: ...


@functools.lru_cache(maxsize=8)
def shared_sandbox(config: SandboxConfig, allow_unisolated: bool) -> SandboxLike:
    """One `Sandbox` per config in a process, shared by all envs: its concurrency bound then
    holds across the dozens of envs a rollout builds."""
    from agentrl.sandbox import Sandbox

    return Sandbox(config, allow_unisolated=allow_unisolated)


class _MathEnvBase(ChatEnv):
    """Problem loading, problem choice at reset, and grading, shared by both math envs."""

    def __init__(
        self,
        *,
        split: str,
        tasks: str | Sequence[str] | Mapping[str, float],
        difficulty: str | Sequence[str] | Mapping[str, float],
        num_problems: int | None,
        seed: int,
        data_path: str | Path | None,
        question_key: str,
        answer_key: str,
        task_options: Mapping[str, Mapping[str, object]] | None,
        eval_fraction: float,
        system_prompt: str | None,
        examples: Sequence[Message] | None,
        format_reward: float,
    ) -> None:
        if data_path is not None:
            self.problems = load_problems(
                data_path, split=split, num_problems=num_problems, question_key=question_key,
                answer_key=answer_key, eval_fraction=eval_fraction,
            )
        else:
            self.problems = generate_problems(
                tasks, split=split, num_problems=num_problems or DEFAULT_NUM_PROBLEMS[split],
                difficulty=difficulty, seed=seed, task_options=task_options,
                eval_fraction=eval_fraction,
            )
        if not self.problems:
            raise ValueError(f"no problems in split {split!r}; widen the task or data")
        self.split = split
        self.system_prompt = system_prompt
        self.examples = [dict(m) for m in examples or ()]
        self.format_reward = float(format_reward)
        self.problem: Problem = self.problems[0]
        self.problem_index = 0
        self._gold: list[object] = []

    def __len__(self) -> int:
        return len(self.problems)

    def _choose(self, seed: int | None, options: dict[str, Any] | None) -> list[Message]:
        if seed is not None or getattr(self, "np_random", None) is None:
            # The token bridge seeds np_random the same way; this covers direct use.
            self.np_random = np.random.default_rng(seed)
        index = (options or {}).get("index")
        if index is None:
            index = int(self.np_random.integers(len(self.problems)))
        elif not isinstance(index, int | np.integer) or not 0 <= index < len(self.problems):
            raise ValueError(
                f"reset option index={index!r} is out of range: split {self.split!r} has "
                f"{len(self.problems)} problems (0..{len(self.problems) - 1})"
            )
        self.problem_index, self.problem = int(index), self.problems[int(index)]
        self._gold = parse_gold(self.problem.answer)
        messages: list[Message] = []
        if self.system_prompt:
            messages.append({"role": "system", "content": self.system_prompt})
        messages.extend(dict(m) for m in self.examples)
        messages.append({"role": "user", "content": self.problem.question})
        return messages

    def _base_info(self) -> dict[str, Any]:
        p = self.problem
        return {
            "correct": False, "answer": None, "gold": p.answer, "grade_error": None,
            "problem_index": self.problem_index, "problem_id": p.uid, "source": p.source,
            "split": self.split, "sandbox_error": False,
        }

    def _grade(self, text: str, info: dict[str, Any]) -> float:
        result: Grade = grade(text, self._gold)
        info.update(correct=result.correct, answer=result.answer, grade_error=result.error)
        reward = 1.0 if result.correct else 0.0
        if result.answer is not None and result.error is None:
            reward += self.format_reward
        return reward


class MathTIREnv(_MathEnvBase):
    """Tool-integrated math: write Python, see its output, answer in \\boxed{} (see module doc).

    Args:
        split: "train" or "eval" (disjoint by problem identity).
        tasks: reasoning-gym task(s): "basic_arithmetic", "gsm_symbolic", a comma list, or
            {name: weight}. Ignored when `data_path` is given.
        difficulty: "easy" | "medium" | "hard" presets for the tuned tasks (see data.py), or
            a mix: "easy,medium" or {"easy": 1, "medium": 3} (shares of the problems).
        num_problems: size of the split (default 2000 train / 200 eval; all rows of a file).
        seed: generation seed of reasoning-gym problems (not the episode seed).
        data_path: .jsonl/.json/.parquet file or local `datasets` directory instead.
        question_key, answer_key: column names in `data_path`.
        task_options: per-task reasoning-gym config overrides, {name: {option: value}}.
        eval_fraction: share of problem identities that belong to "eval".
        max_turns: the task's turn limit: the episode is truncated after this many policy
            turns, and code in the last one is not run. A rule of this env, on top of the
            run's budgets, which the rollout loop enforces.
        system_prompt: explains the protocol; None or "" uses the template's default.
        examples: chat turns shown before the problem (default: one worked exchange,
            code -> "Output: 24" -> \\boxed{24}); None or () for none.
        expose_tools: expose the python tool schema (`tools`) to the chat template. A
            template that ignores tools (SmolLM2's) is not given them in the system message
            (`fold_tools = False`): the system prompt teaches the tool itself.
        max_output_chars: observation size cap per call (head and tail are kept).
        max_calls_per_turn: code calls run per turn; extra ones are reported, not run.
        format_reward: added for a parseable boxed answer, right or wrong.
        call_reward: added per code call that ran with status "ok".
        sandbox_config: `agentrl.sandbox.SandboxConfig` (or a dict of its fields) for the
            per-call limits; default 5 s wall time and 512 MB per call.
        allow_unisolated: run code without bubblewrap isolation if it is unavailable (unsafe;
            otherwise construction fails with the sandbox's instructions).
        sandbox: a prebuilt sandbox (default: one shared per `sandbox_config` in the process).
    """

    fold_tools = False  # the system prompt explains the python tool (see expose_tools)

    def __init__(
        self,
        *,
        split: str = "train",
        tasks: str | Sequence[str] | Mapping[str, float] = "basic_arithmetic",
        difficulty: str | Sequence[str] | Mapping[str, float] = "easy",
        num_problems: int | None = None,
        seed: int = 0,
        data_path: str | Path | None = None,
        question_key: str = "question",
        answer_key: str = "answer",
        task_options: Mapping[str, Mapping[str, object]] | None = None,
        eval_fraction: float = DEFAULT_EVAL_FRACTION,
        max_turns: int = 4,
        system_prompt: str | None = TIR_SYSTEM_PROMPT,
        examples: Sequence[Message] | None = TIR_EXAMPLE,
        expose_tools: bool = True,
        max_output_chars: int = 1024,
        max_calls_per_turn: int = 4,
        format_reward: float = 0.0,
        call_reward: float = 0.0,
        sandbox_config: SandboxConfig | Mapping[str, Any] | None = None,
        allow_unisolated: bool = False,
        sandbox: SandboxLike | None = None,
    ) -> None:
        if max_turns < 1:
            raise ValueError(f"max_turns must be >= 1, got {max_turns}")
        if max_output_chars < 64 or max_calls_per_turn < 1:
            raise ValueError(
                f"need max_output_chars >= 64 and max_calls_per_turn >= 1, got "
                f"{max_output_chars}, {max_calls_per_turn}"
            )
        from agentrl.sandbox import SandboxConfig

        if sandbox_config is None:
            sandbox_config = SandboxConfig(timeout_s=5.0, memory_mb=512)
        elif isinstance(sandbox_config, Mapping):
            sandbox_config = SandboxConfig(**sandbox_config)
        self._own_sandbox = sandbox is None
        if sandbox is None:
            # Fails here, with the sandbox's fix-it message, if isolation is unavailable.
            sandbox = shared_sandbox(sandbox_config, allow_unisolated)
        self._sandbox_args = (sandbox_config, allow_unisolated)
        super().__init__(
            split=split, tasks=tasks, difficulty=difficulty, num_problems=num_problems,
            seed=seed, data_path=data_path, question_key=question_key, answer_key=answer_key,
            task_options=task_options, eval_fraction=eval_fraction,
            system_prompt=system_prompt, examples=examples, format_reward=format_reward,
        )
        self.tools = [PYTHON_TOOL] if expose_tools else None
        self.sandbox = sandbox
        self.max_turns = max_turns
        self.max_output_chars = max_output_chars
        self.max_calls_per_turn = max_calls_per_turn
        self.call_reward = float(call_reward)
        self.timeout_s = float(getattr(sandbox, "config", sandbox_config).timeout_s)
        self._session: SessionLike | None = None
        self._turn = 0
        self._statuses: list[str] = []

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[list[Message], dict[str, Any]]:
        self._close_session()
        self._turn, self._statuses = 0, []
        messages = self._choose(seed, options)
        return messages, self._info()

    def step(self, assistant_text: str) -> StepResult:
        self._turn += 1
        info = self._info()
        prose = protocol.strip_code(assistant_text)
        if extract_boxed(prose) is not None:
            reward = self._grade(prose, info)
            self._close_session()
            return [], reward, True, False, info
        if self._turn >= self.max_turns:
            # Budget spent: code run now could never be answered, so it is not run.
            info["truncated_by"] = "max_turns"
            self._close_session()
            return [], 0.0, False, True, info
        calls = protocol.find_calls(assistant_text)
        reward, outputs = 0.0, []
        for i, call in enumerate(calls):
            if i >= self.max_calls_per_turn:
                outputs.append(f"(call not run: at most {self.max_calls_per_turn} per turn)")
            elif call.code is None:
                outputs.append(call.error or "Error: malformed call.")
            else:
                result = self._run(call.code)
                if result.status == "sandbox_error":
                    # Infrastructure failed, not the policy: end unscored, flagged for dropping.
                    logger.warning("sandbox_error in math-tir episode: %s",
                                   visible(result.stderr[-500:]))
                    info.update(self._info(), sandbox_error=True, truncated_by="sandbox_error",
                                discard=True)
                    self._close_session()
                    return [], 0.0, False, True, info
                reward += self.call_reward if result.status == "ok" else 0.0
                outputs.append(protocol.render_result(
                    result, timeout_s=self.timeout_s, max_chars=self.max_output_chars))
        info.update(self._info())
        new = (protocol.observation(calls, outputs) if calls
               else [{"role": "user", "content": NO_ACTION_HINT}])
        return new, reward, False, False, info

    def _run(self, code: str) -> ExecResult:
        if self._session is None:
            self._session = self.sandbox.session()  # lazily: answer-only episodes start none
        result = self._session.run(code)
        self._statuses.append(result.status)
        return result

    def _info(self) -> dict[str, Any]:
        return {**self._base_info(), "num_calls": len(self._statuses),
                "call_statuses": list(self._statuses)}

    def _close_session(self) -> None:
        session, self._session = self._session, None
        if session is not None:
            session.close()

    def close(self) -> None:
        self._close_session()

    def __getstate__(self) -> dict[str, Any]:
        # A live session (a process) cannot be pickled; the copy opens its own when needed.
        # The shared sandbox holds locks: the copy reattaches to its process's own.
        state = self.__dict__.copy()
        state["_session"] = None
        if self._own_sandbox:
            state["sandbox"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        if self.sandbox is None:
            self.sandbox = shared_sandbox(*self._sandbox_args)


class MathEnv(_MathEnvBase):
    """Single-turn math: answer in \\boxed{}; reward 1 if math-verify finds it equivalent.

    Same data arguments and info fields as `MathTIREnv` (no sandbox, no tool calls).
    """

    def __init__(
        self,
        *,
        split: str = "train",
        tasks: str | Sequence[str] | Mapping[str, float] = "basic_arithmetic",
        difficulty: str | Sequence[str] | Mapping[str, float] = "easy",
        num_problems: int | None = None,
        seed: int = 0,
        data_path: str | Path | None = None,
        question_key: str = "question",
        answer_key: str = "answer",
        task_options: Mapping[str, Mapping[str, object]] | None = None,
        eval_fraction: float = DEFAULT_EVAL_FRACTION,
        system_prompt: str | None = MATH_SYSTEM_PROMPT,
        examples: Sequence[Message] | None = None,
        format_reward: float = 0.0,
    ) -> None:
        super().__init__(
            split=split, tasks=tasks, difficulty=difficulty, num_problems=num_problems,
            seed=seed, data_path=data_path, question_key=question_key, answer_key=answer_key,
            task_options=task_options, eval_fraction=eval_fraction,
            system_prompt=system_prompt, examples=examples, format_reward=format_reward,
        )

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[list[Message], dict[str, Any]]:
        return self._choose(seed, options), self._base_info()

    def step(self, assistant_text: str) -> StepResult:
        info = self._base_info()
        return [], self._grade(assistant_text, info), True, False, info
