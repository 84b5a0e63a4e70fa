"""Where every train rank and rollout engine runs: a pure plan, checked before Ray starts.

The plan is computed from a description of the cluster alone (no Ray, no I/O), so a wrong
combination of flags fails in milliseconds with a message naming the flag, and the layout is
unit-tested without a cluster. Only `ray_options` imports Ray.

Layout: one placement group per node, `STRICT_PACK`, as verl's `RayResourcePool` does
(verl/single_controller/ray/base.py). Ray cannot pin the bundles of one group to chosen nodes,
but it keeps a STRICT_PACK group on one machine, so an engine's tensor-parallel group never spans
nodes. Train ranks may span nodes. `node` is the plan's node index: Ray puts that node's group
on whichever machine fits it, so the plan promises "same `node`, same machine", not which one.

- `placed`: one bundle per process and GPU, `{"GPU": 1, "CPU": cpus_per_actor}`. Engines are
  fitted first (first fit, node order): they are the only items larger than one GPU; the train
  ranks then fill the GPUs left, in node order, so rank order follows node order. On a node the
  train bundles come first, then the engines'.
- `colocated` (hybrid engine, sleep/wake): each GPU holds one train rank and one engine shard,
  so `num_policy_workers == num_engines * tensor_parallel_size`. Convention: the bundle is
  `{"GPU": 1, "CPU": 2 * cpus_per_actor}` and each of the two processes asks `num_gpus=0.5`;
  the fraction only schedules (both see the whole GPU), memory is shared by sleep/wake.
- device `cpu`: the same layout with CPU-only bundles (`{"CPU": c}`, `{"CPU": 2c}` colocated)
  and `num_gpus=0`; a node's capacity is how many such bundles its CPUs hold.

Every process asks for real CPUs (`num_cpus >= 1`) so Ray never overcommits the host.

Example, one node with 8 GPUs, 4 train ranks and 2 engines of tensor-parallel size 2:

>>> plan = plan_placement([Node(num_gpus=8, num_cpus=32)], num_policy_workers=4,
...                       num_engines=2, tensor_parallel_size=2, mode="placed")
>>> plan.node_bundles(0)[0]
{'GPU': 1, 'CPU': 1}
>>> plan.actor("engine", 1).bundles, plan.actor("train", 3).bundles
((6, 7), (3,))

With Ray running, one group per used node, then each process placed by `ray_options`:

    pgs = {n: placement_group(plan.node_bundles(n), strategy=plan.strategy)
           for n in plan.used_nodes}
    a = plan.actor("train", 0)
    worker = ray.remote(PolicyWorker).options(**ray_options(plan, pgs[a.node], a)).remote(...)
"""

from __future__ import annotations

import difflib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from ray.util.placement_group import PlacementGroup

Device = Literal["cuda", "cpu"]
Mode = Literal["colocated", "placed"]
Role = Literal["train", "engine"]
DEVICES: tuple[str, ...] = ("cuda", "cpu")
MODES: tuple[str, ...] = ("colocated", "placed")
COLOCATED_GPU_SHARE = 0.5
"""num_gpus each of the two processes on a colocated GPU asks for."""


@dataclass(frozen=True, kw_only=True)
class Node:
    """One machine as Ray reports it (`ray.nodes()[i]["Resources"]`)."""

    num_gpus: int
    """GPUs on the node (0 on a CPU-only node)."""
    num_cpus: int
    """CPUs on the node."""

    def __post_init__(self) -> None:
        if self.num_gpus < 0 or self.num_cpus < 1:
            raise ValueError(
                f"a node needs num_gpus >= 0 and num_cpus >= 1, got num_gpus={self.num_gpus}, "
                f"num_cpus={self.num_cpus}"
            )


@dataclass(frozen=True, kw_only=True)
class Bundle:
    """One placement-group bundle: one GPU slot (cuda) or one actor's CPUs (cpu)."""

    num_gpus: int
    num_cpus: int

    def resources(self) -> dict[str, int]:
        """The dict `ray.util.placement_group` takes; no "GPU" key on CPU bundles."""
        if self.num_gpus:
            return {"GPU": self.num_gpus, "CPU": self.num_cpus}
        return {"CPU": self.num_cpus}


@dataclass(frozen=True, kw_only=True)
class ActorPlacement:
    """Where one train rank or one engine runs, and what each of its processes asks Ray for."""

    role: Role
    index: int
    """Train rank, or engine index."""
    node: int
    """Index into the nodes given; its placement group is the one made from
    `plan.node_bundles(node)`. Actors with the same `node` share one machine."""
    bundles: tuple[int, ...]
    """Bundle indices in the node's placement group: one for a train rank, one per tensor-parallel
    rank (in rank order) for an engine."""
    num_gpus: float
    """Per process: 1 placed, 0.5 colocated, 0 on CPU."""
    num_cpus: int
    """Per process; never 0."""


@dataclass(frozen=True, kw_only=True)
class PlacementPlan:
    """The bundles of every node's placement group and where each actor lands in them."""

    device: Device
    mode: Mode
    strategy: Literal["STRICT_PACK"]
    """Ray strategy of each node's group: one node per group keeps tensor-parallel groups whole."""
    bundles: tuple[tuple[Bundle, ...], ...]
    """Per node of the cluster given, its bundles; () for a node the plan leaves unused."""
    actors: tuple[ActorPlacement, ...]
    """Train ranks in rank order, then engines in index order."""

    @property
    def used_nodes(self) -> tuple[int, ...]:
        """Nodes that get a placement group (Ray refuses a group with no bundles)."""
        return tuple(n for n, b in enumerate(self.bundles) if b)

    def node_bundles(self, node: int) -> list[dict[str, int]]:
        """The bundle list for `placement_group(...)` of one node."""
        return [b.resources() for b in self.bundles[node]]

    def actor(self, role: Role, index: int) -> ActorPlacement:
        """The placement of train rank `index` or engine `index`."""
        for a in self.actors:
            if a.role == role and a.index == index:
                return a
        raise KeyError(f"the plan has no {role} actor {index}")


def plan_placement(
    nodes: Sequence[Node],
    *,
    num_policy_workers: int,
    num_engines: int,
    tensor_parallel_size: int = 1,
    device: Device = "cuda",
    mode: Mode = "placed",
    cpus_per_actor: int = 1,
) -> PlacementPlan:
    """Fit the train ranks and engines onto `nodes`; raise ValueError naming the flag to change."""
    ask = _Ask(workers=num_policy_workers, engines=num_engines, tp=tensor_parallel_size,
               device=device, mode=mode, cpus_per_actor=cpus_per_actor)
    _check_args(nodes, ask)
    capacity = [_capacity(n, ask) for n in nodes]
    _check_capacity(nodes, capacity, ask)
    engines_on = _fit_engines(capacity, ask)
    engine_slots = [len(e) * ask.tp for e in engines_on]
    if ask.colocated:
        train_slots = [0] * len(nodes)  # no bundles of their own: the ranks share the engines'
        train_on = engine_slots
    else:
        train_slots = _fill(capacity, engine_slots, ask.workers)
        train_on = train_slots
    bundle = Bundle(num_gpus=1 if device == "cuda" else 0, num_cpus=ask.bundle_cpus)
    bundles = tuple((bundle,) * (t + e) for t, e in zip(train_slots, engine_slots, strict=True))
    actors = _train_actors(train_on, ask) + _engine_actors(engines_on, train_slots, ask)
    return PlacementPlan(device=device, mode=mode, strategy="STRICT_PACK", bundles=bundles,
                         actors=actors)


def ray_options(
    plan: PlacementPlan, pg: PlacementGroup, actor: ActorPlacement, tp_rank: int = 0
) -> dict[str, object]:
    """Keyword arguments for `.options(...)` of one process of `actor` (tensor-parallel rank
    `tp_rank` of an engine), in `pg`, the group made from `plan.node_bundles(actor.node)`.

    Child tasks are captured so an engine's own workers (vLLM's Ray executor) stay in the group.
    """
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    if actor not in plan.actors:
        raise ValueError(f"{actor.role} actor {actor.index} is not in this plan")
    if not 0 <= tp_rank < len(actor.bundles):
        raise ValueError(f"tp_rank must be in [0, {len(actor.bundles)}), got {tp_rank}")
    if len(pg.bundle_specs) != len(plan.bundles[actor.node]):
        raise ValueError(
            f"the placement group has {len(pg.bundle_specs)} bundles, node {actor.node} of the "
            f"plan has {len(plan.bundles[actor.node])}: pass the group made from "
            f"plan.node_bundles({actor.node})"
        )
    strategy = PlacementGroupSchedulingStrategy(
        placement_group=pg,
        placement_group_bundle_index=actor.bundles[tp_rank],
        placement_group_capture_child_tasks=True,
    )
    return {"num_gpus": actor.num_gpus, "num_cpus": actor.num_cpus,
            "scheduling_strategy": strategy}


@dataclass(frozen=True, kw_only=True)
class _Ask:
    """The arguments of `plan_placement`, with what follows from them."""

    workers: int
    engines: int
    tp: int
    device: str
    mode: str
    cpus_per_actor: int

    @property
    def colocated(self) -> bool:
        return self.mode == "colocated"

    @property
    def bundle_cpus(self) -> int:
        """A colocated bundle backs two processes, each with its own CPUs."""
        return self.cpus_per_actor * (2 if self.colocated else 1)

    @property
    def need(self) -> int:
        """Bundles in all: colocated, the ranks and engine shards pair up one per bundle."""
        return self.workers if self.colocated else self.workers + self.engines * self.tp

    @property
    def unit(self) -> str:
        return "GPUs" if self.device == "cuda" else f"bundles of {self.bundle_cpus} CPUs"

    @property
    def share(self) -> float:
        """num_gpus of each process (see the module docstring)."""
        if self.device == "cpu":
            return 0.0
        return COLOCATED_GPU_SHARE if self.colocated else 1.0


def _check_args(nodes: Sequence[Node], ask: _Ask) -> None:
    """Reject unknown names and non-positive counts before any arithmetic on them."""
    _check_choice("--actor.device", ask.device, DEVICES)
    _check_choice("--rollout.mode", ask.mode, MODES)
    if not nodes:
        raise ValueError("the cluster has no nodes: start Ray on at least one machine")
    counts = {"--num_policy_workers": ask.workers, "--rollout.num_engines": ask.engines,
              "--rollout.tensor_parallel_size": ask.tp, "--cpus_per_actor": ask.cpus_per_actor}
    for flag, value in counts.items():
        if value < 1:
            raise ValueError(f"{flag} must be >= 1, got {value}")
    if ask.colocated and ask.workers != ask.engines * ask.tp:
        raise ValueError(
            f"--rollout.mode colocated puts one train rank and one engine shard on each "
            f"{'GPU' if ask.device == 'cuda' else 'bundle'}: --num_policy_workers {ask.workers} "
            f"must equal --rollout.num_engines {ask.engines} x --rollout.tensor_parallel_size "
            f"{ask.tp} = {ask.engines * ask.tp}; change one of them or use --rollout.mode placed"
        )
    if ask.device == "cuda" and not any(n.num_gpus for n in nodes):
        raise ValueError("--actor.device cuda but the cluster has no GPUs: use --actor.device cpu")


def _check_choice(flag: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        close = difflib.get_close_matches(value, choices, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ValueError(f"{flag} {value!r} is unknown (choose from {', '.join(choices)}).{hint}")


def _capacity(node: Node, ask: _Ask) -> int:
    """Bundles a node holds: its GPUs (cuda), at most as many as its CPUs can back."""
    by_cpu = node.num_cpus // ask.bundle_cpus
    return min(node.num_gpus, by_cpu) if ask.device == "cuda" else by_cpu


def _check_capacity(nodes: Sequence[Node], capacity: list[int], ask: _Ask) -> None:
    """Total demand against total room, with the flags that make up the demand."""
    if ask.colocated:
        demand = f"--num_policy_workers {ask.workers} (sharing GPUs: --rollout.mode colocated)"
    else:
        demand = (f"--rollout.tensor_parallel_size {ask.tp} x --rollout.num_engines "
                  f"{ask.engines} + --num_policy_workers {ask.workers}")
    gpus = sum(n.num_gpus for n in nodes)
    if ask.device == "cuda" and ask.need > gpus:
        raise ValueError(f"{demand} needs {ask.need} GPUs, the cluster has {gpus}: lower them "
                         f"or add GPUs")
    if ask.need > sum(capacity):
        what = "GPU bundles" if ask.device == "cuda" else "bundles"
        raise ValueError(
            f"{demand} needs {ask.need} {what} of {ask.bundle_cpus} CPUs (--cpus_per_actor "
            f"{ask.cpus_per_actor} per process), the cluster's CPUs hold {sum(capacity)}: lower "
            f"--cpus_per_actor or the counts, or add nodes"
        )


def _fit_engines(capacity: list[int], ask: _Ask) -> list[list[int]]:
    """First fit, node order: the engines each node runs. A tensor-parallel group needs `tp`
    bundles on one node; all engines are the same size, so first fit places as many as any."""
    tp, unit = ask.tp, ask.unit
    largest = max(capacity)
    if tp > largest:
        raise ValueError(
            f"--rollout.tensor_parallel_size {tp} is larger than the {unit} of any node (at most "
            f"{largest}): a tensor-parallel group must sit on one node; use "
            f"--rollout.tensor_parallel_size <= {largest}"
        )
    free = list(capacity)
    engines_on: list[list[int]] = [[] for _ in capacity]
    for e in range(ask.engines):
        node = next((n for n, f in enumerate(free) if f >= tp), None)
        if node is None:
            fits = sum(c // tp for c in capacity)
            raise ValueError(
                f"--rollout.num_engines {ask.engines} x --rollout.tensor_parallel_size {tp} do "
                f"not fit: a tensor-parallel group must sit on one node, and nodes of {capacity} "
                f"{unit} hold {fits} such groups; lower --rollout.num_engines or "
                f"--rollout.tensor_parallel_size"
            )
        free[node] -= tp
        engines_on[node].append(e)
    return engines_on


def _fill(capacity: list[int], used: list[int], count: int) -> list[int]:
    """Spread `count` one-bundle ranks over the room left, in node order."""
    out = []
    for cap, taken in zip(capacity, used, strict=True):
        here = min(cap - taken, count)
        out.append(here)
        count -= here
    assert count == 0, "_check_capacity let through more ranks than bundles"
    return out


def _train_actors(train_on: list[int], ask: _Ask) -> tuple[ActorPlacement, ...]:
    """Ranks in node order; on each node they take bundles 0..k-1 (placed: their own bundles,
    colocated: the engines' bundles, which also start at 0)."""
    actors: list[ActorPlacement] = []
    for node, count in enumerate(train_on):
        for b in range(count):
            actors.append(ActorPlacement(role="train", index=len(actors), node=node,
                                         bundles=(b,), num_gpus=ask.share,
                                         num_cpus=ask.cpus_per_actor))
    return tuple(actors)


def _engine_actors(
    engines_on: list[list[int]], train_slots: list[int], ask: _Ask
) -> tuple[ActorPlacement, ...]:
    """Each engine's tp contiguous bundles, after the node's own train bundles (0 colocated)."""
    actors = []
    for node, engines in enumerate(engines_on):
        for j, e in enumerate(engines):
            start = train_slots[node] + j * ask.tp
            actors.append(ActorPlacement(role="engine", index=e, node=node,
                                         bundles=tuple(range(start, start + ask.tp)),
                                         num_gpus=ask.share, num_cpus=ask.cpus_per_actor))
    return tuple(sorted(actors, key=lambda a: a.index))
