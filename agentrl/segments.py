"""Episodes in several segments: one episode, several trajectories, one outcome.

A chat template that rewrites earlier turns (Qwen3's drops the `<think>...</think>` of earlier
assistant turns) shows the model a context that is not the previous context plus what followed.
The model's next call then starts a new *segment*: a trajectory of its own whose prompt is
exactly what the template rendered, whose policy tokens are exactly what was sampled. The
segments of one episode are trained as separate sequences, each with the episode's outcome
advantage (`agentrl.algorithms.compute_advantages(episode_ids_B=...)`); no prompt carries more
than the model saw.

Both producers mark segments the same way in `Trajectory.info`:

    "episode"        the episode's id, shared by its segments (absent: the trajectory is a
                     whole episode, its `uid` is the episode's id)
    "segment"        the segment's index in its episode, in time order
    "segment_cause"  why it started: "start" (the first), "template" (the chat template
                     rewrote the earlier conversation) or "drift" (a client sent text other
                     than what it got back, or a prompt that continues nothing recorded)

`ChatTokenEnv` starts segments in-process (`on_rewrite="segment"`), the recording proxy for a
session's calls (`servers.sessions`). Only "drift" counts as drift. Every function keeps the
trajectories' order; segments of one episode are expected in time order.

Only stdlib: `import agentrl` stays light.
"""

from __future__ import annotations

from collections.abc import Sequence

from agentrl.types import Trajectory

SEGMENT_CAUSES = ("start", "template", "drift")


def episode_key(traj: Trajectory) -> str:
    """The id of the episode `traj` is a segment of (its own `uid` when it is a whole one)."""
    episode = traj.info.get("episode")
    return str(episode) if episode is not None else f"uid:{traj.uid}"


def dense_episode_ids(trajectories: Sequence[Trajectory]) -> list[int]:
    """Integer id of each trajectory's episode, 0, 1, ... in order of first appearance, as
    `agentrl.types.dense_group_ids` numbers groups."""
    ids: dict[str, int] = {}
    return [ids.setdefault(episode_key(t), len(ids)) for t in trajectories]


def by_episode(trajectories: Sequence[Trajectory]) -> list[list[Trajectory]]:
    """The trajectories gathered into episodes (each its segments, in the order given), the
    episodes in order of first appearance."""
    episodes: dict[str, list[Trajectory]] = {}
    for t in trajectories:
        episodes.setdefault(episode_key(t), []).append(t)
    return list(episodes.values())


def episode_reward(segments: Sequence[Trajectory]) -> float:
    """An episode's total reward: the sum over its segments' turns."""
    return float(sum(t.total_reward for t in segments))


def flatten(episodes: Sequence[Sequence[Trajectory]]) -> list[Trajectory]:
    """The segments of `episodes`, in order (the inverse of `by_episode`)."""
    return [t for segs in episodes for t in segs]


def template_segments(trajectories: Sequence[Trajectory]) -> int:
    """Segments started because the chat template rewrote the earlier conversation."""
    return sum(t.info.get("segment_cause") == "template" for t in trajectories)
