"""`agentrl view`: its index and JSON over real run layouts and proxies, and its page in a real
headless Chromium (Debian's, through Selenium and /usr/bin/chromedriver; skipped without)."""

from __future__ import annotations

import contextlib
import json
import os
import random
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from servers.viewer import render
from servers.viewer.app import Viewer, serve, serving
from servers.viewer.cli import ViewArgs, main, open_viewer
from tests.servers.viewer_data import PAYLOAD, big_run, small_run, trajectory_of

FIRST_PAGE_S = 1.0
TURN_S = 0.5


@pytest.fixture
def run(tmp_path, tok) -> Path:
    return small_run(tmp_path, tok)


def viewer_of(target: str | Path, tmp_path: Path, tokenizer: str = "") -> Viewer:
    viewer = open_viewer(ViewArgs(target=str(target), tokenizer=tokenizer), tmp_path)
    viewer.decoder.wait()
    return viewer


# ------------------------------------------------------------------------- bad input
def test_not_a_run_is_one_line(tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("hello\n")
    assert main([str(tmp_path)]) == 2
    assert main([str(tmp_path / "missing")]) == 2
    assert main([str(tmp_path / "notes.txt")]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 3
    assert lines[0].startswith(f"agentrl view: {tmp_path} is not a run: it holds no rollouts/")
    assert "no such file or directory" in lines[1]
    assert "neither JSON lines nor an SQLite sessions file" in lines[2]


def test_half_written_run_shows_the_completed_steps(run, tmp_path):
    viewer = viewer_of(run, tmp_path)
    steps = {s["key"]: s for s in viewer.run()["steps"]}
    assert steps["1"]["metrics"]["mismatch"] == 0.0012
    assert steps["2"]["episodes"] == 2 and steps["2"]["metrics"] is None  # torn lines left out
    # The writer finishes the line: the next look shows it.
    full = (run / "rollouts" / "step_000001.jsonl").read_text().splitlines()[2]
    path = run / "rollouts" / "step_000002.jsonl"
    path.write_text(path.read_text()[: -100] + full + "\n")
    assert {s["key"]: s for s in viewer.run()["steps"]}["2"]["episodes"] == 3


def test_corrupt_line_is_named_and_the_rest_browsable(run, tmp_path):
    viewer = viewer_of(run, tmp_path)
    page = viewer.episodes({"step": "1", "corrupt": "only"})
    assert page["total"] == 1
    assert page["rows"][0]["corrupt"].startswith("step_000001.jsonl:8: JSONDecodeError")
    with pytest.raises(ValueError, match=r"step_000001\.jsonl:8"):
        viewer.episode({"step": "1", "line": "8"})
    assert viewer.episode({"step": "1", "line": "7"})["summary"]["drift"] is True


def test_filters_and_paging(run, tmp_path):
    viewer = viewer_of(run, tmp_path)
    page = viewer.episodes
    assert [r["line"] for r in page({"step": "1", "rmin": "0.5"})["rows"]] == [1, 3]
    assert [r["line"] for r in page({"step": "1", "discarded": "only"})["rows"]] == [5]
    assert page({"step": "1", "discarded": "only"})["rows"][0]["reason"] == \
        "SandboxError('bwrap failed')"
    assert [r["line"] for r in page({"step": "1", "drift": "only"})["rows"]] == [7]
    assert [r["line"] for r in page({"step": "1", "task": "CHAT"})["rows"]] == [6, 7]
    every = page({"step": "all", "task": "adder", "limit": "3", "offset": "2"})
    assert every["total"] == 6 and [(r["step"], r["line"]) for r in every["rows"]] == [
        ("1", 3), ("1", 4), ("2", 1)]
    with pytest.raises(ValueError, match="discarded must be any, only or none"):
        page({"step": "1", "discarded": "yes"})


@pytest.mark.parametrize("estimator", render.GROUP_ESTIMATORS)
def test_group_advantages_match_the_library(estimator):
    import torch

    from agentrl.algorithms import compute_advantages

    rng = random.Random(estimator)
    rewards = [float(rng.randint(0, 3)) for _ in range(24)]
    rewards[16:20] = [1.0] * 4  # a group that scored all equal: no signal
    groups = [i // 4 for i in range(24)]
    summaries = [{"line": i + 1, "episode": f"e{i}", "group": f"g{g}", "reward": r,
                  "discard": False, "corrupt": None}
                 for i, (r, g) in enumerate(zip(rewards, groups, strict=True))]
    mine = render.group_advantages(estimator, summaries)
    rewards_BT = torch.zeros(24, 3)
    rewards_BT[:, -1] = torch.tensor(rewards)
    adv_BT, _ = compute_advantages(estimator, rewards_BT=rewards_BT, mask_BT=torch.ones(24, 3),
                                   group_ids_B=torch.tensor(groups))
    assert [mine[i + 1] for i in range(24)] == pytest.approx(adv_BT[:, 0].tolist(), abs=1e-5)
    assert render.group_advantages("gae", summaries) == {}


def test_turn_tokens_are_the_files(run, tmp_path, tok):
    viewer = viewer_of(run, tmp_path)
    turn = viewer.turn({"step": "1", "line": "1", "turn": "1"})
    traj = trajectory_of(run / "rollouts" / "step_000001.jsonl", 1)
    t = traj.turns[1]
    assert [a[0] for a in turn["action"]] == traj.token_ids[t.start:t.end]
    ids = traj.token_ids[t.start:t.end]
    assert [a[1] for a in turn["action"]] == [tok.decode([i]) for i in ids]
    assert [a[2] for a in turn["action"]] == pytest.approx(traj.logprobs[t.start:t.end])
    assert [a[3] for a in turn["action"]] == traj.token_versions()[t.start:t.end] == [4, 4, 5, 5,
                                                                                      5, 5, 5]
    assert "".join(o[1] for o in turn["observation"]) == f"tool: {PAYLOAD}\n"
    calls = viewer.turn({"step": "1", "line": "1", "turn": "0"})["tool_calls"]
    assert calls == [{"name": "add", "error": "", "arguments": '{"a": 2, "b": 3}'}]


def _trained_step_1(run: Path) -> tuple[list, list]:
    """The trainer's side of step 1 as the trainer writes it (`agentrl.trained_files`): lines 1
    and 3 trained, with log-probs 0.25 below the sampler's and an advantage of 2 (line 1) and
    -1 (line 3) on every token; the others not trained."""
    from agentrl.trained_files import Trained, save_trained, trained_file_of, trained_tokens

    rollouts = run / "rollouts" / "step_000001.jsonl"
    sampled = [trajectory_of(rollouts, n) for n in range(1, 8)]
    records = [Trained(t.uid, len(t.token_ids),
                       [t.logprobs[i] - 0.25 for i in trained_tokens(t.loss_mask)],
                       [adv] * len(trained_tokens(t.loss_mask)))
               for t, adv in ((sampled[0], 2.0), (sampled[2], -1.0))]
    save_trained(trained_file_of(rollouts), sampled, records)
    return sampled, records


def test_trainers_file_gives_mismatch_and_advantages(run, tmp_path):
    sampled, _ = _trained_step_1(run)
    viewer = viewer_of(run, tmp_path)
    steps = {s["key"]: s for s in viewer.run()["steps"]}
    assert steps["1"]["trained"] is True and steps["2"]["trained"] is False
    turn = viewer.turn({"step": "1", "line": "1", "turn": "1"})
    t = sampled[0].turns[1]
    assert turn["mismatch_recorded"] and turn["trained_note"] == ""
    assert [a[5] for a in turn["action"]] == pytest.approx([0.25] * (t.end - t.start))
    assert [a[4] for a in turn["action"]] == [2.0] * (t.end - t.start)
    rows = {r["line"]: r for r in viewer.episodes({"step": "1"})["rows"]}
    # The trainer's advantages, not the ones recomputed from the rewards (1.306 for line 1).
    assert (rows[1]["advantage"], rows[3]["advantage"], rows[2]["advantage"]) == (2.0, -1.0, None)
    assert viewer.episode({"step": "1", "line": "3"})["advantage_source"] == "trainer"
    assert [m["advantage"] for m in viewer.group({"step": "1", "group": "s0-0"})["members"]] == [
        2.0, None, -1.0, None]
    untrained = viewer.turn({"step": "1", "line": "2", "turn": "1"})
    assert not untrained["mismatch_recorded"] and {a[5] for a in untrained["action"]} == {None}
    assert untrained["trained_note"] == ("the step did not train on this episode (discarded or "
                                         "filtered out)")
    # Step 2 has no trainer's file: advantages recomputed, no mismatch, and why.
    assert viewer.episode({"step": "2", "line": "1"})["advantage_source"] == "group_norm"
    assert "no trainer's file" in viewer.turn({"step": "2", "line": "1", "turn": "1"})[
        "trained_note"]
    # The rollouts file viewed alone finds its trained/ file too.
    alone = viewer_of(run / "rollouts" / "step_000001.jsonl", tmp_path / "alone")
    key = alone.run()["steps"][0]["key"]
    assert [a[5] for a in alone.turn({"step": key, "line": "1", "turn": "1"})["action"]] == \
        pytest.approx([0.25] * (t.end - t.start))


def test_a_broken_trainers_file_is_named_and_the_rest_shows(run, tmp_path):
    from agentrl.trained_files import trained_file_of

    _trained_step_1(run)
    path = trained_file_of(run / "rollouts" / "step_000001.jsonl")
    first, second = path.read_text().splitlines()
    path.write_text(first + "\n" + second[:50])  # the second line cut short
    viewer = viewer_of(run, tmp_path)
    assert viewer.turn({"step": "1", "line": "1", "turn": "1"})["mismatch_recorded"]
    note = viewer.turn({"step": "1", "line": "3", "turn": "1"})["trained_note"]
    assert note.startswith("no trainer's line for this episode; the trainer's file has 1 "
                           "unreadable line(s), the first step_000001.jsonl:2: ")
    # A line that names another episode's line: refused with why, the rollout still shows.
    path.write_text(first.replace('"line": 1', '"line": 4') + "\n")
    turn = viewer.turn({"step": "1", "line": "4", "turn": "1"})
    assert not turn["mismatch_recorded"] and turn["action"]
    assert turn["trained_note"].startswith("the trainer's line for this episode does not fit "
                                           "it: its uid/num_tokens")
    assert viewer.episodes({"step": "1"})["total"] == 8


def test_sessions_file_and_live_proxy(make_proxy, tmp_path, tok):
    from servers.cli import vocabulary_id
    from servers.durable import SqliteSessionStore

    store = SqliteSessionStore(tmp_path / "s.sqlite", tokenizer_id=vocabulary_id(tok))
    proxy = make_proxy(store=store)
    with proxy.client("alpha") as client:
        client.chat.completions.create(model="agentrl", max_tokens=6, messages=[
            {"role": "user", "content": PAYLOAD}])
    store.flush()
    exported = [json.loads(x) for x in
                __import__("httpx").get(f"{proxy.url}/export").text.splitlines()]
    for target in (tmp_path / "s.sqlite", proxy.url + "/v1"):  # the store, held by the server
        viewer = viewer_of(target, tmp_path / str(hash(str(target))), tokenizer="tiny")
        (step,) = viewer.run()["steps"]
        assert step["episodes"] == 1
        turn = viewer.turn({"step": step["key"], "line": "1", "turn": "0"})
        t = exported[0]["turns"][0]
        assert [a[0] for a in turn["action"]] == exported[0]["token_ids"][t["start"]:t["end"]]
        assert PAYLOAD in "".join(o[1] for o in turn["observation"])


# ------------------------------------------------------------------------- the browser
@pytest.fixture(scope="module")
def browser() -> Iterator[object]:
    """MiniWoB's headless Chromium (its processes never outlive it), offline but for the
    loopback, where the viewer is."""
    try:
        from environments.miniwob import browser as miniwob_browser
    except ImportError as e:
        pytest.skip(f"no browser support: {e}")

    def loopback_args(profile: str) -> list[str]:
        return [("--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1"
                 if a.startswith("--host-resolver-rules=") else a)
                for a in offline_args(profile)]

    offline_args = miniwob_browser.chromium_args
    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(miniwob_browser, "chromium_args", loopback_args)
            b = miniwob_browser.Browser(timeout_s=30.0)
    except miniwob_browser.BrowserUnavailableError as e:
        pytest.skip(str(e))
    try:
        b.driver.set_window_size(1800, 1000)
        yield b
    finally:
        b.close()
    assert not b.processes(), "the browser left processes behind"


@contextlib.contextmanager
def served(viewer: Viewer) -> Iterator[str]:
    server = serve(viewer, "127.0.0.1", 0)
    gen = serving(server)
    url = next(gen)
    try:
        yield url
    finally:
        gen.close()


def wait_for(driver, css: str, count: int = 1, timeout_s: float = 10.0) -> list:
    from selenium.webdriver.common.by import By

    deadline = time.monotonic() + timeout_s
    while True:
        found = driver.find_elements(By.CSS_SELECTOR, css)
        if len(found) >= count:
            return found
        if time.monotonic() > deadline:
            raise AssertionError(f"{css}: {len(found)} of {count} elements after {timeout_s} s")
        time.sleep(0.005)


def wait_js(driver, script: str, timeout_s: float = 10.0) -> None:
    """Until `script` returns true (checked in the page: no element goes stale between)."""
    deadline = time.monotonic() + timeout_s
    while not driver.execute_script(script):
        if time.monotonic() > deadline:
            raise AssertionError(f"still false after {timeout_s} s: {script}")
        time.sleep(0.002)


def test_page_clicks_through_to_a_turn(browser, run, tmp_path, tok):
    from selenium.webdriver.common.by import By

    d = browser.driver  # type: ignore[attr-defined]
    with served(viewer_of(run, tmp_path)) as url:
        d.get(url)
        wait_for(d, "body[data-ready]")
        assert d.find_element(By.ID, "step-metrics").text.split() == [
            "reward", "0.375", "mismatch", "0.001", "kl", "0.010"]
        rows = wait_for(d, "#episodes .episode-row", 8)
        assert "step_000001.jsonl:8" in rows[7].text  # the corrupt line, named
        assert "discarded: SandboxError('bwrap failed')" in rows[4].text
        assert "segment 1 (drift)" in rows[6].text
        rows[0].click()
        wait_for(d, ".turn-button", 2)[1].click()
        wait_js(d, "const h = document.querySelector('#turn h3'); "
                   "return h !== null && h.textContent.startsWith('Turn 1')")
        traj = trajectory_of(run / "rollouts" / "step_000001.jsonl", 1)
        t = traj.turns[1]
        spans = d.find_elements(By.CSS_SELECTOR, "#action .tok")
        assert [int(s.get_attribute("data-id")) for s in spans] == traj.token_ids[t.start:t.end]
        assert [s.get_attribute("textContent") for s in spans] == [
            tok.decode([i]) for i in traj.token_ids[t.start:t.end]]
        assert [float(s.get_attribute("data-logprob")) for s in spans] == pytest.approx(
            traj.logprobs[t.start:t.end])
        # The tool output's markup is text on the page, and none of it ran.
        assert d.find_element(By.ID, "observation").get_attribute("textContent") == \
            f"tool: {PAYLOAD}\n"
        assert "null" not in d.find_element(By.ID, "detail-pane").text.split()
        assert d.execute_script("return window.__pwned === undefined "
                                "&& document.scripts.length === 1 "
                                "&& document.querySelectorAll('#turn img:not(.shot)').length === 0")
        shot = d.find_element(By.CSS_SELECTOR, "#turn img.shot")
        assert d.execute_script("return arguments[0].naturalWidth", shot) == 32
        d.find_element(By.ID, "open-group").click()
        samples = wait_for(d, "#side-by-side .sample", 4)
        assert "advantage 1.306" in samples[0].text and "the sum is 4" in samples[0].text
        d.execute_script("document.querySelectorAll('section').forEach(s => s.scrollLeft = 0)")
        d.save_screenshot(str(tmp_path / "viewer.png"))
        if os.environ.get("AGENTRL_VIEWER_SCREENSHOT"):  # docs/images/viewer.png
            d.save_screenshot(os.environ["AGENTRL_VIEWER_SCREENSHOT"])
    assert (tmp_path / "viewer.png").stat().st_size > 10_000


def test_page_shows_the_trainers_mismatch_and_advantage(browser, run, tmp_path):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    _trained_step_1(run)
    d = browser.driver  # type: ignore[attr-defined]
    with served(viewer_of(run, tmp_path)) as url:
        d.get(url)
        wait_for(d, "body[data-ready]")
        assert "(the trainer's, from trained/)" in d.find_element(By.ID, "run-meta").text
        rows = wait_for(d, "#episodes .episode-row", 8)
        assert [r.find_elements(By.TAG_NAME, "td")[4].text for r in rows[:3]] == [
            "2", "", "-1"]
        rows[0].click()
        wait_js(d, "const h = document.querySelector('#episode h2'); "
                   "return h !== null && h.textContent.includes('line 1)')")
        assert "advantage 2 (the trainer's)" in d.find_element(By.ID, "episode").text
        wait_for(d, ".turn-button", 2)[1].click()
        wait_js(d, "const h = document.querySelector('#turn h3'); "
                   "return h !== null && h.textContent.startsWith('Turn 1')")
        spans = d.find_elements(By.CSS_SELECTOR, "#action .tok")
        assert [float(s.get_attribute("data-mismatch")) for s in spans] == pytest.approx(
            [0.25] * len(spans))
        assert "sampler minus trainer log-prob" in d.find_element(By.ID, "mismatch-note").text
        Select(d.find_element(By.ID, "colour")).select_by_value("mismatch")
        colours = d.execute_script("return [...document.querySelectorAll('#action .tok')]"
                                   ".map(s => s.style.background)")
        assert len(set(colours)) == 1 and colours[0] != ""
        d.find_elements(By.CSS_SELECTOR, "#episodes .episode-row")[1].click()
        wait_js(d, "const n = document.getElementById('mismatch-note'); return n !== null && "
                   "n.textContent.includes('did not train on this episode')")
        assert "none (not trained on)" in d.find_element(By.ID, "episode").text


def test_ten_thousand_episodes_stay_fast(browser, tmp_path):
    from selenium.webdriver.common.by import By

    d = browser.driver  # type: ignore[attr-defined]
    t0 = time.perf_counter()
    big = big_run(tmp_path)
    t_write = time.perf_counter() - t0
    t0 = time.perf_counter()
    viewer = open_viewer(ViewArgs(target=str(big)), tmp_path)  # one pass over every file
    t_index = time.perf_counter() - t0
    viewer.decoder.wait()  # the tokenizer loads meanwhile; a turn waits for it once
    assert sum(s["episodes"] for s in viewer.run()["steps"]) == 10_000
    with served(viewer) as url:
        d.get("about:blank")
        t0 = time.perf_counter()
        d.get(url)
        wait_for(d, "#episodes .episode-row", 50)
        first_page = time.perf_counter() - t0
        wait_for(d, "#steps .step-row[data-step='13']")[0].click()
        wait_js(d, "return document.querySelector('#episodes .episode-row').dataset.step"
                   " === '13'")
        turns = []
        for line in (1, 2, 3):  # line 1 is discarded; still browsable
            d.find_element(By.CSS_SELECTOR, f"#episodes .episode-row[data-line='{line}']").click()
            wait_for(d, ".turn-button", 2)
            t0 = time.perf_counter()
            d.find_elements(By.CSS_SELECTOR, ".turn-button")[1].click()
            wait_js(d, "const h = document.querySelector('#turn h3'); return h !== null && "
                       "h.textContent.startsWith('Turn 1') && "
                       "document.querySelectorAll('#action .tok').length === 80")
            turns.append(time.perf_counter() - t0)
            traj = trajectory_of(big / "rollouts" / "step_000013.jsonl", line)
            t = traj.turns[1]
            ids = d.execute_script("return [...document.querySelectorAll('#action .tok')]"
                                   ".map(s => Number(s.dataset.id))")
            assert ids == traj.token_ids[t.start:t.end]
    record = {"episodes": 10_000, "write_s": t_write, "index_s": t_index,
              "first_page_s": first_page, "turn_s": turns}
    print("viewer timings", json.dumps(record))
    if os.environ.get("AGENTRL_VIEWER_TIMINGS"):
        Path(os.environ["AGENTRL_VIEWER_TIMINGS"]).write_text(json.dumps(record))
    assert first_page < FIRST_PAGE_S, record
    assert max(turns) < TURN_S, record
