"""A hung env call cannot stall a collection or a training step (#34 item 13): past
`env_timeout_s` its episode is abandoned and discarded with the reason, and the rest go on."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import threading
import time
from pathlib import Path

import pytest

from agentrl.completion import Completion, SamplingParams
from agentrl.envs import ChatEnv, ChatTokenEnv
from agentrl.rollout import collect
from agentrl.rollout.env_calls import abandoned_threads
from environments.toy.digits import DigitsEnv

SAMPLING = SamplingParams(temperature=1.0, max_tokens=8, seed=0)


class Answers:
    """An engine that answers every turn with the same tokens: "12" and the end of turn."""

    def __init__(self, tokenizer) -> None:
        self.ids = [*tokenizer.encode("12", add_special_tokens=False), tokenizer.eos_token_id]

    async def generate(self, prompt_ids, params, images=None):
        return [Completion(token_ids=list(self.ids), logprobs=[0.0] * len(self.ids),
                           finish_reason="stop")]


class StuckEnv(ChatEnv):
    """One turn. Seed 1 blocks in `step` and seed 2 in `reset` until `release` is set; seed 3's
    grader raises its own TimeoutError (an ordinary env error, not a deadline)."""

    def __init__(self, release: threading.Event, calls: list[tuple[int, str]]) -> None:
        self.release, self.calls = release, calls

    def reset(self, *, seed=None, options=None):
        self.seed = seed
        self.calls.append((seed, "reset"))
        if seed == 2:
            self.release.wait()
        return [{"role": "user", "content": "hello"}]

    def step(self, text):
        self.calls.append((self.seed, "step"))
        if self.seed == 1:
            self.release.wait()
        if self.seed == 3:
            raise TimeoutError("grader")
        return [], 1.0, True, False, {}

    def close(self):
        self.calls.append((self.seed, "close"))


async def test_a_hung_env_call_is_abandoned_at_its_deadline(tiny_tokenizer):
    release, calls = threading.Event(), []
    before = abandoned_threads()
    try:
        t0 = time.monotonic()
        trajs = await collect(
            Answers(tiny_tokenizer),
            lambda: ChatTokenEnv(StuckEnv(release, calls), tiny_tokenizer),
            num_prompts=5, sampling=SAMPLING, env_timeout_s=0.5,
        )
        elapsed = time.monotonic() - t0
        assert elapsed < 5.0, elapsed  # never waits for the stuck calls
        stuck_step, stuck_reset, own_timeout = trajs[1], trajs[2], trajs[3]
        for t, call in ((stuck_step, "step"), (stuck_reset, "reset")):
            assert t.discard and t.truncated and not t.terminated
            assert t.info["env_timeout"] == call
            assert t.info["error"].startswith(f"EnvTimeoutError('env {call} did not return "
                                              f"within 0.5 s")
        assert len(stuck_step.turns) == 1 and len(stuck_reset.turns) == 0
        # An env's own TimeoutError is its error, as any other exception.
        assert own_timeout.discard and own_timeout.info["error"] == "TimeoutError('grader')"
        assert "env_timeout" not in own_timeout.info
        for t in (trajs[0], trajs[4]):  # the others completed
            assert t.terminated and not t.discard and t.rewards == [1.0]
            assert "error" not in t.info
        assert abandoned_threads() == before + 2
        assert (1, "close") not in calls and (2, "close") not in calls
    finally:
        release.set()
    # Released, an abandoned thread closes its env and exits; its env is never called again.
    deadline = time.monotonic() + 10
    while abandoned_threads() > before and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    assert abandoned_threads() == before
    assert [c for s, c in calls if s == 1] == ["reset", "step", "close"]
    assert [c for s, c in calls if s == 2] == ["reset", "close"]


async def test_the_deadline_is_checked(tiny_tokenizer):
    from trainers.config import RolloutConfig

    with pytest.raises(ValueError, match=r"^env_timeout_s must be a number of seconds > 0"):
        await collect(Answers(tiny_tokenizer), lambda: None, num_prompts=1,
                      sampling=SAMPLING, env_timeout_s=0)
    with pytest.raises(ValueError, match=r"^--rollout.env_timeout_s must be a number of seconds "
                       r"> 0 \(or unset for no deadline\), got nan"):
        RolloutConfig(env_timeout_s=float("nan"))
    assert RolloutConfig().env_timeout_s == 300.0  # training has a deadline unless told not to


# ------------------------------------------------------------------------ through the trainer
_HANG = threading.Event()
_HUNG: list[int] = []
_HUNG_LOCK = threading.Lock()


class HangOnceDigits(DigitsEnv):
    """Digits whose first `step` in the process blocks until `_HANG` is set."""

    def step(self, text):
        with _HUNG_LOCK:
            first = not _HUNG
            _HUNG.append(1)
        if first:
            _HANG.wait(timeout=30)  # a backstop, so a broken deadline fails, not hangs
        return super().step(text)


def test_a_training_step_goes_on_without_the_hung_episode(tmp_path):
    import agentrl
    from trainers.controller import Trainer
    from trainers.presets import digits

    agentrl.register("agentrl-test/HangOnceDigits-v0", HangOnceDigits)
    cfg = digits()
    cfg = dataclasses.replace(
        cfg, env="agentrl-test/HangOnceDigits-v0", run_dir=str(tmp_path / "run"), steps=1,
        use_ray=False, progress=False, tensorboard=False, eval_problems=0, save_rollouts=True,
        rollout=dataclasses.replace(cfg.rollout, prompts_per_step=2, env_timeout_s=2.0),
    )
    _HUNG.clear()
    _HANG.clear()
    before = abandoned_threads()
    try:
        Trainer(cfg).run()
        # The step ended while the hung call was still blocked: it did not wait for it.
        assert _HUNG and abandoned_threads() == before + 1
    finally:
        _HANG.set()
    rows = [json.loads(x) for x in (Path(cfg.run_dir) / "metrics.jsonl").read_text().splitlines()]
    [step] = [r for r in rows if "reward" in r]
    assert step["discarded"] == 1.0
    from agentrl.trajectory_files import load_jsonl

    [hung] = [t for t in load_jsonl(Path(cfg.run_dir) / "rollouts" / "step_000001.jsonl")
              if t.discard]
    assert hung.info["env_timeout"] == "step" and "within 2 s" in hung.info["error"]
