"""agentrl/MiniWoB-v0's step overhead over the raw `miniwob` Gymnasium env, and the browser
pool's start-up time (#33 item 2: overhead <= 20%, start-up <= 2 s per browser).

Both ways drive the same Chromium and chromedriver (the raw env through MINIWOB_CHROME_BINARY
and MINIWOB_CHROMEDRIVER) on the same tasks with the same scripted policy, one env of each per
task, episodes interleaved (raw, agentrl, raw, ...) so machine noise hits both alike:

- raw: `gymnasium.make("miniwob/<task>-v1")`, element actions (CLICK_ELEMENT,
  FOCUS_ELEMENT_AND_TYPE_TEXT) chosen from `dom_elements`; its DOM observation, and with
  `--observation both` its screenshot too (`record_screenshots`, which miniwob turns on by
  default, is set to match).
- agentrl: `gym.make("agentrl/MiniWoB-v0", tokenizer=<embedded>, task=<task>,
  observation=<dom|both>)`, the token-level env a rollout steps (the page listing, and the
  screenshot with `both`, rendered by the chat template; a VLM's tokenizer with `both`), the
  same actions written in its grammar (`click(ref)`, `type(ref, "text")`) by the env's own
  scripted policy (`oracle_action`, from the listing it showed) and tokenized.

Timed: each `env.step` call (the policy's choice and tokenizing its answer are not); resets
apart. The ratio is agentrl's mean step time over raw's. Then the pool: browsers started one
at a time, and `warm(n)` starting n in parallel (what a rollout's first episodes do).

    .venv/bin/python benchmarks/miniwob_overhead.py --steps 1000
    .venv/bin/python benchmarks/miniwob_overhead.py --steps 1000 --observation both
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import gymnasium as gym
from machine import cpu_description  # benchmarks/machine.py

TASKS = ("enter-text", "click-button", "focus-text", "click-dialog")
"""One to three element actions each, solvable from the DOM both ways."""


def _word(utterance: str) -> str:
    m = re.search(r'"([^"]+)"', utterance) or re.search(r"Type (.+) into", utterance)
    if m is None:
        raise ValueError(f"no target in {utterance!r}")
    return m.group(1)


def raw_plan(task: str, utterance: str, elements: list[dict[str, Any]],
             turn: int) -> tuple[str, int, str]:
    """(action type, ref, text) of the scripted policy on the raw env's observation."""
    def ref(pred: Callable[[dict[str, Any]], bool]) -> int:
        return int(next(e["ref"] for e in elements if pred(e)))

    if task == "enter-text":
        if turn == 0:
            return "FOCUS_ELEMENT_AND_TYPE_TEXT", ref(lambda e: e["tag"] == "input_text"), \
                _word(utterance)
        return "CLICK_ELEMENT", ref(lambda e: e["tag"] == "button"), ""
    if task == "click-button":
        return "CLICK_ELEMENT", ref(lambda e: e["tag"] == "button"
                                    and e["text"] == _word(utterance)), ""
    if task == "focus-text":
        return "CLICK_ELEMENT", ref(lambda e: e["tag"] == "input_text"), ""
    return "CLICK_ELEMENT", ref(lambda e: e["tag"] == "button"), ""  # click-dialog's close


class Timer:
    def __init__(self) -> None:
        self.step_s: list[float] = []
        self.reset_s: list[float] = []
        self.episodes = self.solved = 0

    def time(self, into: list[float], fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        out = fn(*args, **kwargs)
        into.append(time.perf_counter() - t0)
        return out


def raw_episode(env: gym.Env, task: str, seed: int, timer: Timer, screenshots: bool) -> None:
    options = {"record_screenshots": screenshots}
    obs, _ = timer.time(timer.reset_s, env.reset, seed=seed, options=options)
    for turn in range(4):
        kind, ref, text = raw_plan(task, obs["utterance"], list(obs["dom_elements"]), turn)
        action = env.unwrapped.create_action(kind, ref=ref, text=text)  # type: ignore[attr-defined]
        obs, reward, terminated, truncated, _ = timer.time(timer.step_s, env.step, action)
        if terminated or truncated:
            timer.solved += reward > 0
            break
    timer.episodes += 1


def agentrl_episode(env: gym.Env, task: str, seed: int, timer: Timer, tok: Any) -> None:
    chat = env.unwrapped.chat_env  # type: ignore[attr-defined]
    timer.time(timer.reset_s, env.reset, seed=seed)
    for _ in range(4):
        answer = chat.oracle_action()  # the env's scripted policy (environments/miniwob/oracle.py)
        ids = tok.encode(answer, add_special_tokens=False) + [tok.eos_token_id]
        _, _, terminated, truncated, info = timer.time(timer.step_s, env.step, ids)
        if terminated or truncated:
            timer.solved += bool(info.get("correct"))
            break
    timer.episodes += 1


def run_steps(steps: int, observation: str) -> tuple[Timer, Timer]:
    import miniwob

    import agentrl  # noqa: F401 - registers agentrl/* ids
    from agentrl.models import load_tokenizer
    from environments.miniwob.browser import find_browser

    chromium, driver = find_browser()
    os.environ["MINIWOB_CHROME_BINARY"], os.environ["MINIWOB_CHROMEDRIVER"] = chromium, driver
    gym.register_envs(miniwob)
    tok = load_tokenizer("embedded" if observation == "dom" else "embedded-vlm")
    screenshots = observation == "both"
    raw, ours = Timer(), Timer()
    per_task = -(-steps // len(TASKS))
    for task in TASKS:
        raw_env = gym.make(f"miniwob/{task}-v1")
        our_env = gym.make("agentrl/MiniWoB-v0", tokenizer=tok, task=task,
                           observation=observation)
        try:
            raw_episode(raw_env, task, 10_000, Timer(), screenshots)  # warm-up, not timed
            agentrl_episode(our_env, task, 10_000, Timer(), tok)
            start_raw, start_ours = len(raw.step_s), len(ours.step_s)
            seed = 0
            while (len(raw.step_s) - start_raw < per_task
                   or len(ours.step_s) - start_ours < per_task):
                if len(raw.step_s) - start_raw < per_task:
                    raw_episode(raw_env, task, seed, raw, screenshots)
                if len(ours.step_s) - start_ours < per_task:
                    agentrl_episode(our_env, task, seed, ours, tok)
                seed += 1
        finally:
            raw_env.close()
            our_env.close()
    return raw, ours


def pool_startup(sequential: int, parallel: int) -> tuple[list[float], list[float], float]:
    from environments.miniwob.pool import BrowserPool

    pool = BrowserPool()
    one_at_a_time = []
    for _ in range(sequential):
        one_at_a_time.extend(pool.warm(1))
        pool.close()
    t0 = time.perf_counter()
    each = pool.warm(parallel)
    wall = time.perf_counter() - t0
    pool.close()
    return one_at_a_time, each, wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=1000, help="steps each way")
    parser.add_argument("--sequential", type=int, default=5, help="browsers started one by one")
    parser.add_argument("--parallel", type=int, default=4, help="browsers started at once")
    parser.add_argument("--observation", choices=("dom", "both"), default="dom",
                        help="dom: the page's DOM both ways; both: and a screenshot")
    args = parser.parse_args()
    print(f"cpu: {cpu_description()}, {os.cpu_count()} cores; load average before: "
          f"{os.getloadavg()[0]:.2f}")
    print(f"command: python {' '.join(sys.argv)}")
    raw, ours = run_steps(args.steps, args.observation)
    for name, t in (("raw miniwob", raw), ("agentrl", ours)):
        print(f"{name:12s} {len(t.step_s)} steps: mean {statistics.mean(t.step_s) * 1e3:6.1f} ms"
              f"  median {statistics.median(t.step_s) * 1e3:6.1f} ms; {t.episodes} episodes "
              f"({t.solved} solved), reset mean {statistics.mean(t.reset_s) * 1e3:6.1f} ms")
    ratio = statistics.mean(ours.step_s) / statistics.mean(raw.step_s)
    print(f"step overhead: {100 * (ratio - 1):+.1f}% (mean step time ratio {ratio:.3f}; "
          f"target <= +20%)")
    seq, par, wall = pool_startup(args.sequential, args.parallel)
    print(f"browser start, one at a time: mean {statistics.mean(seq):.2f} s, max "
          f"{max(seq):.2f} s ({len(seq)} starts)")
    print(f"browser start, {args.parallel} at once: {wall:.2f} s wall = "
          f"{wall / args.parallel:.2f} s per browser (each took {min(par):.2f}-{max(par):.2f} s)")
    print(f"load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
