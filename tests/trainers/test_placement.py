"""The placement plan: the node and bundles of every actor, and errors naming the flag to fix."""

from __future__ import annotations

import doctest

import pytest

from trainers import placement
from trainers.placement import ActorPlacement, Node, PlacementPlan, plan_placement, ray_options


def gpu_nodes(count: int, gpus: int = 8, cpus: int = 64) -> list[Node]:
    return [Node(num_gpus=gpus, num_cpus=cpus) for _ in range(count)]


def where(plan: PlacementPlan, role: str) -> list[tuple[int, tuple[int, ...]]]:
    """(node, bundles) of every actor of a role, in rank / engine order."""
    return [(a.node, a.bundles) for a in plan.actors if a.role == role]


def test_one_gpu_colocated_shares_gpu_zero() -> None:
    plan = plan_placement(gpu_nodes(1, gpus=1, cpus=4), num_policy_workers=1, num_engines=1,
                          mode="colocated")
    assert plan.node_bundles(0) == [{"GPU": 1, "CPU": 2}]
    assert plan.actor("train", 0) == ActorPlacement(role="train", index=0, node=0, bundles=(0,),
                                                    num_gpus=0.5, num_cpus=1)
    assert plan.actor("engine", 0) == ActorPlacement(role="engine", index=0, node=0,
                                                     bundles=(0,), num_gpus=0.5, num_cpus=1)
    assert plan.strategy == "STRICT_PACK" and plan.used_nodes == (0,)


def test_eight_gpus_placed_four_ranks_four_engines() -> None:
    plan = plan_placement(gpu_nodes(1), num_policy_workers=4, num_engines=4)
    assert plan.node_bundles(0) == [{"GPU": 1, "CPU": 1}] * 8
    assert where(plan, "train") == [(0, (0,)), (0, (1,)), (0, (2,)), (0, (3,))]
    assert where(plan, "engine") == [(0, (4,)), (0, (5,)), (0, (6,)), (0, (7,))]
    assert {(a.num_gpus, a.num_cpus) for a in plan.actors} == {(1.0, 1)}


def test_eight_gpus_placed_two_engines_of_tp2() -> None:
    plan = plan_placement(gpu_nodes(1), num_policy_workers=4, num_engines=2,
                          tensor_parallel_size=2, cpus_per_actor=3)
    assert plan.node_bundles(0) == [{"GPU": 1, "CPU": 3}] * 8
    assert where(plan, "train") == [(0, (0,)), (0, (1,)), (0, (2,)), (0, (3,))]
    assert where(plan, "engine") == [(0, (4, 5)), (0, (6, 7))]


def test_fewer_gpus_used_than_the_node_has() -> None:
    plan = plan_placement(gpu_nodes(2), num_policy_workers=2, num_engines=1)
    assert len(plan.bundles[0]) == 3 and plan.bundles[1] == ()
    assert plan.used_nodes == (0,)


def test_two_nodes_tp_groups_stay_within_a_node() -> None:
    # 5 engines of tp 2 fill node 0 (4 engines) and start node 1; the ranks take the rest.
    plan = plan_placement(gpu_nodes(2), num_policy_workers=6, num_engines=5,
                          tensor_parallel_size=2)
    assert [len(b) for b in plan.bundles] == [8, 8]
    assert where(plan, "engine") == [(0, (0, 1)), (0, (2, 3)), (0, (4, 5)), (0, (6, 7)),
                                     (1, (6, 7))]
    assert where(plan, "train") == [(1, (r,)) for r in range(6)]


def test_two_nodes_eight_ranks_eight_engines() -> None:
    plan = plan_placement(gpu_nodes(2), num_policy_workers=8, num_engines=8)
    assert where(plan, "engine") == [(0, (e,)) for e in range(8)]
    assert where(plan, "train") == [(1, (r,)) for r in range(8)]
    for node in (0, 1):
        on_node = [b for a in plan.actors if a.node == node for b in a.bundles]
        assert sorted(on_node) == list(range(len(plan.bundles[node]))) == list(range(8))


def test_train_ranks_may_span_nodes_engines_may_not() -> None:
    # 2 x 6 GPUs: each node fits one tp-4 engine; the 3 ranks take the 2 + 1 GPUs left.
    plan = plan_placement(gpu_nodes(2, gpus=6), num_policy_workers=3, num_engines=2,
                          tensor_parallel_size=4)
    assert where(plan, "train") == [(0, (0,)), (0, (1,)), (1, (0,))]
    assert where(plan, "engine") == [(0, (2, 3, 4, 5)), (1, (1, 2, 3, 4))]
    assert [len(b) for b in plan.bundles] == [6, 5]


def test_two_nodes_colocated_ranks_share_their_engines_gpus() -> None:
    plan = plan_placement(gpu_nodes(2), num_policy_workers=16, num_engines=4,
                          tensor_parallel_size=4, mode="colocated")
    assert plan.node_bundles(1) == [{"GPU": 1, "CPU": 2}] * 8
    assert where(plan, "engine") == [(0, (0, 1, 2, 3)), (0, (4, 5, 6, 7)),
                                     (1, (0, 1, 2, 3)), (1, (4, 5, 6, 7))]
    assert where(plan, "train") == [(r // 8, (r % 8,)) for r in range(16)]
    assert {a.num_gpus for a in plan.actors} == {0.5}


def test_cpu_only_cluster_gets_cpu_bundles() -> None:
    nodes = [Node(num_gpus=0, num_cpus=8)]
    plan = plan_placement(nodes, num_policy_workers=2, num_engines=1, tensor_parallel_size=2,
                          device="cpu", cpus_per_actor=2)
    assert plan.node_bundles(0) == [{"CPU": 2}] * 4
    assert where(plan, "train") == [(0, (0,)), (0, (1,))]
    assert where(plan, "engine") == [(0, (2, 3))]
    assert all(a.num_gpus == 0 and a.num_cpus == 2 for a in plan.actors)


def test_cpu_colocated_bundle_backs_both_processes() -> None:
    plan = plan_placement([Node(num_gpus=0, num_cpus=4)], num_policy_workers=1, num_engines=1,
                          device="cpu", mode="colocated", cpus_per_actor=2)
    assert plan.node_bundles(0) == [{"CPU": 4}]
    assert [(a.role, a.bundles, a.num_gpus, a.num_cpus) for a in plan.actors] == [
        ("train", (0,), 0.0, 2), ("engine", (0,), 0.0, 2)]


def test_cpu_device_ignores_gpus() -> None:
    plan = plan_placement(gpu_nodes(1, cpus=4), num_policy_workers=1, num_engines=1,
                          device="cpu")
    assert plan.node_bundles(0) == [{"CPU": 1}] * 2


# (nodes, plan_placement keywords, what the message says)
ERRORS = {
    "not enough GPUs": (
        gpu_nodes(1), {"num_policy_workers": 4, "num_engines": 2, "tensor_parallel_size": 4},
        (r"--rollout.tensor_parallel_size 4 x --rollout.num_engines 2 \+ --num_policy_workers 4 "
         r"needs 12 GPUs, the cluster has 8: lower them or add GPUs"),
    ),
    "not enough GPUs, colocated": (
        gpu_nodes(1, gpus=4),
        {"num_policy_workers": 8, "num_engines": 2, "tensor_parallel_size": 4,
         "mode": "colocated"},
        (r"--num_policy_workers 8 \(sharing GPUs: --rollout.mode colocated\) needs 8 GPUs, "
         r"the cluster has 4"),
    ),
    "tp larger than any node": (
        gpu_nodes(3), {"num_policy_workers": 1, "num_engines": 1, "tensor_parallel_size": 16},
        (r"--rollout.tensor_parallel_size 16 is larger than the GPUs of any node \(at most 8\)"
         r".*; use --rollout.tensor_parallel_size <= 8"),
    ),
    "tp groups would span nodes": (
        gpu_nodes(3, gpus=6), {"num_policy_workers": 1, "num_engines": 4,
                               "tensor_parallel_size": 4},
        (r"--rollout.num_engines 4 x --rollout.tensor_parallel_size 4 do not fit: .*nodes of "
         r"\[6, 6, 6\] GPUs hold 3 such groups"),
    ),
    "cuda without GPUs": (
        [Node(num_gpus=0, num_cpus=8)], {"num_policy_workers": 1, "num_engines": 1},
        r"--actor.device cuda but the cluster has no GPUs: use --actor.device cpu",
    ),
    "colocated counts differ": (
        gpu_nodes(1), {"num_policy_workers": 2, "num_engines": 1, "mode": "colocated"},
        (r"--num_policy_workers 2 must equal --rollout.num_engines 1 x "
         r"--rollout.tensor_parallel_size 1 = 1; .* or use --rollout.mode placed"),
    ),
    "GPUs without CPUs to back them": (
        gpu_nodes(1, cpus=4), {"num_policy_workers": 4, "num_engines": 4},
        r"needs 8 GPU bundles of 1 CPUs .*, the cluster's CPUs hold 4: lower --cpus_per_actor",
    ),
    "not enough CPUs": (
        [Node(num_gpus=0, num_cpus=3)],
        {"num_policy_workers": 1, "num_engines": 1, "device": "cpu", "cpus_per_actor": 2},
        r"needs 2 bundles of 2 CPUs .*, the cluster's CPUs hold 1",
    ),
    "unknown mode": (
        gpu_nodes(1), {"num_policy_workers": 1, "num_engines": 1, "mode": "colocate"},
        r"--rollout.mode 'colocate' is unknown .* Did you mean 'colocated'\?",
    ),
    "unknown device": (
        gpu_nodes(1), {"num_policy_workers": 1, "num_engines": 1, "device": "cuda:0"},
        r"--actor.device 'cuda:0' is unknown .* Did you mean 'cuda'\?",
    ),
    "no ranks": (
        gpu_nodes(1), {"num_policy_workers": 0, "num_engines": 1},
        r"--num_policy_workers must be >= 1, got 0",
    ),
    "no CPUs per actor": (
        gpu_nodes(1), {"num_policy_workers": 1, "num_engines": 1, "cpus_per_actor": 0},
        r"--cpus_per_actor must be >= 1, got 0",
    ),
    "no nodes": ([], {"num_policy_workers": 1, "num_engines": 1}, r"the cluster has no nodes"),
}


@pytest.mark.parametrize(("nodes", "kwargs", "match"), ERRORS.values(), ids=ERRORS.keys())
def test_errors_name_the_flag(nodes: list[Node], kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        plan_placement(nodes, **kwargs)


def test_node_rejects_no_cpus() -> None:
    with pytest.raises(ValueError, match=r"num_cpus >= 1, got num_gpus=1, num_cpus=0"):
        Node(num_gpus=1, num_cpus=0)


def test_module_example_holds() -> None:
    result = doctest.testmod(placement)
    assert result.attempted == 3 and result.failed == 0


def test_ray_options_without_a_cluster() -> None:
    pytest.importorskip("ray")
    from ray._raylet import PlacementGroupID
    from ray.util.placement_group import PlacementGroup

    plan = plan_placement(gpu_nodes(1), num_policy_workers=4, num_engines=2,
                          tensor_parallel_size=2)
    # A group with its bundles cached reads them without asking a Ray cluster.
    pg = PlacementGroup(PlacementGroupID.from_random(), bundle_cache=plan.node_bundles(0))
    engine = plan.actor("engine", 1)
    opts = ray_options(plan, pg, engine, tp_rank=1)
    strategy = opts.pop("scheduling_strategy")
    assert opts == {"num_gpus": 1.0, "num_cpus": 1}
    assert strategy.placement_group is pg and strategy.placement_group_bundle_index == 7
    assert strategy.placement_group_capture_child_tasks

    with pytest.raises(ValueError, match=r"tp_rank must be in \[0, 2\), got 2"):
        ray_options(plan, pg, engine, tp_rank=2)
    small = PlacementGroup(PlacementGroupID.from_random(), bundle_cache=[{"GPU": 1}])
    with pytest.raises(ValueError, match=r"pass the group made from plan.node_bundles\(0\)"):
        ray_options(plan, small, engine)


def test_the_node_of_a_run_without_ray_is_local_and_needs_no_ray(monkeypatch):
    """`--use_ray false` runs where Ray is not installed (a GPU image without it stopped at
    this call): outside Ray the node is "local", and Ray is not imported to find that out."""
    import sys

    from trainers.ray_utils import current_node

    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` now raises
    assert current_node() == "local"
