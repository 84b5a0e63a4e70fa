"""`agentrl/MiniWoB-v0` (#33): the action grammar and the page listing on their own (icons,
swatches and selects included), then a real headless Chromium: Gymnasium's checker, scripted
episodes that solve tasks, malformed and impossible actions as feedback, the clocks and the turn
budget, screenshots through the chat bridge, pickling mid-episode, and the browsers as a pooled
resource (reused without a start, one per concurrent episode, a dead one replaced, a crash or a
page that never loads discarding only its episode in a rollout, close_pool() and a SIGKILLed
parent leaving no process behind); then the commands (eval per task with Wilson intervals,
rollout writing screenshots, bad input refused before a model loads). The browser tests skip,
saying why, where Chromium, its driver or the Python packages are missing."""

from __future__ import annotations

import json
import os
import pickle
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import gymnasium as gym
import pytest
from gymnasium.utils.env_checker import check_env

import agentrl  # registers the ids
from environments.miniwob import actions as act
from environments.miniwob.browser import BrowserUnavailableError
from tests.browsers import browser_unavailable
from tests.processes import alive, still_alive

ENV_ID = "agentrl/MiniWoB-v0"


UNAVAILABLE = browser_unavailable()
browser = pytest.mark.skipif(UNAVAILABLE is not None, reason=f"no browser here: {UNAVAILABLE}")




# The grammar and the listing: no browser.


@pytest.mark.parametrize(("text", "action"), [
    ("click(6)", act.ClickRef(6)),
    ("click(-3)", act.ClickRef(-3)),
    ("The button is [6].\nclick( 12 , 40 )", act.ClickAt(12, 40)),
    ('`type(5, "Jerald")`', act.Type("Jerald", 5)),
    ('type("say \\"hi\\"")', act.Type('say "hi"')),
    ('key("Enter")', act.Key("<Enter>")),
    ('key("Control+a")', act.Key("C-a")),
    ('key("Shift+Tab")', act.Key("S-<Tab>")),
    ("scroll(0, -120)", act.Scroll(0, -120)),
    ("done()", act.Done()),
])
def test_each_form_of_the_grammar_parses(text, action):
    assert act.parse_action(text) == action


@pytest.mark.parametrize(("text", "reason"), [
    ("", r"^Your answer was empty\. End it with one action: click\(ref\), click\(x, y\)"),
    ("I would click the Ok button", r"^No action in your answer's last line \('I would click"),
    ("click(6)\nThat should do it.", r"^No action in your answer's last line \('That should"),
    ("click(6) click(7)", r"^'click\(6\) click\(7\)' is not a valid click action; the forms are"),
    ("type(5, 'hi')", r"^\"type\(5, 'hi'\)\" is not a valid type action.*strings in double quotes"),
    ("click(1.5, 2)", r"is not a valid click action.*whole numbers"),
    ('key("F13")', r"^key\(\"F13\"\): unknown key 'F13'; name one of Enter, Tab"),
    ('key("Hyper+a")', r"^key\(\"Hyper\+a\"\): unknown modifier 'Hyper'"),
    ("scroll(0, 99999)", r"^scroll\(0, 99999\) is too far: at most 2000 pixels"),
    ('type("' + "x" * 201 + '")', r"^That text is 201 characters long; type at most 200"),
])
def test_what_is_not_an_action_gets_a_reason(text, reason):
    got = act.parse_action(text)
    assert isinstance(got, str)
    assert re.search(reason, got), got


def test_the_page_listing():
    pytest.importorskip("miniwob", reason="the listing reads miniwob's DOM elements")
    from miniwob.dom import DOMElement

    from environments.miniwob.dom import render_page

    def el(ref, tag, left, top, children=(), **kw):
        return {"ref": ref, "tag": tag, "left": left, "top": top, "width": 40, "height": 20,
                "children": list(children), **kw}

    root = DOMElement(el(1, "BODY", 0, 0, [el(2, "DIV", 0, 0, [
        el(3, "DIV", 2, 50, text="Some \"quoted\"   words"),
        el(4, "INPUT_text", 2, 80, value="ab", focused=True),
        el(5, "BUTTON", 2, 100, [el(6, "SPAN", 2, 100, text=""),
                                 el(-1, "t", -5000, 100, text="Close")]),
        el(7, "INPUT_checkbox", 2, 120, value=True),
        el(8, "DIV", 2, 140, text=""),             # empty: not listed
        el(9, "DIV", 300, 50, text="off screen"),  # outside 160 x 210: not listed
        el(10, "P", 2, 160, [el(-2, "t", 2, 160, text="a run"), el(11, "SPAN", 50, 160,
                                                                    text="link")]),
    ])]))
    lines, boxes = render_page(root, 160, 210)
    assert lines == [
        '[3] div "Some \\"quoted\\" words"',
        '[4] input_text value="ab" (focused)',
        '[5] button "Close"',
        "[7] input_checkbox (checked)",
        '[-2] text "a run"',
        '[11] span "link"',
    ]
    assert sorted(boxes) == [-2, 3, 4, 5, 7, 11]
    assert boxes[5].centre == (22, 110)


def test_the_listing_shows_controls_without_text_and_selects():
    pytest.importorskip("miniwob", reason="the listing reads miniwob's DOM elements")
    from miniwob.dom import DOMElement

    from environments.miniwob.dom import Notes, render_page

    def el(ref, tag, children=(), **kw):
        return {"ref": ref, "tag": tag, "left": 2, "top": 10 * ref, "width": 12, "height": 12,
                "children": list(children), **kw}

    raw = el(1, "BODY", [el(2, "DIV", [
        el(3, "SPAN", classes="star", text="", clickable=True),      # an icon: by its class
        el(4, "SPAN", id="open-search", text="", clickable=True),   # by its id
        el(5, "SPAN", classes="reply", text="", label="Reply"),     # by its label
        el(6, "DIV", classes="ui-resizable-handle", text=""),       # no click: not listed
        el(7, "SPAN", text="", bgColor="rgb(255, 165, 0)"),         # a swatch: its colour
        el(8, "SPAN", text="", bgColor="rgba(0, 0, 0, 0)"),         # transparent: not listed
        el(9, "A", [el(10, "SPAN", classes="ui-icon", text="")], id="up"),  # an icon link
        el(11, "SELECT", value="Angola", options=["American Samoa", "Angola"]),
    ])])
    lines, boxes = render_page(DOMElement(raw), 160, 210, Notes.of(raw))
    assert lines == [
        '[3] span icon "star"',
        '[4] span icon "open-search"',
        '[5] span icon "Reply"',
        '[7] span background="#ffa500"',
        '[9] a icon "up"',
        '[11] select value="Angola" options: "American Samoa", "Angola"',
    ]
    assert sorted(boxes) == [3, 4, 5, 7, 9, 11]
    # Without the notes (no handler seen), an icon with only a class is not listed.
    lines, _ = render_page(DOMElement(raw), 160, 210)
    assert '[3] span icon "star"' not in lines and '[9] a icon "up"' in lines


def test_unknown_tasks_get_a_did_you_mean_and_the_list():
    pytest.importorskip("miniwob", reason="the task list is the miniwob package's")
    from environments.miniwob.tasks import SUITES, resolve_tasks, task_names

    assert len(task_names()) >= 125 and "click-button" in task_names()
    assert resolve_tasks("click-basics") == SUITES["click-basics"]
    assert resolve_tasks("enter-text, click-basics") == (
        "enter-text", "click-button", "click-link", "click-dialog", "click-tab", "focus-text")
    with pytest.raises(ValueError, match=r"^unknown MiniWoB\+\+ task 'click-buton'\. Did you "
                       r"mean 'click-button'.*\? Suites: click-basics, warm-up\. Tasks \(1\d\d\): "
                       r"ascending-numbers, bisect-angle, "):
        resolve_tasks("click-buton")
    with pytest.raises(ValueError, match=r"^task 'flight\.AA': FlightWoB tasks \(flight\.\*\) "
                       r"are not supported yet"):
        resolve_tasks("flight.AA")


def test_missing_packages_are_one_line_naming_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "miniwob", None)  # as if not installed
    with pytest.raises(BrowserUnavailableError, match=r"^MiniWoB-v0 needs the \w+ package: pip "
                       r"install 'agentrl\[browser\]' \(miniwob==1\.1\.0, which brings "
                       r"selenium\)$"):
        gym.make(ENV_ID, tokenizer="tiny")


def test_a_missing_browser_is_one_line_naming_the_apt_packages(monkeypatch, tmp_path):
    pytest.importorskip("selenium")
    pytest.importorskip("miniwob")
    monkeypatch.setenv("PATH", str(tmp_path))  # neither chromium nor chromedriver on it
    monkeypatch.delenv("MINIWOB_CHROME_BINARY", raising=False)
    monkeypatch.delenv("MINIWOB_CHROMEDRIVER", raising=False)
    from environments.miniwob.env import MiniWoBEnv

    with pytest.raises(BrowserUnavailableError) as e:
        MiniWoBEnv.preflight(task="click-button")  # what `agentrl train` can run first
    with pytest.raises(BrowserUnavailableError, match=f"^{re.escape(str(e.value))}$"):
        gym.make(ENV_ID, tokenizer="tiny")
    assert str(e.value) == ("MiniWoB-v0 needs Chromium and its WebDriver, but chromium and "
                            "chromedriver are not installed: apt-get install -y chromium "
                            "chromium-driver (or set MINIWOB_CHROME_BINARY and "
                            "MINIWOB_CHROMEDRIVER)")


# A real browser.


def _ref_of(listing: str, pattern: str) -> int:
    m = re.search(rf"^\[(-?\d+)\] {pattern}", listing, flags=re.MULTILINE)
    assert m, f"no line matching {pattern!r} in:\n{listing}"
    return int(m.group(1))


def _quoted(task_line: str) -> str:
    return re.search(r'"([^"]+)"', task_line).group(1)


def test_the_scripted_policy_reads_the_listing():
    from environments.miniwob.oracle import oracle_action, parse_listing

    lines = ['[4] button "Ok"', '[5] div "ultricies"', '[7] input_text value="" (focused)',
             '[8] input_password value="a \\"b\\""', '[9] button "submit"', "not a line"]
    assert [(e.ref, e.tag, e.text, e.value) for e in parse_listing(lines)] == [
        (4, "button", "Ok", None), (5, "div", "ultricies", None), (7, "input_text", "", ""),
        (8, "input_password", "", 'a "b"'), (9, "button", "submit", None)]
    assert oracle_action("click-button", 'Click on the "submit" button.', lines) == "click(9)"
    # A form: the first field whose value is not yet right, then the button.
    login = 'Enter the username "x" and the password "pw" into the text fields and press login.'
    assert oracle_action("login-user", login, lines + ['[10] button "Login"']) == 'type(7, "x")'
    filled = ['[7] input_text value="x"', '[8] input_password value="pw"', '[10] button "Login"']
    assert oracle_action("login-user", login, filled) == "click(10)"
    with pytest.raises(KeyError, match="no scripted policy for MiniWoB.. task 'book-flight'"):
        oracle_action("book-flight", "Book the shortest one-way flight.", lines)


@pytest.fixture(scope="module", autouse=True)
def _no_browser_left():
    """Browsers given back to the pool are closed when the module ends (later tests count
    this process's children)."""
    yield
    from environments.miniwob.pool import close_pool

    close_pool()


@pytest.fixture(scope="module")
def dom_env():
    if UNAVAILABLE:
        pytest.skip(f"no browser here: {UNAVAILABLE}")
    from environments.miniwob.env import MiniWoBEnv

    env = MiniWoBEnv(task="click-basics", max_turns=4)
    yield env
    env.close()


@browser
def test_gym_make_builds_it_and_the_checker_passes(tiny_tokenizer):
    env = gym.make(ENV_ID, tokenizer=tiny_tokenizer, task="click-button")
    try:
        check_env(env.unwrapped, skip_render_check=True)
        assert "miniwob" in [a for e in agentrl.list_envs() if e.id == ENV_ID for a in e.aliases]
    finally:
        env.close()


@browser
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_scripted_click_solves_click_button(dom_env, seed):
    (*_, msg), info = dom_env.reset(seed=seed, options={"task": "click-button"})
    text = msg["content"]
    assert info["task"] == "click-button" and text.startswith("Task: Click on the")
    label = _quoted(text.split("Task: ")[1].splitlines()[0])
    ref = _ref_of(text, f'button "{re.escape(label)}"')
    new, reward, terminated, truncated, info = dom_env.step(f"The button is [{ref}].\nclick({ref})")
    assert (new, terminated, truncated) == ([], True, False)
    assert reward == pytest.approx(0.9)  # MiniWoB's 1, scaled by the time left: 1 - 1 s / 10 s
    assert info["correct"] and info["raw_reward"] == 1.0 and info["turns"] == 1


@browser
def test_the_scripted_policy_solves_both_suites_on_held_out_pages(tiny_tokenizer):
    """Every task of click-basics and of the warm-up suite, two held-out pages each, played by
    `oracle_action` through the token bridge (`play_scripted`); screenshot mode, which has no
    listing to read, is refused."""
    from agentrl.rollout.scripted import play_scripted
    from environments.miniwob.env import MiniWoBEnv
    from environments.miniwob.tasks import SUITES

    tasks = SUITES["click-basics"] + SUITES["warm-up"]
    out = play_scripted(
        lambda: gym.make(ENV_ID, tokenizer=tiny_tokenizer, task="click-basics,warm-up",
                         split="eval"),
        range(2 * len(tasks)), max_turns=4, options=lambda i: {"task": tasks[i % len(tasks)]})
    assert out.discarded == 0
    assert sorted((t.info["task"], t.info["correct"]) for t in out.trajectories) == sorted(
        (task, True) for task in tasks * 2)
    env = MiniWoBEnv(task="click-button", observation="screenshot")
    try:
        env.reset(seed=0)
        with pytest.raises(ValueError, match="reads the page listing"):
            env.oracle_action()
    finally:
        env.close()


def test_the_example_exchange_is_an_action_on_its_own_page():
    from environments.miniwob.env import EXAMPLE_ANSWER, EXAMPLE_PAGE, MiniWoBEnv

    action = act.parse_action(EXAMPLE_ANSWER)
    assert isinstance(action, act.ClickRef) and act.action_line(EXAMPLE_ANSWER) == EXAMPLE_ANSWER
    target = _ref_of(EXAMPLE_PAGE, r'a "Settings"')  # the element the example's task names
    assert action.ref == target and EXAMPLE_PAGE.startswith('Task: Open the "Settings" page.')
    with pytest.raises(ValueError, match=r"^example=True needs a page listing: use "
                                         r"observation='dom' or 'both', or example=False"):
        MiniWoBEnv(observation="screenshot", example=True)


@browser
def test_the_first_observation_shows_one_example_exchange(dom_env, tiny_tokenizer):
    from environments.miniwob.env import EXAMPLE_ANSWER, EXAMPLE_PAGE, MiniWoBEnv, instructions

    messages, _ = dom_env.reset(seed=0, options={"task": "click-button"})
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user"]
    assert [m["content"] for m in messages[:3]] == [instructions("dom"), EXAMPLE_PAGE,
                                                   EXAMPLE_ANSWER]
    assert messages[3]["content"].startswith('Task: Click on the "')
    # Through the chat bridge: the example comes before the page, in the prompt's tokens.
    env = gym.make(ENV_ID, tokenizer=tiny_tokenizer, task="click-button")
    try:
        obs, _ = env.reset(seed=0)
        prompt = tiny_tokenizer.decode(obs["tokens"])
        assert prompt.index(EXAMPLE_PAGE) < prompt.index(EXAMPLE_ANSWER) < prompt.index(
            'Task: Click on the "')
    finally:
        env.close()
    # Without it (and in screenshot mode, which cannot have it): one user message.
    plain = MiniWoBEnv(task="click-button", example=False)
    try:
        [msg], _ = plain.reset(seed=0)
        assert msg["content"].startswith(instructions("dom") + "\n\nTask: Click on the")
    finally:
        plain.close()
    assert MiniWoBEnv(observation="screenshot").example is False
    assert MiniWoBEnv(observation="both").example is True


@browser
def test_typing_and_a_wrong_click(dom_env):
    (*_, msg), _ = dom_env.reset(seed=5, options={"task": "enter-text"})
    text = msg["content"]
    word = _quoted(text.split("Task: ")[1].splitlines()[0])
    field, submit = _ref_of(text, "input_text"), _ref_of(text, 'button "Submit"')
    [msg], reward, terminated, _, _ = dom_env.step(f'type({field}, "{word}")')
    assert (reward, terminated) == (0.0, False)
    assert f'[{field}] input_text value="{word}" (focused)' in msg["content"]
    _, reward, terminated, _, info = dom_env.step(f"click({submit})")
    assert terminated and reward == pytest.approx(0.8) and info["correct"]
    # A wrong answer is MiniWoB's -1.
    (*_, msg), _ = dom_env.reset(seed=6, options={"task": "enter-text"})
    _, submit = _ref_of(msg["content"], "input_text"), _ref_of(msg["content"], 'button "Submit"')
    _, reward, terminated, _, info = dom_env.step(f"click({submit})")
    assert terminated and reward == -1.0 and not info["correct"]


@browser
def test_a_select_and_icons_on_real_pages(dom_env):
    (*_, msg), _ = dom_env.reset(seed=3, options={"task": "choose-list"})
    text = msg["content"]
    choice = re.search(r"Select (.+) from the list", text).group(1)
    select = _ref_of(text, r'select value="[^"]*" options: .*"' + re.escape(choice) + '"')
    [msg], _, _, _, _ = dom_env.step(f'type({select}, "Atlantis")')
    assert msg["content"].startswith(f'type({select}, "Atlantis") failed: it has no option '
                                     '"Atlantis"; its options are listed after it.')
    [msg], _, _, _, _ = dom_env.step(f'type({select}, "{choice}")')
    assert f'[{select}] select value="{choice}"' in msg["content"]
    _, reward, terminated, _, info = dom_env.step(f"click({_ref_of(text, 'button')})")
    assert terminated and info["correct"] and reward == pytest.approx(0.7)
    (*_, msg), _ = dom_env.reset(seed=0, options={"task": "email-inbox"})
    text = msg["content"]
    assert len(re.findall(r'^\[\d+\] span icon "star"$', text, flags=re.MULTILINE)) >= 3
    assert len(re.findall(r'^\[\d+\] span icon "trash"$', text, flags=re.MULTILINE)) >= 3
    (*_, msg), _ = dom_env.reset(seed=0, options={"task": "click-color"})
    assert len(re.findall(r'^\[\d+\] div background="#[0-9a-f]{6}"$', msg["content"],
                          flags=re.MULTILINE)) >= 2
    (*_, msg), _ = dom_env.reset(seed=0, options={"task": "click-dialog"})
    assert "resizable" not in msg["content"]  # no handler of its own: not a control


@browser
def test_malformed_and_impossible_actions_are_feedback_and_cost_a_turn(dom_env):
    dom_env.reset(seed=3, options={"task": "click-button"})
    for i, (answer, feedback) in enumerate([
        ("I will press the button", "No action in your answer's last line"),
        ("click(999)", ("click(999) failed: there is no element [999] on the page; use a ref "
                        "from the latest listing.")),
        ("click(5, 500)", ("click(5, 500) failed: (5, 500) is off the screen, which is 160 x "
                           "210 pixels.")),
    ], start=1):
        [msg], reward, terminated, truncated, info = dom_env.step(answer)
        assert (reward, terminated, truncated, info["turns"]) == (0.0, False, False, i)
        assert msg["content"].startswith(feedback)
        assert "\nTask: Click on the " in msg["content"] and "\nPage:\n[" in msg["content"]
    # max_turns=4: the fourth turn is the last; the task did not end, so MiniWoB's -1.
    new, reward, terminated, truncated, info = dom_env.step("done")
    assert (new, reward, terminated, truncated) == ([], -1.0, False, True)
    assert info["reason"] == "turn budget ran out" and not info["correct"]
    with pytest.raises(RuntimeError, match="call reset"):
        dom_env.step("click(1)")


@browser
def test_done_ends_the_episode_and_the_steps_clock_times_out(dom_env):
    dom_env.reset(seed=4, options={"task": "focus-text"})
    _, reward, terminated, truncated, info = dom_env.step("done()")
    assert (reward, terminated, truncated) == (-1.0, True, False)
    assert info["reason"] == "done() before the task ended"
    from environments.miniwob.env import MiniWoBEnv

    env = MiniWoBEnv(task="focus-text", step_s=4.0)  # 10 s: the third turn is at 12 s
    try:
        env.reset(seed=0)
        assert env.step("hmm")[2:4] == (False, False)
        assert env.step("hmm")[2:4] == (False, False)
        _, reward, terminated, _, info = env.step("click(4)")
        assert (reward, terminated, info["reason"]) == (-1.0, True, "timed out")
    finally:
        env.close()


@browser
def test_the_wall_clock_is_miniwobs_own():
    from environments.miniwob.env import MiniWoBEnv

    env = MiniWoBEnv(task="click-button", clock="wall", time_limit_s=0.3)
    try:
        (*_, msg), info = env.reset(seed=0)
        assert info["time_limit_s"] == 0.3
        time.sleep(0.6)  # the policy thinks; the page's timer runs out
        ref = _ref_of(msg["content"], "button")
        _, reward, terminated, _, info = env.step(f"click({ref})")
        assert (reward, terminated, info["reason"]) == (-1.0, True, "timed out")
    finally:
        env.close()


@browser
@pytest.mark.slow  # the first vision-language model's processor takes seconds to load
def test_screenshots_reach_the_policy_through_the_bridge():
    from agentrl.models import load_tokenizer

    env = gym.make(ENV_ID, tokenizer=load_tokenizer("tiny-qwen2-vl"), task="click-button",
                   observation="screenshot")
    try:
        obs, _ = env.reset(seed=0)
        [image] = obs["images"]
        assert image.shape == (210, 160, 3)
        assert image in env.observation_space["images"].feature_space
        assert image.std() > 10  # a page, not a blank
        vision = env.unwrapped.bridge._vision
        assert sum(t == vision.image_token_id for t in obs["tokens"]) == vision.encode(
            image).num_tokens
        chat = env.unwrapped.chat_env
        text = chat._look(chat._episode)[0]  # what the page holds (dom is not shown here)
        assert text.startswith("Task: Click on the")
        tok = env.unwrapped.tokenizer
        action = tok.encode("click(999)", add_special_tokens=False)
        obs, _, terminated, _, _ = env.step(action)
        assert not terminated and len(obs["images"]) == 1
        assert "screenshot mode shows no refs" in tok.decode(obs["tokens"])
    finally:
        env.close()


@browser
def test_pickled_mid_episode_the_copy_replays_and_goes_on_alike():
    from environments.miniwob.env import MiniWoBEnv

    env = MiniWoBEnv(task="enter-text")
    (*_, msg), _ = env.reset(seed=11)
    word = _quoted(msg["content"].split("Task: ")[1].splitlines()[0])
    field, submit = _ref_of(msg["content"], "input_text"), _ref_of(msg["content"], 'button "Sub')
    env.step(f'type({field}, "{word}")')
    copy = pickle.loads(pickle.dumps(env))
    try:
        assert copy._browser is None
        a, b = env.step("not yet"), copy.step("not yet")
        assert a == b
        a, b = env.step(f"click({submit})"), copy.step(f"click({submit})")
        assert a == b and a[1] == pytest.approx(0.7) and a[4]["correct"]
    finally:
        env.close()
        copy.close()


@browser
def test_close_gives_the_browser_back_and_the_pool_leaves_no_process():
    from environments.miniwob.env import MiniWoBEnv
    from environments.miniwob.pool import browser_pool, close_pool

    close_pool()
    pool = browser_pool()
    env = MiniWoBEnv(task="click-button")
    env.reset(seed=0)
    browser_ = env._browser
    pids = sorted(browser_.processes())
    names = {Path(f"/proc/{p}/comm").read_text().strip() for p in pids}
    assert {"chromedriver", "chromium"} <= names, names
    env.close()
    assert env._browser is None and pool.idle == 1 and all(map(alive, pids))
    # The next env takes the running browser: no start, the page is restarted, not reloaded.
    started, reused = pool.stats.started, pool.stats.reused
    again = MiniWoBEnv(task="click-button")
    t0 = time.monotonic()
    (*_, msg), _ = again.reset(seed=1)
    took = time.monotonic() - t0
    assert again._browser is browser_ and "Task: Click on the" in msg["content"]
    assert (pool.stats.started, pool.stats.reused) == (started, reused + 1)
    assert took < 1.0, took  # starting a browser alone takes over 1 s here
    again.close()
    again.close()  # again: nothing to do
    close_pool()
    assert pool.idle == 0 and still_alive(pids, within_s=3.0) == []
    assert browser_.processes() == set() and not Path(browser_.profile).exists()


@browser
def test_concurrent_episodes_each_hold_their_own_browser_and_a_dead_one_is_replaced():
    from concurrent.futures import ThreadPoolExecutor

    from environments.miniwob.env import MiniWoBEnv
    from environments.miniwob.pool import browser_pool, close_pool

    close_pool()
    pool = browser_pool()
    envs = [MiniWoBEnv(task="click-button") for _ in range(3)]
    try:
        with ThreadPoolExecutor(3) as ex:  # as a rollout's episode threads reset them
            list(ex.map(lambda e: e[1].reset(seed=e[0]), enumerate(envs)))
        browsers = [e._browser for e in envs]
        assert len({id(b) for b in browsers}) == 3
        assert not set.intersection(*(b.processes() for b in browsers))
        assert len({b.profile for b in browsers}) == 3  # private profiles: nothing shared
        for env in envs:
            env.close()
        assert pool.idle == 3  # the pool is as large as the concurrency was
        # An idle browser crashes (its processes are killed): the next env does not get it.
        dead = pool._idle[-1]
        dead_pids = sorted(dead.processes())
        for pid in dead_pids:
            os.kill(pid, signal.SIGKILL)
        replaced = pool.stats.replaced
        (*_, msg), _ = envs[0].reset(seed=7)
        assert envs[0]._browser is not dead and dead.closed
        assert pool.stats.replaced == replaced + 1 and "Task: Click on the" in msg["content"]
        assert still_alive(dead_pids, within_s=3.0) == []
    finally:
        for env in envs:
            env.close()
        close_pool()


@browser
def test_a_browser_that_crashes_mid_episode_discards_only_that_episode(tiny_tokenizer):
    """Through the rollout loop: the episode whose browser dies ends discarded with the reason
    (kept out of training, counted in the trainer's `discarded` metric); the others go on,
    and the dead browser is replaced."""
    from agentrl.completion import SamplingParams
    from agentrl.engine.fakes import FakeEngine
    from agentrl.rollout import collect_sync
    from environments.miniwob.pool import browser_pool, close_pool

    close_pool()
    started = browser_pool().stats.started
    envs, killed = [], []

    def make():
        env = gym.make(ENV_ID, tokenizer=tiny_tokenizer, task="click-button")
        envs.append(env.unwrapped.chat_env)
        return env

    def policy(prompt: str, _choice: int) -> str:
        last = prompt.rsplit("Task: ", 1)[1]
        if not killed:  # the first episode's browser dies while its policy thinks
            killed.extend(envs[0]._browser.processes())
            for pid in killed:
                os.kill(pid, signal.SIGKILL)
        ref = _ref_of(last, 'button "' + re.escape(_quoted(last)) + '"')
        return f"click({ref})"

    trajs = collect_sync(FakeEngine(tiny_tokenizer, reply=policy), make, num_prompts=3,
                         sampling=SamplingParams(max_tokens=64), max_concurrency=1)
    try:
        assert [t.discard for t in trajs] == [True, False, False] and killed
        info = trajs[0].info
        assert info["browser_failure"] == "crashed" and "the browser failed" in info["error"]
        assert all(t.info["correct"] for t in trajs[1:])
        assert still_alive(killed, within_s=3.0) == []
        assert browser_pool().stats.started - started == 2  # the dead one, its replacement
    finally:
        close_pool()


@browser
def test_a_killed_parent_leaves_no_browser_process(tmp_path):
    """The reaper ends every browser of a process that is SIGKILLed (it never gets to close()
    or its exit handlers): those in episodes and those idle in the pool."""
    script = tmp_path / "parent.py"
    script.write_text(textwrap.dedent("""
        import json, sys, time
        from concurrent.futures import ThreadPoolExecutor
        from environments.miniwob.env import MiniWoBEnv
        envs = [MiniWoBEnv(task="click-button") for _ in range(2)]
        with ThreadPoolExecutor(2) as ex:
            list(ex.map(lambda e: e.reset(seed=0), envs))
        pids = sorted(p for e in envs for p in e._browser.processes())
        profiles = [e._browser.profile for e in envs]
        envs[1].close()  # idle in the pool
        print(json.dumps([pids, profiles]), flush=True)
        time.sleep(60)
    """))
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True,
                            cwd=Path(__file__).parents[2])
    try:
        pids, profiles = json.loads(proc.stdout.readline())
        assert len(pids) >= 6 and all(map(alive, pids))
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    assert still_alive(pids, within_s=5.0) == []
    # Nor any other process of those browsers (found by their private profiles).
    from environments.miniwob.browser import _naming

    assert still_alive(sorted(set().union(*map(_naming, profiles))), within_s=3.0) == []


_RAY_DRIVER = """
import json, os, time
from concurrent.futures import ThreadPoolExecutor
import ray
from trainers.ray_utils import init_ray
init_ray(num_cpus=1)

@ray.remote
class Rollout:  # where a trainer's episodes, and so their browsers, run
    def start(self):
        from environments.miniwob.env import MiniWoBEnv
        self.envs = [MiniWoBEnv(task="click-button") for _ in range(2)]
        with ThreadPoolExecutor(2) as ex:
            list(ex.map(lambda e: e.reset(seed=0), self.envs))
        pids = sorted(p for e in self.envs for p in e._browser.processes())
        profiles = [e._browser.profile for e in self.envs]
        self.envs[1].close()  # idle in the pool
        return [os.getpid(), pids, profiles]

actor = Rollout.remote()
print(json.dumps(ray.get(actor.start.remote())), flush=True)
time.sleep(600)
"""


@browser
@pytest.mark.ray
@pytest.mark.slow  # a private Ray cluster starts in 10-30 s here
def test_a_killed_trainer_leaves_no_browser_of_its_ray_workers():
    """kill -9 of the driver: Ray's fate sharing ends its worker, whose group reaper then ends
    the worker's browsers (in an episode and idle in the pool), and the cluster's reaper the
    rest of Ray."""
    from environments.miniwob.browser import _naming

    ray_tmp = Path("/tmp") / f"agentrl-miniwob-kill-{os.getpid()}"
    env = {**os.environ, "AGENTRL_RAY_TMP": str(ray_tmp), "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-c", _RAY_DRIVER], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True, cwd=Path(__file__).parents[2])
    try:
        worker, pids, profiles = json.loads(proc.stdout.readline())
        assert len(pids) >= 6 and all(map(alive, [worker, *pids]))
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    try:
        assert still_alive([worker, *pids], within_s=30.0) == []
        assert still_alive(sorted(set().union(*map(_naming, profiles))), within_s=3.0) == []
    finally:
        import shutil

        shutil.rmtree(ray_tmp, ignore_errors=True)


@browser
def test_a_hung_page_fails_the_episode_with_the_reason_and_the_next_reset_recovers():
    from environments.miniwob.env import MiniWoBEnv

    env = MiniWoBEnv(task="click-button", timeout_s=3.0)
    try:
        env.reset(seed=0)
        hung = env._browser
        pids = hung.processes()
        # The page hangs in the next click (a task's script looping forever).
        hung.driver.execute_script("core.elementClick = function () { while (true) {} };")
        t0 = time.monotonic()
        new, reward, terminated, truncated, info = env.step("click(4)")
        assert time.monotonic() - t0 < 8
        assert (new, reward, terminated, truncated) == ([], 0.0, False, True)
        assert info["discard"] and info["browser_failure"] == "timeout"
        assert "did not answer within 3 s (hung)" in info["error"]
        assert still_alive(pids, within_s=3.0) == []
        (*_, msg), _ = env.reset(seed=0)  # a new browser
        assert env._browser is not hung and "Task: Click on the" in msg["content"]
    finally:
        env.close()


@browser
def test_a_page_that_does_not_load_is_a_discarded_episode_with_the_reason(
        monkeypatch, tmp_path, tiny_tokenizer):
    from agentrl.completion import SamplingParams
    from agentrl.engine.fakes import FakeEngine
    from agentrl.rollout import collect_sync
    from environments.miniwob import page
    from environments.miniwob.browser import BrowserError
    from environments.miniwob.env import MiniWoBEnv
    from environments.miniwob.pool import close_pool

    close_pool()  # a pooled browser would still show the real page
    (tmp_path / "miniwob").mkdir()
    (tmp_path / "miniwob" / "click-button.html").write_text("<html><body>no task</body></html>")
    monkeypatch.setattr(page, "html_dir", lambda: tmp_path)
    # 3 s, not less: the timeout bounds every WebDriver call, and on a loaded 2-core machine an
    # ordinary call once took over 1 s (the test then failed on that call instead).
    env = MiniWoBEnv(task="click-button", timeout_s=3.0)
    reason = r"the page of task 'click-button' \(file://.*\) did not load within 3 s"
    try:
        with pytest.raises(BrowserError, match=f"^{reason}$") as e:
            env.reset(seed=0)
        assert e.value.kind == "load" and env._browser is None
    finally:
        env.close()
    # In a rollout: that episode is discarded with the reason, and the rollout goes on.
    [traj] = collect_sync(
        FakeEngine(tiny_tokenizer, reply="click(1)"),
        lambda: gym.make(ENV_ID, tokenizer=tiny_tokenizer, task="click-button", timeout_s=3.0),
        num_prompts=1, sampling=SamplingParams(max_tokens=8))
    assert traj.discard and traj.truncated and not traj.turns
    assert re.search(reason, traj.info["error"]), traj.info


# The commands: eval per task, rollout with screenshots, bad input before a model loads.


def test_success_per_task_with_wilson_intervals():
    from agentrl.rollout.evaluate import score_by_task, task_lines
    from agentrl.types import Trajectory, Turn

    def traj(i, task, correct, discard=False):
        return Trajectory(token_ids=[1, 2], loss_mask=[0, 1], logprobs=[0.0, 0.0],
                          turns=[Turn(obs_start=0, start=1, end=2, reward=1.0 if correct else -1)],
                          info={"prompt_index": i, "task": task, "correct": correct},
                          discard=discard)

    trajs = [traj(0, "click-button", True), traj(2, "click-button", True),
             traj(1, "focus-text", False), traj(3, "focus-text", False),
             traj(5, "focus-text", True, discard=True)]
    by_task = score_by_task(trajs, k=1)
    assert list(by_task) == ["click-button", "focus-text"]
    assert by_task["click-button"].pass_at_1 == 1.0 and by_task["focus-text"].pass_at_1 == 0.0
    lines = task_lines(by_task)
    assert lines == ["  click-button  pass@1 1.000 [0.342, 1.000] (95%) on 2 problems",
                     ("  focus-text    pass@1 0.000 [0.000, 0.658] (95%) on 2 problems, "
                      "1 discarded")]
    assert score_by_task([traj(0, None, True)], k=1) == {}


def test_train_reports_each_task_before_and_after(tmp_path):
    from agentrl.trajectory_files import save_jsonl
    from agentrl.types import Trajectory, Turn
    from trainers.controller_run import task_report

    def traj(i, task, correct):
        return Trajectory(token_ids=[1, 2], loss_mask=[0, 1], logprobs=[0.0, 0.0],
                          turns=[Turn(obs_start=0, start=1, end=2, reward=1.0 if correct else -1)],
                          info={"prompt_index": i, "task": task, "correct": correct})

    save_jsonl([traj(0, "click-button", False), traj(1, "enter-text", False),
                traj(2, "click-button", True), traj(3, "enter-text", False)],
               tmp_path / "eval_before.jsonl")
    save_jsonl([traj(0, "click-button", True), traj(1, "enter-text", True),
                traj(2, "click-button", True), traj(3, "enter-text", False)],
               tmp_path / "eval_after.jsonl")
    summary = {"run_dir": str(tmp_path), "eval_change": {"setting": {"samples_per_problem": 1}}}
    assert task_report(summary).splitlines() == [
        "held-out pass@1 per task (95% Wilson intervals over each task's problems):",
        "  click-button  before 0.500 [0.095, 0.905], after 1.000 [0.342, 1.000] on 2 problems",
        "  enter-text    before 0.000 [0.000, 0.658], after 0.500 [0.095, 0.905] on 2 problems"]
    # After a warm-up (--warmup.*), its eval between the two.
    save_jsonl([traj(0, "click-button", True), traj(1, "enter-text", False),
                traj(2, "click-button", True), traj(3, "enter-text", False)],
               tmp_path / "eval_warmup.jsonl")
    assert task_report(summary).splitlines()[1] == (
        "  click-button  before 0.500 [0.095, 0.905], after the warm-up 1.000 [0.342, 1.000], "
        "after 1.000 [0.342, 1.000] on 2 problems")
    # One task (or an env that names none): nothing to add to the overall line.
    save_jsonl([traj(0, "click-button", True)], tmp_path / "eval_after.jsonl")
    assert task_report(summary) == ""


def test_eval_and_rollout_refuse_bad_tasks_before_a_model_loads(monkeypatch, capsys, tmp_path):
    pytest.importorskip("miniwob", reason="the task list is the miniwob package's")
    from agentrl import models
    from agentrl.cli import main

    monkeypatch.setattr(models, "load_model", lambda *a, **k: pytest.fail("model was loaded"))
    monkeypatch.setattr(models, "load_tokenizer", lambda *a, **k: pytest.fail("tokenizer"))
    assert main(["eval", "--env", "miniwob", "--task", "click-buton", "--model", "tiny"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("agentrl eval: --env miniwob: unknown MiniWoB++ task 'click-buton'. "
                          "Did you mean 'click-button'")
    assert "Tasks (1" in err and err.count("\n") == 1  # one line, with the list
    out = str(tmp_path / "r.jsonl")
    assert main(["rollout", "--env", "reverse", "--task", "x", "--model", "tiny",
                 "--out", out]) == 2
    assert "--task 'x': agentrl/Reverse-v0 takes no task argument" in capsys.readouterr().err
    monkeypatch.setenv("PATH", str(tmp_path))  # no chromium, no chromedriver
    monkeypatch.delenv("MINIWOB_CHROME_BINARY", raising=False)
    monkeypatch.delenv("MINIWOB_CHROMEDRIVER", raising=False)
    assert main(["rollout", "--env", "miniwob", "--model", "tiny", "--out", out]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "apt-get install -y chromium chromium-driver" in err


@browser
def test_eval_reports_each_task_with_its_interval(capsys):
    from agentrl.cli import main

    rc = main(["eval", "--env", "miniwob", "--task", "click-button,focus-text", "--model",
               "tiny", "--num-problems", "4", "--max_turns", "1", "--max_new_tokens", "4",
               "--no-progress"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "agentrl/MiniWoB-v0 (eval) with tiny" in out and "on 4 problems" in out
    lines = out.split("per task (95% Wilson intervals over each task's problems):\n")[1]
    rows = re.findall(r"^  (\S+) +pass@1 (\d\.\d{3}) \[(\d\.\d{3}), (\d\.\d{3})\] \(95%\) on "
                      r"(\d+) problems$", lines, flags=re.MULTILINE)
    assert [r[0] for r in rows] == ["click-button", "focus-text"]
    for _, rate, low, high, problems in rows:  # problem i is task i mod 2: two each
        assert problems == "2" and float(low) <= float(rate) <= float(high)
        assert float(high) - float(low) > 0.3  # 2 problems: wide, never "+- 0"


@browser
@pytest.mark.slow  # the first vision-language model's processor takes seconds to load
def test_rollout_writes_the_screenshots(tmp_path, capsys):
    from agentrl.cli import main
    from agentrl.trajectory_files import load_jsonl

    out = tmp_path / "r.jsonl"
    rc = main(["rollout", "--env", "miniwob", "--task", "click-button", "--env_kwargs",
               '{"observation": "screenshot"}', "--model", "tiny-qwen2-vl", "-n", "1",
               "--prompts", "2", "--max_turns", "2", "--max_new_tokens", "4", "--out", str(out),
               "--no-progress"])
    assert rc == 0
    trajs = load_jsonl(out)
    assert len(trajs) == 2 and all(t.info["task"] == "click-button" for t in trajs)
    images = [im for t in trajs for im in t.images]
    assert len(images) >= 2 and all(im.pixels.shape == (210, 160, 3) for im in images)
    assert all(im.pixels.std() > 10 for im in images)  # pages, not blanks
    pngs = list((tmp_path / "images").glob("*.png"))
    assert pngs and f"and its {len(images)} images" in capsys.readouterr().out
