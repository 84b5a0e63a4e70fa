"""A MiniWoB++ task page in a `Browser`: load a task, start a seeded episode, look at it, act
on it, read its verdict. The page-side protocol is MiniWoB++'s own `core.js` (the calls
`miniwob.selenium_instance` makes); the mouse and keyboard are `miniwob.selenium_actions`'.

The task's clock. MiniWoB++ ends an episode with reward -1 when its time limit (10 s for most
tasks) passes, and scales a positive reward by the time left. `park_clock` stops that clock's
timer: the episode then runs on the clock its user keeps, which `verdict(clock_ms)` and `end`
apply (see `MiniWoBEnv`'s `clock`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from environments.miniwob.browser import Browser, BrowserError
from environments.miniwob.dom import Notes
from environments.miniwob.tasks import html_dir

if TYPE_CHECKING:
    from miniwob.dom import DOMElement  # type: ignore[import-untyped, import-not-found, unused-ignore]

WIDTH, HEIGHT = 160, 210
"""A MiniWoB++ task's screen, in pixels: what screenshots show and click(x, y) addresses."""

_START = """
core.endEpisode(0);
Math.seedrandom(arguments[0]);
core.setDataMode(arguments[1]);
core.EPISODE_MAX_TIME = arguments[2];
core.startEpisodeReal();
if (arguments[3]) {
  clearTimeout(core.EP_TIMER);
  core.EP_TIMER = setTimeout(function () {}, 2147483647);
  core.clearTimer();
}
"""
# A parked timer stays set (a dummy one): core.endEpisode rewards nothing once it is null.

_LOOK = """
var click = arguments[1] === null ? null : core.elementClick(arguments[1]);
var verdict = [WOB_DONE_GLOBAL, WOB_REWARD_GLOBAL, WOB_RAW_REWARD_GLOBAL,
               WOB_REWARD_REASON == null ? null : String(WOB_REWARD_REASON)];
if (verdict[0]) return [click, verdict, null, null];
var info = arguments[0] ? core.getDOMInfo() : null;
// What the listing adds (dom.py's Notes): labels, a select's value and options, and which
// elements without text react to a click (a handler of their own, or a pointer cursor).
(function note(node) {
  if (!node) return;
  var el = core.previousDOMInfo[node.ref];
  if (el instanceof HTMLSelectElement) {
    node.value = el.selectedIndex >= 0 ? el.options[el.selectedIndex].text : "";
    node.options = Array.prototype.map.call(el.options, function (o) { return o.text; });
  }
  if (el && el.getAttribute) {
    var label = el.getAttribute("aria-label") || el.getAttribute("title") || el.getAttribute("alt");
    if (label) node.label = label;
    if (!node.children.length && !node.text) {  // a control without text?
      var events = window.jQuery && jQuery._data ? jQuery._data(el, "events") : null;
      if (el.onclick || (events && (events.click || events.mousedown || events.mouseup))
          || window.getComputedStyle(el).cursor === "pointer") node.clickable = true;
    }
  }
  node.children.forEach(note);
})(info);
return [click, verdict, core.getUtterance(), info];
"""
# One round trip a turn: the click (if any), the verdict, and the page while the task runs.

_SELECT = """
var el = core.previousDOMInfo[arguments[0]];
if (!(el instanceof HTMLSelectElement)) return "it is not a select";
for (var i = 0; i < el.options.length; i++) {
  if (el.options[i].text === arguments[1]) {
    el.focus();
    el.selectedIndex = i;
    el.dispatchEvent(new Event("input", {bubbles: true}));
    el.dispatchEvent(new Event("change", {bubbles: true}));
    return true;
  }
}
return "it has no option " + JSON.stringify(arguments[1]);
"""

_VERDICT = """
if (arguments[0] !== null) core.ept0 = new Date().getTime() - arguments[0];
return [WOB_DONE_GLOBAL, WOB_REWARD_GLOBAL, WOB_RAW_REWARD_GLOBAL,
        WOB_REWARD_REASON == null ? null : String(WOB_REWARD_REASON)];
"""


@dataclass(frozen=True)
class Verdict:
    """MiniWoB++'s account of the episode: whether it ended, its reward (with the time factor)
    and raw reward (without), and why."""

    done: bool
    reward: float
    raw_reward: float
    reason: str | None


@dataclass(frozen=True)
class Look:
    """What `TaskPage.look` saw: the verdict, and while the task runs, the instruction, the
    DOM with its notes, the screenshot; and why the click it was asked to make failed."""

    verdict: Verdict
    utterance: str
    seen: tuple[DOMElement, Notes] | None
    image: np.ndarray | None
    click_error: str | None = None


def _verdict(row: list[Any]) -> Verdict:
    done, reward, raw, reason = row
    return Verdict(bool(done), float(reward), float(raw), reason)


class TaskPage:
    """The MiniWoB++ page of one task at a time, in one browser."""

    def __init__(self, browser: Browser) -> None:
        self.browser = browser
        self.task: str | None = None
        self.default_limit_ms = 10_000
        self._inner = (WIDTH, HEIGHT)

    @property
    def driver(self) -> Any:
        return self.browser.driver

    def load(self, task: str) -> None:
        """Open the task's page and wait until it is ready (`BrowserError("load")` past the
        browser's timeout)."""
        url = (html_dir() / "miniwob" / f"{task}.html").as_uri()
        self.task = None
        t0 = time.monotonic()
        self.browser.run(f"loading {task}", lambda: self.driver.get(url))
        deadline = t0 + self.browser.timeout_s
        while True:
            ready = self.browser.run(f"loading {task}", lambda: self.driver.execute_script(
                "return typeof core !== 'undefined' && core.cover_div !== null "
                "&& document.getElementById('sync-task-cover') !== null "
                "? [core.EPISODE_MAX_TIME, window.innerWidth, window.innerHeight] : null;"))
            if ready:
                break
            if time.monotonic() > deadline:
                self.browser.close()
                raise BrowserError("load", f"the page of task {task!r} ({url}) did not load "
                                           f"within {self.browser.timeout_s:g} s")
            time.sleep(0.02)
        self.default_limit_ms, width, height = int(ready[0]), int(ready[1]), int(ready[2])
        if width < WIDTH or height < HEIGHT:
            self.browser.close()
            raise BrowserError("load", f"the browser's page area is {width} x {height}, "
                                       f"smaller than a task's {WIDTH} x {HEIGHT}")
        self._inner = (width, height)
        self.task = task

    def start(self, seed: str, data_mode: str, limit_ms: int | None, park_clock: bool) -> int:
        """Start an episode of the loaded task from `seed`; its time limit in ms."""
        limit = self.default_limit_ms if limit_ms is None else limit_ms
        self.browser.run("starting the episode", lambda: self.driver.execute_script(
            _START, seed, data_mode, limit, park_clock))
        deadline = time.monotonic() + self.browser.timeout_s
        while not self.browser.run("starting the episode", lambda: self.driver.execute_script(
                "return WOB_TASK_READY;")):
            if time.monotonic() > deadline:
                self.browser.close()
                raise BrowserError("load", f"task {self.task!r} did not get ready within "
                                           f"{self.browser.timeout_s:g} s")
            time.sleep(0.02)
        return limit

    def verdict(self, clock_ms: int | None = None) -> Verdict:
        """The episode's verdict; with `clock_ms`, first make the task's (parked) clock read
        that many ms since the episode started, for the time factor of the reward it gives
        next."""
        return _verdict(self.browser.run("reading the reward", lambda: self.driver.execute_script(
            _VERDICT, clock_ms)))

    def end(self, reason: str) -> None:
        """End the episode as MiniWoB++ ends one whose time ran out: reward -1."""
        self.browser.run("ending the episode", lambda: self.driver.execute_script(
            "core.endEpisode(-1, false, arguments[0]);", reason))

    def look(self, dom: bool, screenshot: bool, click: int | None = None) -> Look:
        """Click the element `click` of the latest DOM listing (if given), then the verdict
        and, while the task runs, its instruction, its DOM with what the listing adds (if
        asked) and a screenshot (if asked). One round trip but for the screenshot."""
        from miniwob.dom import DOMElement  # type: ignore[import-untyped, import-not-found, unused-ignore]

        clicked, verdict, utterance, info = self.browser.run(
            "reading the page", lambda: self.driver.execute_script(_LOOK, dom, click))
        why = None if click is None or clicked is True else str(clicked)
        if verdict[0]:
            return Look(_verdict(verdict), "", None, None, why)
        image = self._screenshot() if screenshot else None
        seen = (DOMElement(info), Notes.of(info)) if info else None
        return Look(_verdict(verdict), str(utterance), seen, image, why)

    def _screenshot(self) -> np.ndarray:
        from miniwob.screenshot import get_screenshot  # type: ignore[import-untyped, import-not-found, unused-ignore]

        pil = self.browser.run("taking a screenshot", lambda: get_screenshot(
            self.driver, self._inner[0], self._inner[1], WIDTH, HEIGHT))
        return np.asarray(pil.convert("RGB"), dtype=np.uint8)

    # Actions. Each raises ActionError when the page refuses it, BrowserError when it failed.

    def click_element(self, ref: int) -> str | None:
        """Click the element `ref` of the latest DOM listing; None, or why it failed."""
        result = self.browser.run("clicking", lambda: self.driver.execute_script(
            "return core.elementClick(arguments[0]);", ref))
        return None if result is True else str(result)

    def select_option(self, ref: int, text: str) -> str | None:
        """Pick the option `text` of the select `ref`; None, or why it could not."""
        result = self.browser.run("selecting", lambda: self.driver.execute_script(
            _SELECT, ref, text))
        return None if result is True else str(result)

    def click_at(self, x: int, y: int) -> None:
        from miniwob.selenium_actions import execute_click_coords  # type: ignore[import-untyped, import-not-found, unused-ignore]

        self.browser.run("clicking", lambda: execute_click_coords(x, y, self.driver))

    def type_text(self, text: str) -> None:
        from miniwob.selenium_actions import execute_type_text  # type: ignore[import-untyped, import-not-found, unused-ignore]

        self.browser.run("typing", lambda: execute_type_text(text, self.driver))

    def press(self, key: str) -> None:
        from miniwob.selenium_actions import execute_press_key  # type: ignore[import-untyped, import-not-found, unused-ignore]

        self.browser.run("pressing a key", lambda: execute_press_key(key, self.driver))

    def scroll(self, x: int, y: int, dx: int, dy: int) -> None:
        from selenium.webdriver.common.action_chains import ActionChains  # type: ignore[import-not-found, unused-ignore]
        from selenium.webdriver.common.actions.wheel_input import ScrollOrigin  # type: ignore[import-not-found, unused-ignore]

        self.browser.run("scrolling", lambda: ActionChains(self.driver).scroll_from_origin(
            ScrollOrigin.from_viewport(x, y), dx, dy).perform())
