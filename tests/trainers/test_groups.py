"""Group ids: named once when episodes are launched (env rollouts and proxy sessions alike),
numbered once per step (`dense_group_ids`), and used as they come by dynamic filtering,
collation and advantages, on every data-parallel rank."""

from __future__ import annotations

import concurrent.futures
import threading

import pytest
import torch

from agentrl.types import Trajectory, TrajectoryBuilder, dense_group_ids

GROUPS = ["a", "b", "a", "d", "c", "b", "c", "d"]
REWARDS = [1.0, 0.0, 0.5, 1.0, 0.25, 1.0, 0.0, 0.0]


def _traj(group: str | None, reward: float, n: int) -> Trajectory:
    b = TrajectoryBuilder(group=group)
    b.add_observation([5, 6, 7])
    b.add_action([8 + i for i in range(n)], [-0.5] * n).reward = reward
    return b.build(terminated=True, truncated=False)


def _batch() -> list[Trajectory]:
    return [_traj(g, r, 2 + i % 3) for i, (g, r) in enumerate(zip(GROUPS, REWARDS, strict=True))]


class _AllGather:
    """`all_gather_object` between threads that stand in for ranks."""

    def __init__(self, world: int) -> None:
        self.slots: list[object] = [None] * world
        self.barrier = threading.Barrier(world, timeout=30)
        self.local = threading.local()

    def __call__(self, obj: object) -> list[object]:
        self.slots[self.local.rank] = obj
        self.barrier.wait()
        out = list(self.slots)
        self.barrier.wait()
        return out


def test_dense_group_ids_number_first_appearances_and_ungrouped_alone():
    trajs = [_traj(g, 0.0, 2) for g in ["x", None, "y", "x", None, "y"]]
    assert dense_group_ids(trajs) == [0, 1, 2, 0, 3, 2]
    assert dense_group_ids(_batch()) == [0, 1, 0, 2, 3, 1, 3, 2]


@pytest.mark.parametrize("estimator", ["group_norm", "rloo", "reinforce_baseline"])
def test_two_ranks_use_the_steps_numbering(monkeypatch, estimator):
    """Rank 1's slice starts with group "c", then meets "b" and "d" of rank 0: numbered per rank
    they would collide; numbered once for the step, two ranks give one process's advantages."""
    from trainers import rl_step
    from trainers.batch import collate
    from trainers.config import AlgoConfig

    algo = AlgoConfig(estimator=estimator)
    trajs = _batch()
    ids = dense_group_ids(trajs)
    whole = collate(trajs, 0, ids)
    want, _ = rl_step.batch_advantages(algo, whole, None, 0.0)
    assert whole.group_ids.tolist() == ids and collate(trajs, 0).group_ids.tolist() == ids

    gather = _AllGather(2)
    monkeypatch.setattr(rl_step, "gather_objects", gather)

    def rank(r: int) -> torch.Tensor:
        gather.local.rank = r
        lo, hi = 4 * r, 4 * r + 4
        batch = collate(trajs[lo:hi], 0, ids[lo:hi])
        return rl_step.batch_advantages(algo, batch, None, 0.0, rank=r)[0]

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        got = list(pool.map(rank, [0, 1]))
    for r, adv in enumerate(got):
        rows = want[4 * r : 4 * r + 4, : adv.shape[1]]
        torch.testing.assert_close(adv, rows)
        assert not torch.equal(adv, torch.zeros_like(adv))


def test_dynamic_filtering_uses_the_same_numbering():
    from trainers.rl_step import informative

    trajs = [_traj(g, r, 2) for g, r in
             [("a", 1.0), ("a", 1.0), (None, 0.0), (None, 1.0), ("b", 0.0), ("b", 1.0)]]
    # "a" carries no signal; ungrouped episodes are groups of one (as advantages see them).
    assert [t.group for t in informative(trajs, "std")] == ["b", "b"]


def test_agent_sessions_are_grouped_like_env_episodes(make_cfg, tmp_path, tiny_tokenizer):
    """The trainer launches n proxy sessions per task as one group, named by the same rule as
    env rollouts; the trainer's group ids follow."""
    from agentrl.engine.fakes import FakeEngine
    from trainers.batch import collate
    from trainers.episodes import collect_agent_episodes, group_prefix

    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("".join(f'{{"prompt": "Count from {i}."}}\n' for i in range(3)))
    cfg = make_cfg(agent="tests.trainers.agent_fixture:digits_agent", agent_tasks=str(tasks),
                   agent_reward="tests.trainers.agent_fixture:digits_reward",
                   rollout={"n_samples_per_prompt": 3})
    trajs = collect_agent_episodes(FakeEngine(tiny_tokenizer, reply="123"), cfg,
                                   tiny_tokenizer, seeds=[7, 5], step=4)
    assert group_prefix(4) == "s4-"
    assert [t.group for t in trajs] == ["s4-0"] * 3 + ["s4-1"] * 3
    assert [(t.info["task_index"], t.info["sample_index"]) for t in trajs] == [
        (i, j) for i in range(2) for j in range(3)]
    assert [t.rewards[-1] for t in trajs] == [1.0] * 6
    assert len({t.info["session_id"] for t in trajs}) == 6
    assert collate(trajs, 0).group_ids.tolist() == [0, 0, 0, 1, 1, 1]
