"""#33 item 6: an external agent drives MiniWoB++ through the proxy with its screenshots as
`image_url` parts (examples/agents/miniwob_screenshots.py): the episode is one session and one
trajectory, holding every screenshot the agent sent, pixel for pixel, at its place."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from agentrl.engine.fakes import FakeEngine
from agentrl.models import load_tokenizer
from agentrl.models.vision import vision_processor
from agentrl.plugins import load_callable
from tests.browsers import browser_unavailable

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def browser_available():
    if (unavailable := browser_unavailable()) is not None:
        pytest.skip(f"no browser here: {unavailable}")
    yield
    from environments.miniwob.pool import close_pool

    close_pool()


@pytest.mark.slow  # the vision-language tokenizer's processor takes seconds to load
def test_an_external_agent_sends_screenshots_and_the_session_is_one_trajectory(
        make_proxy, browser_available):
    run_episode = load_callable(f"{ROOT}/examples/agents/miniwob_screenshots.py:run_episode")
    tok = load_tokenizer("tiny-qwen2-vl")
    # A policy that misses: every turn a click on the empty top-left corner, so the episode
    # runs to the agent's turn budget with a screenshot each turn.
    proxy = make_proxy(FakeEngine(tok, reply="click(2, 2)"), tokenizer=tok)
    client = proxy.client("web")
    episode = run_episode(client, "click-button", seed=0, max_turns=3)
    assert episode.turns == 3 and episode.reward == -1.0
    assert episode.info["reason"] == "turn budget ran out"
    # The first screenshot, then one after each turn but the last.
    assert len(episode.screenshots) == 3
    assert all(s.shape == (210, 160, 3) and s.std() > 10 for s in episode.screenshots)
    assert [req[2] for req in proxy.engine.requests] == [1, 2, 3]  # images in each call
    (traj,) = proxy.store.get("web").trajectories()
    assert len(traj.turns) == 3
    assert len(traj.images) == 3
    vision = vision_processor(tok)
    for image, sent in zip(traj.images, episode.screenshots, strict=True):
        assert np.array_equal(image.pixels, sent)  # PNG data URLs are lossless
        assert set(traj.token_ids[image.start:image.end]) == {vision.image_token_id}
    # Each screenshot comes before the turn that answered it.
    starts = [t.start for t in traj.turns]
    assert [im.end <= s for im, s in zip(traj.images, starts, strict=True)] == [True] * 3
