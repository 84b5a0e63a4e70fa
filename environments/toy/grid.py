"""Multi-turn: walk a small grid to its goal, around holes (a FrozenLake without the ice).

States recur by design: a handful of cells, four moves, and a group's episodes all start from
the same cell, so GiGPO (`agentrl.algorithms.gigpo`) finds many steps taken from the same state
and compares the moves made from it. The env names its state (`info["state_key"]`, the cell
`"row,col"`) and has a scripted policy (`oracle_action`, a shortest path) for warm-ups.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import numpy as np

from agentrl.envs import ChatEnv
from agentrl.envs.chat import StepResult
from agentrl.envs.template import Message

MOVES = {"U": (-1, 0), "D": (1, 0), "L": (0, -1), "R": (0, 1)}


class GridWalkEnv(ChatEnv):
    """Walk from a random cell to the goal (the bottom-right corner) of a `size` x `size` grid.

    - An answer's move is its first letter among U, D, L, R (either case: "down" and "Right"
      work); an answer with none, or a move into the border, leaves the walker where it was.
    - Reaching the goal ends the episode with reward 1; stepping into a hole ends it with 0;
      `max_moves` moves without either truncate it.
    - `progress_reward` > 0 adds a per-step reward: `progress_reward` x the shortest-path
      distance to the goal the move gained (negative for a move away), over the start's
      distance; the goal then earns 1 less what the episode earned, and a hole minus it, so a
      finished episode's rewards still sum to 1 or 0.
    - The holes are fixed by `layout` (a seed; every free cell keeps a path to the goal), so
      every episode of a run walks the same grid; each reset's seed picks only the start cell.
    """

    def __init__(self, size: int = 4, max_moves: int = 8, holes: int = 2, layout: int = 0,
                 progress_reward: float = 0.0) -> None:
        if size < 2 or max_moves < 1 or not 0 <= holes <= size * size - 2 or progress_reward < 0:
            raise ValueError(f"need size >= 2, max_moves >= 1, 0 <= holes <= size*size - 2 and "
                             f"progress_reward >= 0; got size={size}, max_moves={max_moves}, "
                             f"holes={holes}, progress_reward={progress_reward}")
        self.size, self.max_moves, self.progress_reward = size, max_moves, progress_reward
        self.goal = (size - 1, size - 1)
        self.holes, self.distance = _layout(size, holes, layout, self.goal)
        far = sorted(c for c, d in self.distance.items() if d >= 2)
        self.starts = far or sorted(c for c, d in self.distance.items() if d >= 1)
        self.cell, self.moves, self.start_distance, self.earned = self.goal, 0, 1, 0.0

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[list[Message], dict[str, Any]]:
        self.cell = self.starts[int(self.np_random.integers(len(self.starts)))]
        self.moves, self.start_distance, self.earned = 0, self.distance[self.cell], 0.0
        prompt = (
            f"Walk to the goal G on this {self.size}x{self.size} grid without stepping into a "
            f"hole O. Rows count from the top, columns from the left, both from 0. Answer with "
            f"one move: U, D, L or R.\n{self._map()}\n{self._where()}"
        )
        return [{"role": "user", "content": prompt}], {"state_key": self._state()}

    def oracle_action(self) -> str:
        """The scripted move: one that shortens the shortest path to the goal."""
        r, c = self.cell
        return min(MOVES, key=lambda m: self.distance.get(
            (r + MOVES[m][0], c + MOVES[m][1]), self.size * self.size))

    def step(self, assistant_text: str) -> StepResult:
        self.moves += 1
        move = next((ch.upper() for ch in assistant_text if ch.upper() in MOVES), None)
        before = self.distance[self.cell]
        feedback = ""
        if move is None:
            feedback = "Answer with U, D, L or R. "
        else:
            r, c = self.cell[0] + MOVES[move][0], self.cell[1] + MOVES[move][1]
            if 0 <= r < self.size and 0 <= c < self.size:
                self.cell = (r, c)
            else:
                feedback = "That is the edge of the grid. "
        info: dict[str, Any] = {"moves": self.moves, "state_key": self._state()}
        if self.cell == self.goal:
            return [], 1.0 - self.earned, True, False, info
        if self.cell in self.holes:
            return [], -self.earned, True, False, info
        reward = self.progress_reward * (before - self.distance[self.cell]) / self.start_distance
        self.earned += reward
        truncated = self.moves >= self.max_moves
        new = [{"role": "user", "content": feedback + self._where()}]
        return new, reward, False, truncated, info

    def _state(self) -> str:
        return f"{self.cell[0]},{self.cell[1]}"

    def _where(self) -> str:
        return f"You are at row {self.cell[0]}, column {self.cell[1]}."

    def _map(self) -> str:
        return "\n".join("".join(
            "G" if (r, c) == self.goal else "O" if (r, c) in self.holes else "."
            for c in range(self.size)) for r in range(self.size))


def _layout(size: int, holes: int, layout: int, goal: tuple[int, int]
            ) -> tuple[frozenset[tuple[int, int]], dict[tuple[int, int], int]]:
    """Holes drawn by `layout` (redrawn until every free cell reaches the goal) and each free
    cell's shortest-path distance to the goal."""
    rng = np.random.default_rng(layout)
    cells = [(r, c) for r in range(size) for c in range(size) if (r, c) != goal]
    for _ in range(1000):
        picked = rng.choice(len(cells), size=holes, replace=False)
        hole_set = frozenset(cells[int(i)] for i in picked)
        distance = _distances(size, hole_set, goal)
        if len(distance) == size * size - holes:
            return hole_set, distance
    raise ValueError(f"no layout of {holes} holes on a {size}x{size} grid keeps every cell "
                     f"connected to the goal; use fewer holes")


def _distances(size: int, holes: frozenset[tuple[int, int]], goal: tuple[int, int]
               ) -> dict[tuple[int, int], int]:
    """Breadth-first shortest-path distance to `goal` of each cell that reaches it."""
    distance, queue = {goal: 0}, deque([goal])
    while queue:
        r, c = queue.popleft()
        for dr, dc in MOVES.values():
            nxt = (r + dr, c + dc)
            if (0 <= nxt[0] < size and 0 <= nxt[1] < size and nxt not in holes
                    and nxt not in distance):
                distance[nxt] = distance[(r, c)] + 1
                queue.append(nxt)
    return distance
