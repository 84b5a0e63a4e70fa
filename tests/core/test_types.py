from __future__ import annotations

import numpy as np
import pytest

from agentrl.completion import Completion, SamplingParams
from agentrl.trajectory_files import load_jsonl, save_jsonl
from agentrl.types import Image, Trajectory, TrajectoryBuilder


def _trajectory() -> Trajectory:
    b = TrajectoryBuilder(group="g7")
    b.add_observation(
        [1, 2, 3], images=[Image(pixels=np.full((2, 3, 3), 7, np.uint8), start=1, end=2)]
    )
    t = b.add_action([4, 5], [-0.5, -1.25], policy_version=3, finish_reason="stop")
    t.reward = 0.25
    b.add_observation([6])
    t = b.add_action([7], [-0.1], policy_version=4, finish_reason="length")
    t.reward = 1.0
    return b.build(terminated=False, truncated=True, info={"x": np.float32(1.5), "t": (1, 2)})


def test_builder_masks_and_turns():
    traj = _trajectory()
    assert traj.token_ids == [1, 2, 3, 4, 5, 6, 7]
    assert traj.loss_mask == [0, 0, 0, 1, 1, 0, 1]
    assert traj.logprobs == [0, 0, 0, -0.5, -1.25, 0, -0.1]
    assert [(t.obs_start, t.start, t.end) for t in traj.turns] == [(0, 3, 5), (5, 6, 7)]
    assert traj.rewards == [0.25, 1.0] and traj.total_reward == 1.25
    assert traj.policy_versions == [3, 4] and traj.prompt_len == 3


def test_jsonl_round_trip(tmp_path):
    traj = _trajectory()
    path = tmp_path / "out" / "t.jsonl"
    assert save_jsonl([traj, traj], path) == 2
    back = load_jsonl(path)
    assert len(back) == 2
    b = back[0]
    assert b.to_dict() == Trajectory.from_json(traj.to_json()).to_dict()
    assert b.token_ids == traj.token_ids and b.loss_mask == traj.loss_mask
    assert b.turns == traj.turns and b.group == "g7" and b.truncated and not b.terminated
    assert np.array_equal(b.images[0].pixels, traj.images[0].pixels)
    assert (b.images[0].start, b.images[0].end) == (1, 2)
    assert b.info == {"x": 1.5, "t": [1, 2]}


def test_jsonl_stores_each_screenshot_once_as_png_by_hash(tmp_path):
    rng = np.random.default_rng(0)
    screen, other = (rng.integers(0, 256, (20, 30, 3), dtype=np.uint8) for _ in range(2))
    b = TrajectoryBuilder()
    b.add_observation([1, 9, 9], images=[Image(pixels=screen, start=1, end=2),
                                         Image(pixels=screen.copy(), start=2, end=3)])
    b.add_action([4], [-0.5])
    b.add_observation([9], images=[Image(pixels=other, start=4, end=5)])
    b.add_action([5], [-0.1])
    traj = b.build(terminated=True, truncated=False)
    path = tmp_path / "rollouts" / "step_1.jsonl"
    save_jsonl([traj, traj], path)
    pngs = sorted(p.name for p in (tmp_path / "rollouts" / "images").iterdir())
    assert pngs == sorted({f"{Image(pixels=screen).sha256}.png",
                           f"{Image(pixels=other).sha256}.png"})
    line = path.read_text().splitlines()[0]
    assert '"data"' not in line and len(line) < 2000  # hashes, not pixels
    back = load_jsonl(path)[1]
    for got, want in zip(back.images, traj.images, strict=True):
        assert np.array_equal(got.pixels, want.pixels) and (got.start, got.end) == (
            want.start, want.end)
    (tmp_path / "rollouts" / "images" / pngs[0]).unlink()
    with pytest.raises(ValueError, match="missing"):
        load_jsonl(path)


def test_corrupt_jsonl_names_the_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(_trajectory().to_json() + "\n" + '{"token_ids": [1]}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: .*missing keys"):
        load_jsonl(path)


def test_validate_catches_misaligned_mask():
    traj = _trajectory()
    traj.loss_mask[0] = 1
    with pytest.raises(ValueError, match="loss_mask does not match"):
        traj.validate()


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"n": 0}, "n must be"),
        ({"max_tokens": -1}, "max_tokens"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"temperature": -1}, "temperature"),
        ({"top_k": -2}, "top_k"),
    ],
)
def test_sampling_params_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_completion_checks_lengths_and_reason():
    with pytest.raises(ValueError, match="2 tokens but 1 logprobs"):
        Completion(token_ids=[1, 2], logprobs=[0.0], finish_reason="stop")
    with pytest.raises(ValueError, match="finish_reason"):
        Completion(token_ids=[], logprobs=[], finish_reason="done")  # type: ignore[arg-type]


def test_image_validation():
    with pytest.raises(ValueError, match=r"uint8 array of shape \(H, W, 3\)"):
        Image(pixels=np.zeros((2, 2), np.float32))
