"""Rows that are segments of one episode, laid end to end (and back).

An episode whose chat template rewrote its history is trained as several rows (segments, see
`agentrl.segments`), but it has one outcome. The advantage estimators see it as one sequence:
its segments' rows concatenated in time order, ``[E, S * T]``. Their padding and prompt tokens
are off the mask, and every estimator walks action tokens only, so the concatenation is exactly
the episode's action tokens in order: a group baseline counts the episode once (its score is
the sum of its segments' rewards), returns and GAE flow from later segments into earlier ones,
and every segment's tokens get the episode's outcome advantage.

Shape suffixes: ``_B`` rows, ``_T`` tokens, ``_E`` episodes; ``S`` is the most segments of an
episode. Pure functions; ``to_episodes_reference`` is the plain-loop reference.
"""

from __future__ import annotations

import torch
from torch import Tensor

from agentrl.algorithms._common import group_index


def episode_layout(episode_ids_B: Tensor) -> tuple[Tensor, Tensor, int, int]:
    """``(index_B, position_B, E, S)``: each row's episode (0..E-1) and its place among its
    episode's rows (0..S-1, in row order), the number of episodes and the most rows of one."""
    if episode_ids_B.dim() != 1:
        raise ValueError(f"episode_ids_B must be 1-D [B]; got shape {tuple(episode_ids_B.shape)}.")
    _, index_B, counts_E = group_index(episode_ids_B)
    order_B = torch.sort(index_B, stable=True).indices
    starts_E = counts_E.cumsum(0) - counts_E
    position_B = torch.empty_like(index_B)
    position_B[order_B] = torch.arange(index_B.numel(), device=index_B.device) - starts_E[
        index_B[order_B]]
    num_episodes = int(counts_E.numel())
    return index_B, position_B, num_episodes, int(counts_E.max()) if num_episodes else 0


def to_episodes(x_BT: Tensor, index_B: Tensor, position_B: Tensor, num_episodes: int,
                max_segments: int) -> Tensor:
    """``[B, T] -> [E, S * T]``: each episode's rows end to end in order, zero-padded."""
    T = x_BT.shape[1]
    out = x_BT.new_zeros(num_episodes, max_segments, T)
    out[index_B, position_B] = x_BT
    return out.reshape(num_episodes, max_segments * T)


def from_episodes(x_ET: Tensor, index_B: Tensor, position_B: Tensor, max_segments: int) -> Tensor:
    """``[E, S * T] -> [B, T]``: the inverse of :func:`to_episodes`."""
    E, ST = x_ET.shape
    return x_ET.reshape(E, max_segments, ST // max_segments)[index_B, position_B]


def episode_group_ids(group_ids_B: Tensor, index_B: Tensor, num_episodes: int) -> Tensor:
    """``[E]``: the group of each episode; a ``ValueError`` if an episode's rows disagree."""
    first_E = torch.full((num_episodes,), -1, dtype=torch.long, device=index_B.device)
    rows_B = torch.arange(index_B.numel(), device=index_B.device)
    # The first row of each episode names its group.
    first_E = first_E.scatter_reduce(0, index_B, rows_B, "amin", include_self=False)
    groups_E = group_ids_B[first_E]
    if bool((groups_E[index_B] != group_ids_B).any()):
        bad = int(index_B[groups_E[index_B] != group_ids_B][0])
        raise ValueError(
            f"the segments of one episode must share a group; episode {bad} has rows in groups "
            f"{sorted(set(group_ids_B[index_B == bad].tolist()))}. Give every segment of an "
            "episode its episode's group (the producers do: proxy sessions, ChatTokenEnv)."
        )
    return groups_E


def to_episodes_reference(x_BT: Tensor, episode_ids_B: Tensor) -> tuple[Tensor, list[int]]:
    """Plain-loop :func:`to_episodes`: episodes in order of their sorted ids, each its rows
    concatenated in row order, right-padded with zeros to whole rows; and the episode ids."""
    ids = sorted(set(episode_ids_B.tolist()))
    rows = [[b for b in range(x_BT.shape[0]) if int(episode_ids_B[b]) == e] for e in ids]
    width = max(len(r) for r in rows) * x_BT.shape[1]
    out = x_BT.new_zeros(len(ids), width)
    for e, members in enumerate(rows):
        flat = torch.cat([x_BT[b] for b in members])
        out[e, : flat.numel()] = flat
    return out, ids
