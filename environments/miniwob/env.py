"""`agentrl/MiniWoB-v0`: MiniWoB++ web tasks in a real headless Chromium, as page text for
text models (`dom`), as screenshots for vision-language models (`screenshot`), or both.

    env = gym.make("agentrl/MiniWoB-v0", task="click-basics", observation="dom")

Each episode is one task (a name, or one drawn from a suite or list, see `tasks.py`; or
`reset(options={"task": name})`; with `options={"index": i}`, as `agentrl eval` numbers its
problems, task i mod their number, so each task gets its share) started from a seed, so the
same seed gives the same page.
Every turn the policy sees the task's instruction and the page, and answers with one action in
the grammar of `actions.py` (`click(ref)`, `click(x, y)`, `type(ref, "text")`, `key("Enter")`,
`scroll(dx, dy)`, `done()`). An answer that is not an action, or an action the page cannot
do, costs a turn and comes back as feedback in the next observation; it never raises.

The episode ends when the task does (MiniWoB++'s reward: up to 1 for success, scaled by the
time left, -1 for failure; `info["correct"]`: its raw reward was > 0), when its time limit
passes (-1, terminated), on `done()` (terminated) or when `max_turns` runs out (truncated).
An episode the task did not end scores -1, as MiniWoB++ scores a time-out.

The clock. MiniWoB++ times an episode in wall-clock time (10 s for most tasks), which would
charge the policy for how fast its sampler is. `clock="steps"` (the default) stops the page's
clock between actions and counts `step_s` per turn instead: the time limit becomes a number of
turns (a 10 s task allows 9 actions at 1 s each) and rewards do not depend on the machine;
the time factor is computed on that clock, exactly. `clock="wall"` is MiniWoB++'s own.

The browser. One headless Chromium per env, taken from this process's pool at the first
`reset` and given back by `close()` (`pool.py`: a rollout's concurrent episodes each hold their
own, and the next episode's env reuses a running one; `browser.py`: no process of it outlives
this process, even after SIGKILL). A browser that crashes or hangs past `timeout_s` is closed,
never reused: the episode ends truncated with `info["discard"]`, `info["error"]` and
`info["browser_failure"]` (the convention of `agentrl.types.Trajectory.discard`, which the
rollout keeps out of training and counts), and the next `reset` takes another. A browser that
cannot start, or a task page that does not load, raises `BrowserError` from `reset` (the
rollout discards that episode with the reason); missing Chromium or packages raise
`BrowserUnavailableError` (one line naming what to install) when the env is built.

Splits: `train` and `eval` episodes draw their page seeds from different streams ("train-N",
"eval-N") and MiniWoB++'s "train" and "test" data modes, so held-out episodes are new pages.
An env pickles mid-episode: its copy starts a browser of its own and replays the episode's
actions on the same seed.

The prompt. The first observation is the instructions (`instructions()`), then the task and
the page. With `example=True` (the default in `dom` and `both` modes) the instructions are a
system message and one example exchange comes before the page: a made-up page (`EXAMPLE_PAGE`,
not one of MiniWoB++'s, so it gives no task's answer away) and its answer (`EXAMPLE_ANSWER`,
the bare action). A small model shown only the grammar rarely writes an action at all (the
embedded SmolLM2-135M: 0 of 48 episodes of click-basics); one example teaches the format in
about 60 tokens. `screenshot` mode has no example (its page is an image), and `example=False`
gives the instructions and the page in one user message.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from agentrl.envs import ChatEnv
from agentrl.envs.chat import StepResult
from agentrl.envs.template import Message
from environments.miniwob import actions as act
from environments.miniwob.browser import ActionError, Browser, BrowserError, find_browser
from environments.miniwob.dom import Box, render_page
from environments.miniwob.oracle import oracle_action
from environments.miniwob.page import HEIGHT, WIDTH, Look, TaskPage, Verdict
from environments.miniwob.pool import browser_pool
from environments.miniwob.tasks import resolve_tasks, task_names

OBSERVATIONS = ("dom", "screenshot", "both")
CLOCKS = ("steps", "wall")
SPLITS = ("train", "eval")

_SEES = {
    "dom": "the task and the page's elements, one per line as [ref] tag \"text\"",
    "screenshot": f"the task and a screenshot of the page ({WIDTH} x {HEIGHT} pixels)",
    "both": "the task, the page's elements (one per line as [ref] tag \"text\") and a "
            f"screenshot of the page ({WIDTH} x {HEIGHT} pixels)",
}
_ACTIONS = {
    "dom": 'click(ref), type(ref, "text"), key("Enter"), scroll(dx, dy) or done()',
    "screenshot": 'click(x, y) (pixels from the top-left corner), type("text") (into the '
                  'focused field), key("Enter"), scroll(dx, dy) or done()',
    "both": 'click(ref), click(x, y), type(ref, "text"), type("text"), key("Enter"), '
            'scroll(dx, dy) or done()',
}


EXAMPLE_PAGE = ('Task: Open the "Settings" page.\nPage:\n[2] a "Home"\n[3] a "Settings"\n'
                '[4] p "Welcome back."')
"""The example exchange's page (`example=True`): made up, in the listing's format."""
EXAMPLE_ANSWER = "click(3)"
"""The example exchange's answer: the action alone, as the policy should write it."""


def instructions(observation: str) -> str:
    """What the first observation says before the page."""
    return (f"You operate a web page to do a task. Each turn you see {_SEES[observation]}. "
            f"Answer with one action on the last line: {_ACTIONS[observation]}.")


_pages: weakref.WeakKeyDictionary[Browser, TaskPage] = weakref.WeakKeyDictionary()
"""The page each browser shows, kept with the browser as it passes from env to env."""


@dataclass
class _Episode:
    task: str
    seed: str
    limit_ms: int = 0
    turn: int = 0
    clock_ms: int = 0
    answers: list[str] = field(default_factory=list)
    boxes: dict[int, Box] = field(default_factory=dict)
    options: dict[int, list[str]] = field(default_factory=dict)
    """The options of each select of the latest listing, by ref."""
    pointer: tuple[int, int] = (WIDTH // 2, HEIGHT // 2)
    listing: tuple[str, list[str]] | None = None
    """The task's words and the page's lines as last shown (`dom` and `both` modes)."""
    over: bool = False


class MiniWoBEnv(ChatEnv):
    """MiniWoB++ web tasks in headless Chromium (module docstring).

    Args:
        task: a MiniWoB++ task ("click-button"), a suite ("click-basics") or a comma list.
        observation: "dom" (page text), "screenshot" (image) or "both".
        split: "train" or "eval" (held-out page seeds).
        max_turns: turn budget (None: the task's time limit bounds the episode).
        clock: "steps" (the task's clock advances `step_s` per turn) or "wall".
        step_s: task time one turn takes with clock="steps".
        time_limit_s: the tasks' time limit (None: each task's own).
        example: show one example exchange before the page (module docstring, "The prompt");
            None: on for "dom" and "both", off for "screenshot" (which cannot have it).
        timeout_s: how long a page load or a browser command may take before the browser
            counts as hung (a start may take `browser.START_TIMEOUT_S`).
    """

    def __init__(
        self, *, task: str = "click-basics", observation: str = "dom", split: str = "train",
        max_turns: int | None = None, clock: str = "steps", step_s: float = 1.0,
        time_limit_s: float | None = None, example: bool | None = None, timeout_s: float = 20.0,
    ) -> None:
        for name, value, allowed in (("observation", observation, OBSERVATIONS),
                                     ("split", split, SPLITS), ("clock", clock, CLOCKS)):
            if value not in allowed:
                raise ValueError(f"{name}={value!r}: expected one of {allowed}")
        if max_turns is not None and max_turns < 1:
            raise ValueError(f"max_turns={max_turns}: expected None or >= 1")
        if not step_s > 0 or not timeout_s > 0:
            raise ValueError(f"step_s and timeout_s must be > 0; got step_s={step_s}, "
                             f"timeout_s={timeout_s}")
        if time_limit_s is not None and not time_limit_s > 0:
            raise ValueError(f"time_limit_s={time_limit_s}: expected None or > 0")
        if example and observation == "screenshot":
            raise ValueError("example=True needs a page listing: use observation='dom' or "
                             "'both', or example=False with screenshots")
        self.example = observation != "screenshot" if example is None else example
        self.tasks = self.preflight(task=task)
        self.observation, self.split, self.clock = observation, split, clock
        self.max_turns, self.step_s, self.time_limit_s = max_turns, step_s, time_limit_s
        self.timeout_s = timeout_s
        self.image_shape = None if observation == "dom" else (HEIGHT, WIDTH, 3)
        self._browser: Browser | None = None
        self._page: TaskPage | None = None
        self._episode: _Episode | None = None

    @staticmethod
    def preflight(*, task: str = "click-basics", **_: object) -> tuple[str, ...]:
        """The checks of building the env that start nothing, for a command to run before any
        model loads: the packages, Chromium and its driver (`BrowserUnavailableError`, one
        line naming what to install), the task names (a did-you-mean). The tasks named."""
        find_browser()
        return resolve_tasks(task)

    # Episodes

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[list[Message], dict[str, Any]]:
        if seed is not None or getattr(self, "np_random", None) is None:
            self.np_random = np.random.default_rng(seed)  # the token bridge seeds it the same
        task = (options or {}).get("task")
        index = (options or {}).get("index")
        if task is None and index is not None:  # `agentrl eval`'s problem i: task i mod n
            task = self.tasks[int(index) % len(self.tasks)]
        elif task is None:
            task = self.tasks[int(self.np_random.integers(len(self.tasks)))]
        elif task not in task_names():
            resolve_tasks(task)  # raises with a did-you-mean
            raise ValueError(f"options['task']={task!r}: name one task, not a suite or list")
        page_seed = f"{self.split}-{int(self.np_random.integers(2**31))}"
        self._episode = ep = _Episode(task=task, seed=page_seed)
        try:
            text, image = self._begin(ep)
        except BrowserError:
            self._drop_browser()
            ep.over = True
            raise
        info = {"task": task, "seed": page_seed, "split": self.split,
                "time_limit_s": ep.limit_ms / 1000}
        return self._first_messages(text, image), info

    def step(self, assistant_text: str) -> StepResult:
        ep = self._episode
        if ep is None or ep.over:
            raise RuntimeError("step() called without an episode in progress; call reset()")
        try:
            if self._page is None:  # a copy made by pickling: replay the episode first
                self._replay(ep)
            return self._turn(ep, assistant_text)
        except BrowserError as e:
            self._drop_browser()
            ep.over = True
            return [], 0.0, False, True, {**self._info(ep), "discard": True, "error": str(e),
                                          "browser_failure": e.kind}

    def oracle_action(self) -> str:
        """The scripted answer to the page as last shown (`oracle.py`: the click-basics and
        warm-up suites' tasks, from the page listing, so `dom` or `both` mode)."""
        ep = self._episode
        if ep is None or ep.over:
            raise RuntimeError("oracle_action() needs an episode in progress; call reset()")
        if ep.listing is None:
            raise ValueError("the scripted policy reads the page listing: use observation='dom' "
                             "or 'both'")
        return oracle_action(ep.task, *ep.listing)

    def close(self) -> None:
        """Give the browser back to the pool (it is closed there at exit, or here if it
        failed)."""
        browser, self._browser, self._page = self._browser, None, None
        if browser is not None:
            browser_pool().release(browser)

    # One turn

    def _turn(self, ep: _Episode, answer: str, *, replay: bool = False) -> StepResult:
        page = self._page
        assert page is not None
        ep.turn += 1
        ep.answers.append(answer)
        clock = None
        if self.clock == "steps":
            ep.clock_ms += round(self.step_s * 1000)
            if ep.clock_ms >= ep.limit_ms:
                page.end("timed out")
            else:
                clock = ep.clock_ms
        verdict = page.verdict(clock)
        feedback, look = None, None
        if not verdict.done:  # the time may have run out (clock="wall") while the policy thought
            action = act.parse_action(answer)
            if isinstance(action, act.Done):
                page.end("done() before the task ended")
                verdict = page.verdict()
            else:
                click = None
                if isinstance(action, str):
                    feedback = action
                else:
                    feedback, click = self._do(ep, action, answer)
                try:
                    look = self._observe(ep, with_image=not replay, click=click)
                    why = look.click_error
                except ActionError as e:  # the page refused the click: look again without it
                    look, why = self._observe(ep, with_image=not replay), str(e)
                if why is not None:
                    feedback = f"{act.action_line(answer)} failed: {why}"
                verdict = look.verdict
        if verdict.done:
            return self._finish(ep, verdict, terminated=True)
        if self.max_turns is not None and ep.turn >= self.max_turns:
            page.end("turn budget ran out")
            return self._finish(ep, page.verdict(), terminated=False)
        assert look is not None  # the task runs, so this turn looked at it
        text, image = self._render(ep, look)
        if feedback:
            text = f"{feedback}\n{text}"
        return [self._message(text, image)], 0.0, False, False, self._info(ep)

    def _do(self, ep: _Episode, action: act.Action, answer: str) -> tuple[str | None, int | None]:
        """Act on the page: (None, or feedback saying why the action could not be done; the
        element to click in the turn's look, which clicks and looks in one call)."""
        page = self._page
        assert page is not None
        shown = act.action_line(answer)
        try:
            if (isinstance(action, act.Type) and action.ref is not None
                    and action.ref in ep.options and self.observation != "screenshot"):
                # A select takes its option by name (typing into one is the browser's guess).
                why = page.select_option(action.ref, action.text)
                return (None if why is None else f"{shown} failed: {why}; its options are "
                        f"listed after it."), None
            if isinstance(action, act.ClickRef | act.Type) and action.ref is not None:
                why = self._click_ref(ep, action.ref)
                if why is not None:
                    return f"{shown} failed: {why}", None
                if isinstance(action, act.ClickRef) and action.ref > 0:
                    return None, action.ref
            if isinstance(action, act.ClickAt):
                if not (0 <= action.x < WIDTH and 0 <= action.y < HEIGHT):
                    return (f"{shown} failed: ({action.x}, {action.y}) is off the screen, which "
                            f"is {WIDTH} x {HEIGHT} pixels."), None
                page.click_at(action.x, action.y)
                ep.pointer = (action.x, action.y)
            elif isinstance(action, act.Type):
                if action.ref is not None and action.ref > 0:
                    why = page.click_element(action.ref)
                    if why is not None:
                        return f"{shown} failed: {why}", None
                page.type_text(action.text)
            elif isinstance(action, act.Key):
                page.press(action.key)
            elif isinstance(action, act.Scroll):
                page.scroll(*ep.pointer, action.dx, action.dy)
        except ActionError as e:
            return f"{shown} failed: {e}", None
        return None, None

    def _click_ref(self, ep: _Episode, ref: int) -> str | None:
        """Why `ref` cannot be clicked, or None; a run of text is clicked here (at its centre),
        an element by the caller."""
        page = self._page
        assert page is not None
        if self.observation == "screenshot":
            return "screenshot mode shows no refs; click(x, y) where you see the element."
        box = ep.boxes.get(ref)
        if box is None:
            return f"there is no element [{ref}] on the page; use a ref from the latest listing."
        ep.pointer = box.centre
        if ref > 0:
            return None
        # A run of text (a negative ref) is no element of its own: click at its centre.
        x, y = box.centre
        if not (0 <= x < WIDTH and 0 <= y < HEIGHT):
            return f"the text [{ref}] is off the screen."
        page.click_at(x, y)
        return None

    def _finish(self, ep: _Episode, verdict: Verdict, *, terminated: bool) -> StepResult:
        ep.over = True
        reward = verdict.reward
        if self.clock == "steps" and 0 < verdict.reward < verdict.raw_reward:
            # The task scaled its reward by the time left: on the steps clock, exactly.
            reward = verdict.raw_reward * max(0.0, 1.0 - ep.clock_ms / ep.limit_ms)
        info = {**self._info(ep), "correct": verdict.raw_reward > 0,
                "raw_reward": verdict.raw_reward, "reason": verdict.reason}
        return [], float(reward), terminated, not terminated, info

    def _info(self, ep: _Episode) -> dict[str, Any]:
        return {"task": ep.task, "seed": ep.seed, "turns": ep.turn}

    # The page

    def _begin(self, ep: _Episode) -> tuple[str, np.ndarray | None]:
        """Start the episode's page (a browser first, if there is none); its first look."""
        if self._page is None:
            self._browser = browser = browser_pool().acquire(timeout_s=self.timeout_s)
            # A pooled browser keeps its page: the same task is restarted, not reloaded.
            self._page = _pages.get(browser) or _pages.setdefault(browser, TaskPage(browser))
        if self._page.task != ep.task:
            self._page.load(ep.task)
        limit = None if self.time_limit_s is None else round(self.time_limit_s * 1000)
        ep.limit_ms = self._page.start(ep.seed, "train" if self.split == "train" else "test",
                                       limit, park_clock=self.clock == "steps")
        return self._look(ep)

    def _look(self, ep: _Episode, *, with_image: bool = True) -> tuple[str, np.ndarray | None]:
        """The page as the policy sees it now."""
        return self._render(ep, self._observe(ep, with_image=with_image))

    def _observe(self, ep: _Episode, *, with_image: bool, click: int | None = None) -> Look:
        page = self._page
        assert page is not None
        return page.look(self.observation != "screenshot",
                         with_image and self.observation != "dom", click)

    def _render(self, ep: _Episode, look: Look) -> tuple[str, np.ndarray | None]:
        """The observation's text (the listing's refs and selects are kept for the next
        action) and image."""
        text = f"Task: {look.utterance}"
        if look.seen is not None:
            root, notes = look.seen
            lines, ep.boxes = render_page(root, WIDTH, HEIGHT, notes)
            ep.listing = (look.utterance, lines)
            ep.options = {ref: list(opts) for ref, opts in notes.options.items()}
            text += "\nPage:\n" + ("\n".join(lines) or "(no text or field on the screen)")
        return text, look.image

    def _first_messages(self, text: str, image: np.ndarray | None) -> list[Message]:
        """The first observation: instructions, the example exchange if shown, the page."""
        if not self.example:
            return [self._message(instructions(self.observation) + "\n\n" + text, image)]
        return [{"role": "system", "content": instructions(self.observation)},
                {"role": "user", "content": EXAMPLE_PAGE},
                {"role": "assistant", "content": EXAMPLE_ANSWER},
                self._message(text, image)]

    def _message(self, text: str, image: np.ndarray | None) -> Message:
        if image is None:
            return {"role": "user", "content": text}
        return {"role": "user", "content": [{"type": "text", "text": text},
                                            {"type": "image", "image": image}]}

    def _replay(self, ep: _Episode) -> None:
        """Bring a copy's new browser to where the episode was: same seed, same answers."""
        answers = list(ep.answers)
        ep.turn, ep.clock_ms, ep.answers = 0, 0, []
        ep.pointer = (WIDTH // 2, HEIGHT // 2)
        self._begin(ep)
        for answer in answers:
            self._turn(ep, answer, replay=True)

    def _drop_browser(self) -> None:
        if self._browser is not None:
            self._browser.close()
        self._browser, self._page = None, None

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_browser"] = state["_page"] = None  # a copy starts its own (see _replay)
        return state
