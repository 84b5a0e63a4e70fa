"""`agentrl eval`'s metrics: the unbiased pass@k, scoring rules, and evaluate() end to end
with a scripted engine."""

from __future__ import annotations

import itertools
import re
import threading
from collections import Counter
from math import comb

import gymnasium as gym
import pytest

from agentrl.completion import Completion, SamplingParams
from agentrl.rollout.evaluate import (
    EvalArgs,
    env_arguments,
    env_kwargs_for,
    evaluate,
    pass_at_k,
    score,
)
from agentrl.types import Trajectory, Turn
from environments.math_tir.data import generate_problems


def _brute_pass_at_k(n: int, c: int, k: int) -> float:
    """Fraction of k-subsets of the n samples that contain a correct one."""
    samples = [True] * c + [False] * (n - c)
    subsets = list(itertools.combinations(range(n), k))
    return sum(any(samples[i] for i in s) for s in subsets) / len(subsets)


@pytest.mark.parametrize(("n", "c", "k"), [(1, 0, 1), (1, 1, 1), (4, 1, 1), (4, 1, 2), (5, 2, 3),
                                           (8, 3, 4), (8, 0, 8), (8, 8, 2), (10, 1, 10)])
def test_pass_at_k_matches_brute_force(n, c, k):
    assert pass_at_k(n, c, k) == pytest.approx(_brute_pass_at_k(n, c, k))
    assert pass_at_k(n, c, k) == pytest.approx(1 - comb(n - c, k) / comb(n, k))


def test_pass_at_k_rejects_k_above_n():
    with pytest.raises(ValueError, match="1 <= k <= n"):
        pass_at_k(2, 1, 3)


def _traj(prompt_index: int, reward: float, discard: bool = False, **info) -> Trajectory:
    return Trajectory(token_ids=[1, 2], loss_mask=[0, 1], logprobs=[0.0, 0.0],
                      turns=[Turn(obs_start=0, start=1, end=2, reward=reward)],
                      info={"prompt_index": prompt_index, **info}, discard=discard)


def test_score_rules():
    trajs = [
        _traj(0, 1.0, correct=True), _traj(0, 0.0, correct=False),
        _traj(0, 1.1, correct=False),  # shaping bonus without a correct answer: not solved
        _traj(1, 0.0, True, correct=False), _traj(1, 1.0, correct=True),
        _traj(2, 1.0, True, correct=True),  # only discarded samples: dropped
        _traj(3, 1.0), _traj(3, 0.2),  # no "correct" key: reward >= 1 counts
        _traj(4, 0.0, error="RuntimeError()"),
    ]
    result = score(trajs, k=2)
    assert result.num_problems == 4 and result.num_samples == 7
    assert result.num_discarded == 2 and result.num_env_errors == 1
    assert result.per_problem == [(3, 1), (1, 1), (2, 1), (1, 0)]
    assert result.pass_at_1 == pytest.approx((1 / 3 + 1 + 1 / 2 + 0) / 4)
    # problem 1 has one sample left (< k): it contributes pass@1
    assert result.pass_at_k == pytest.approx((pass_at_k(3, 1, 2) + 1 + 1 + 0) / 4)
    assert "2 discarded (env or sandbox failures) excluded" in result.summary()
    assert result.rates() == {0: pytest.approx(1 / 3), 1: 1.0, 3: 0.5, 4: 0.0}


def test_intervals_count_problems_not_samples():
    """#20 item 2: the 95% interval of pass@1 is over problems (their samples are not
    independent), and the before/after change is paired on the same problems."""
    from agentrl.rollout.evaluate import ci95, paired_change, wilson_interval

    diffs = [1.0, 0.0, 0.5, 0.5]
    sd = (sum((r - 0.5) ** 2 for r in diffs) / 3) ** 0.5
    assert ci95(diffs) == pytest.approx(1.96 * sd / 2) and ci95([0.7]) == 0.0
    trajs = [_traj(i, 1.0, correct=c) for i, c in ((0, True), (0, True), (1, False), (1, False),
                                                  (2, True), (2, False), (3, False), (3, True))]
    result = score(trajs, k=1)
    assert result.pass_at_1 == 0.5
    # 4 problems, not 8 samples: the interval is as wide as 2 of 4, not 4 of 8.
    assert result.pass_at_1_interval == wilson_interval(0.5, 4) != wilson_interval(0.5, 8)
    # Every problem gains exactly 0.5: the paired interval is 0, however spread the rates are.
    before, after = {0: 0.0, 1: 0.5, 2: 0.0, 3: 0.5}, {0: 0.5, 1: 1.0, 2: 0.5, 3: 1.0, 9: 1.0}
    assert paired_change(before, after) == (0.5, 0.0, 4)
    change, half, n = paired_change({0: 0.0, 1: 0.0}, {0: 1.0, 1: 0.0})
    assert (change, n) == (0.5, 2) and half == pytest.approx(1.96 * (0.5 ** 0.5) / 2 ** 0.5)


def test_wilson_interval_matches_its_formula_and_never_collapses_at_the_ends():
    """#35 item 4: held-out intervals are Wilson's, so 0 of 64 does not print "0 +- 0"."""
    from agentrl.rollout.evaluate import format_interval, wilson_interval

    low, high = wilson_interval(0.0, 64)
    assert low == 0.0 and high == pytest.approx(1.96**2 / (64 + 1.96**2))  # 0.0566
    low, high = wilson_interval(1.0, 64)
    assert high == 1.0 and low == pytest.approx(64 / (64 + 1.96**2))
    # 10 of 64, by hand: centre (p + z^2/2n) / (1 + z^2/n), half z sqrt(p q/n + z^2/4n^2) / (..)
    p, n, z = 10 / 64, 64, 1.96
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * (p * (1 - p) / n + z * z / (4 * n * n)) ** 0.5 / (1 + z * z / n)
    assert wilson_interval(p, n) == pytest.approx((centre - half, centre + half))
    assert wilson_interval(p, n) == pytest.approx((0.0871, 0.2643), abs=1e-4)
    assert wilson_interval(0.3, 0) == (0.0, 1.0)
    with pytest.raises(ValueError, match="not in"):
        wilson_interval(1.5, 10)
    assert format_interval((0.08712, 0.264)) == "[0.087, 0.264]"


class ScriptedEngine:
    """Answers "Calculate a op b." problems through the python tool: code first, then the
    boxed output. Per question, only the first `quota(question)` answers are right, so the
    expected per-problem counts are known whatever order the episodes run in."""

    version = 0
    max_context = 4096

    def __init__(self, tokenizer, quota):
        self.tok, self.quota = tokenizer, quota
        self.answers: Counter[str] = Counter()
        self.lock = threading.Lock()

    async def generate(self, prompt_ids, params, images=None):
        text = self.tok.decode(list(prompt_ids), skip_special_tokens=False)
        question = re.findall(r"user\n(Calculate [^<]*)<\|im_end\|>", text)[-1]
        outputs = re.findall(r"Output: (-?\d+)", text)
        if len(outputs) < 2:  # the worked example's "Output: 24" is the first
            expr = question.removeprefix("Calculate ").rstrip(".")
            reply = f"```python\nprint({expr})\n```"
        else:
            with self.lock:
                self.answers[question] += 1
                right = self.answers[question] <= self.quota(question)
            reply = f"\\boxed{{{int(outputs[-1]) + (0 if right else 1)}}}"
        ids = self.tok.encode(reply, add_special_tokens=False)
        ids.append(self.tok.convert_tokens_to_ids("<|im_end|>"))
        return [Completion(token_ids=ids, logprobs=[-0.5] * len(ids), finish_reason="stop")]

    def update_weights(self, named_tensors, version):
        raise NotImplementedError

    def sleep(self):
        pass

    def wake(self):
        pass


def test_evaluate_end_to_end_with_scripted_engine(tiny_tokenizer, sandbox):
    n, k, num = 4, 2, 6
    problems = generate_problems("basic_arithmetic", split="eval", num_problems=num)
    quota = {p.question: i % (n + 1) for i, p in enumerate(problems)}  # 0..4 right of 4
    engine = ScriptedEngine(tiny_tokenizer, lambda q: quota[q])
    result = evaluate(
        engine,
        lambda: gym.make("agentrl/MathTIR-v0", tokenizer=tiny_tokenizer, split="eval",
                         num_problems=num),
        num_problems=num, k=k, sampling=SamplingParams(temperature=1.0, max_tokens=64),
        n_samples=n, max_concurrency=8,
    )
    expected = [(n, min(quota[p.question], n)) for p in problems]
    assert result.per_problem == expected
    assert result.pass_at_1 == pytest.approx(sum(c / n for _, c in expected) / num)
    assert result.pass_at_k == pytest.approx(sum(pass_at_k(n, c, k) for _, c in expected) / num)
    assert result.num_discarded == 0 and len(result.trajectories) == n * num
    traj = result.trajectories[0]
    assert traj.group == "eval-0" and traj.info["num_calls"] == 1 and len(traj.turns) == 2


def test_env_kwargs_for_cli():
    args = EvalArgs(env="math-tir", env_kwargs='{"max_turns": 2}')
    assert env_kwargs_for(args, "agentrl/MathTIR-v0") == {"split": "eval", "max_turns": 2}
    with pytest.raises(ValueError, match="JSON object"):
        env_kwargs_for(EvalArgs(env_kwargs="[1]"), "agentrl/MathTIR-v0")
    # An env without splits gets none.
    assert env_kwargs_for(EvalArgs(env="reverse"), "agentrl/Reverse-v0") == {}


def test_the_turn_budget_reaches_an_env_that_takes_one():
    """--max_turns is enforced by the rollout loop, and an env whose own rule depends on it is
    told it, as `agentrl train` tells it --rollout.max_turns (MiniWoB scores an episode out of
    turns -1; truncated by the loop alone it scored 0)."""
    args = EvalArgs(env="math-tir", max_turns=3)
    assert env_kwargs_for(args, "agentrl/MathTIR-v0") == {"split": "eval", "max_turns": 3}
    # --env_kwargs' own max_turns wins; an env that takes no max_turns gets none.
    args = EvalArgs(env="math-tir", env_kwargs='{"max_turns": 2}', max_turns=3)
    assert env_kwargs_for(args, "agentrl/MathTIR-v0")["max_turns"] == 2
    assert env_kwargs_for(EvalArgs(env="reverse", max_turns=3), "agentrl/Reverse-v0") == {}
    assert env_arguments("agentrl/MiniWoB-v0", "{}", max_turns=2) == {"max_turns": 2}


def test_a_data_flag_is_refused_pointing_at_env_kwargs(capsys):
    """eval has no --data.* flags (an env's options are --env_kwargs): one is refused, exit 2,
    with a line that says where the option goes, before anything loads."""
    from agentrl.rollout.evaluate import main

    for flag in (["--data.tasks", "basic_arithmetic"], ["--data.path=problems.jsonl"]):
        assert main(["--env", "math-tir", *flag]) == 2
        err = capsys.readouterr().err
        assert f"agentrl eval: {flag[0].partition('=')[0]} is not a flag of eval" in err
        assert "--env_kwargs '{\"tasks\": ...}'" in err
