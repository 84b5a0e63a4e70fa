"""Sessions: every call's exact prompt ids and sampled ids, merged into Trajectories.

A session is an append-only log of calls. Trajectories are rebuilt from the log by one rule:

    a call whose prompt ids start with the running ids of an open branch (that branch's
    prompt + sampled ids so far) extends it: the new suffix is an observation, the sampled
    tokens an action. Otherwise the call starts a new segment. Its cause (`agentrl.segments`)
    is "template" where the call carried back a reply unchanged but the chat template rewrote
    the conversation before it (`CallRecord.rewritten`: Qwen3 drops earlier reasoning), and
    "drift" otherwise (the client changed text): only those count as drift events.

The segments of a session are one episode (`info["episode"]` = the session id): the trainer
gives each the episode's outcome advantage. A session that asked for n > 1 choices is not:
its forks are alternatives, each trajectory an episode of its own.

A call with n > 1 choices forks its branch into n (choice i gets action i); a later call
extends whichever fork its prompt continues, longest match first. A retried request
(`x-stainless-retry-count > 0`) replaces the latest call with the same prompt ids instead of
adding a duplicate turn. Aborted calls (client disconnect) are kept in the log, marked, and
left out of the trajectories: the client never saw them, so no later call continues them.

Every change to a session (record, reward, close) goes through its `journal` when it has one:
that is how `servers.durable.SqliteSessionStore` keeps sessions across restarts. Routes
`await store.sync()` before answering, so a turn a client has seen is stored. A reward is
checked before anything changes: it and the session's sums stay finite, or it is refused.
A session whose stored log could not all be read back says so (`store_errors`): its
trajectories are exported marked `discard`, with the errors in their `info`.
"""

from __future__ import annotations

import collections
import copy
import hashlib
import json
import math
import re
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from agentrl.completion import Completion
from agentrl.seeding import derive_seed
from agentrl.types import Image, Trajectory, TrajectoryBuilder
from servers.finite import finite

SESSION_ID_PATTERN = r"^[A-Za-z0-9_.\-]{1,128}$"
_SESSION_ID = re.compile(SESSION_ID_PATTERN)


def check_session_id(session_id: str) -> str:
    """The id if it is 1-128 letters, digits, `_`, `.` or `-`; else a ValueError saying so."""
    if not _SESSION_ID.fullmatch(session_id) or session_id in (".", ".."):
        shown = session_id if len(session_id) <= 40 else session_id[:40] + "..."
        raise ValueError(f"invalid session id {shown!r} ({len(session_id)} characters): use 1 "
                         f"to 128 letters, digits, '_', '.' or '-'")
    return session_id


def context_key(messages: Sequence[dict], tools: Sequence[dict] | None) -> str:
    """A digest of a conversation as the client sent it (messages and tools)."""
    text = json.dumps([list(messages), list(tools or ())], sort_keys=True, ensure_ascii=False,
                      separators=(",", ":"))
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


def reply_key(content: str | None, calls: Sequence[tuple[str, str | dict]]) -> str:
    """An assistant reply as a client sends it back: its text and its tool calls' names and
    arguments (as canonical JSON, so re-serialised arguments still match), not the call ids."""
    return json.dumps([content or "", [[name, _canonical(args)] for name, args in calls]],
                      ensure_ascii=False)


def _canonical(args: str | dict) -> str:
    value: object = args
    if isinstance(args, str):
        try:
            value = json.loads(args)
        except ValueError:
            return args
    return json.dumps(value, sort_keys=True, ensure_ascii=False, separators=(",", ":"))


class ResponseHistory:
    """The conversations behind recent Responses-API answers, for `previous_response_id`: each
    response id maps to its session and the chat messages up to and including its output.

    In memory and bounded (the oldest are forgotten first): a client that needs a conversation
    to outlive the server sends its items again, which merge by their sampled tokens anyway."""

    def __init__(self, max_entries: int = 10_000) -> None:
        self.max_entries = max_entries
        self._entries: collections.OrderedDict[str, tuple[str | None, list[dict]]] = (
            collections.OrderedDict())
        self._lock = threading.Lock()

    def put(self, response_id: str, session_id: str | None, messages: list[dict]) -> None:
        with self._lock:
            self._entries[response_id] = (session_id, messages)
            while len(self._entries) > self.max_entries:
                self._entries.popitem(last=False)

    def get(self, response_id: str, session_id: str | None) -> list[dict] | None:
        """The conversation of `response_id` if it was answered in this session."""
        with self._lock:
            entry = self._entries.get(response_id)
        if entry is None or entry[0] != session_id:
            return None
        return copy.deepcopy(entry[1])


class StoreError(RuntimeError):
    """The session store cannot be opened or written."""


@dataclass
class CallRecord:
    """One proxied generation call, exactly as the engine saw and produced it."""

    call_id: str
    prompt_ids: list[int]
    choices: list[Completion]
    images: list[Image] = field(default_factory=list)
    """Images in the prompt with their placeholder positions (prompt-relative)."""
    aborted: bool = False
    retry_count: int = 0
    created: float = field(default_factory=time.time)
    context_key: str | None = None
    """`context_key` of the request's messages and tools: what the call was asked."""
    reply_keys: list[str] = field(default_factory=list)
    """`reply_key` of each choice as the client got it, so that a later request carrying that
    reply back continues from the very tokens sampled (not a re-rendering of them)."""
    rewritten: bool = False
    """The request carried back a reply unchanged, but the chat template rewrote the
    conversation before it: the prompt is the template's whole rendering, a new segment."""


@dataclass
class RewardRecord:
    value: float
    call_id: str | None
    choice: int | None


@dataclass
class _Branch:
    builder: TrajectoryBuilder
    calls: list[tuple[str, int]]  # (call_id, choice) per turn
    cause: str
    """Why the branch started (`agentrl.segments.SEGMENT_CAUSES`); a fork, its base's."""

    @property
    def drift(self) -> bool:
        """Whether a client's changed text started this branch."""
        return self.cause == "drift"

    def fork(self) -> _Branch:
        return _Branch(copy.deepcopy(self.builder), list(self.calls), self.cause)


class Session:
    """One agent episode (or several segments of it). Not thread-safe by itself; see the store."""

    def __init__(self, session_id: str, *, group: str | None = None, info: dict | None = None,
                 seed: int | None = None):
        self.id = session_id
        self.group = group
        self.info: dict = dict(info or {})
        self.seed = seed
        """Seeds the sampling of calls that set no seed of their own (`call_seed`)."""
        self._calls_seeded = 0
        self.created = time.time()
        self.closed = False
        self.terminated = False
        self.truncated = False
        self.calls: list[CallRecord] = []
        self.rewards: list[RewardRecord] = []
        self._reward_sizes = 0.0
        """The sum of |reward| over `rewards`: every sum of rewards is at most this."""
        self.replaced_calls = 0
        self.in_flight = 0
        self.journal: Callable[[str, Any], None] | None = None
        """Called with (kind, payload) after each change: "call", "reward", "close"."""
        self.store_errors: list[str] = []
        """Events of this session the store could not read back (skipped when replayed)."""
        self._cache: tuple[list[Trajectory], int] | None = None
        self._version = 0

    def call_seed(self) -> int | None:
        """The sampling seed of the session's next call when it sets none (None without a
        session seed): call k's is derive_seed(seed, k), so an agent that calls one at a time
        samples the same tokens on every run of the same seed, however the engine batches it
        with other sessions' calls. Every call draws one, seeded or not; a retry counts as a
        new call. A session read back from a durable store goes on after its recorded calls."""
        k = max(self._calls_seeded, len(self.calls) + self.replaced_calls)
        self._calls_seeded = k + 1
        return None if self.seed is None else derive_seed(self.seed, k)

    # -- recording ------------------------------------------------------------------------

    def record(self, call: CallRecord) -> None:
        if call.retry_count > 0:
            for i in range(len(self.calls) - 1, -1, -1):
                if self.calls[i].prompt_ids == call.prompt_ids:
                    del self.calls[i]
                    self.replaced_calls += 1
                    break
        self.calls.append(call)
        self._version += 1
        if self.journal is not None:
            self.journal("call", call)

    def add_reward(
        self,
        value: float,
        *,
        call_id: str | None = None,
        choice: int | None = None,
        terminated: bool = True,
        truncated: bool = False,
        info: dict | None = None,
    ) -> None:
        if call_id is not None and not any(c.call_id == call_id for c in self.calls):
            known = [c.call_id for c in self.calls[-5:]]
            raise KeyError(f"session {self.id!r} has no call {call_id!r}; recent calls: {known}")
        if call_id is None and not self.completed_calls():
            raise KeyError(f"session {self.id!r} has no completed call to reward yet")
        value = self._checked_reward(value)
        self.rewards.append(RewardRecord(value, call_id, choice))
        self._reward_sizes += abs(value)
        self.terminated = self.terminated or terminated
        self.truncated = self.truncated or truncated
        self.info.update(info or {})
        self._version += 1
        if self.journal is not None:
            self.journal("reward", {"value": value, "call_id": call_id, "choice": choice,
                                    "terminated": terminated, "truncated": truncated,
                                    "info": info or {}})

    def _checked_reward(self, value: float) -> float:
        """`value` as a float, or a ValueError (nothing changed) when it, or a sum it joins,
        is not finite: a turn's reward and the session's total are sums of rewards, and an
        infinite one cannot be answered or exported (JSON has no Infinity; #34)."""
        reward = finite(value, "a reward")
        if not math.isfinite(self._reward_sizes + abs(reward)):
            raise ValueError(f"the reward {reward!r} would take the rewards of session "
                             f"{self.id!r} past the float range: their sizes (|reward|) must "
                             f"add up to less than 1.8e308, so that every sum of them (the "
                             f"session's total, each turn's) is finite; send smaller rewards")
        return reward

    def flag(self, error: str) -> None:
        """Note that part of this session was lost (`store_errors`)."""
        self.store_errors.append(error)
        self._version += 1

    def close(self) -> None:
        self.closed = True
        self._version += 1
        if self.journal is not None:
            self.journal("close", {})

    def completed_calls(self) -> list[CallRecord]:
        return [c for c in self.calls if not c.aborted]

    def find_reply(self, context: str, reply: str) -> tuple[CallRecord, int] | None:
        """The latest completed call asked `context` whose choice answered `reply`."""
        for call in reversed(self.calls):
            if call.aborted or call.context_key != context:
                continue
            for i, key in enumerate(call.reply_keys):
                if key == reply and i < len(call.choices):
                    return call, i
        return None

    # -- merging --------------------------------------------------------------------------

    def trajectories(self) -> list[Trajectory]:
        """One Trajectory per segment (and per choice of n > 1 forks), in creation order."""
        if self._cache is not None and self._cache[1] == self._version:
            return self._cache[0]
        branches = self._merge()
        last = self.completed_calls()[-1].call_id if self.completed_calls() else None
        rewards: dict[tuple[str, int | None], float] = {}
        for r in self.rewards:
            key = (r.call_id or last or "", r.choice)
            rewards[key] = rewards.get(key, 0.0) + r.value
        out = []
        # One episode, unless n > 1 forked it into alternatives (module docstring).
        forked = any(len(c.choices) > 1 for c in self.completed_calls())
        episode = {} if forked else {"episode": self.id}
        for seg, b in enumerate(branches):
            for turn, (call_id, choice) in zip(b.builder.turns, b.calls, strict=True):
                turn.reward = rewards.get((call_id, None), 0.0) + rewards.get(
                    (call_id, choice), 0.0
                )
            traj = b.builder.build(
                terminated=self.terminated,
                truncated=self.truncated,
                info={
                    **self.info,
                    "session_id": self.id,
                    **episode,
                    "segment": seg,
                    "segment_cause": b.cause,
                    "drift": b.drift,
                    "calls": [c for c, _ in b.calls],
                    "choices": [i for _, i in b.calls],
                    **({"store_errors": list(self.store_errors)} if self.store_errors else {}),
                },
            )
            traj.uid = f"{self.id}-{seg}"
            # Part of the session is missing (a reward, a call): nothing to train on.
            traj.discard = bool(self.store_errors)
            out.append(traj)
        self._cache = (out, self._version)
        return out

    @property
    def drift_events(self) -> int:
        return sum(b.drift for b in self._merge())

    def _merge(self) -> list[_Branch]:
        branches: list[_Branch] = []
        leaves: list[int] = []  # indices into branches that can still be extended
        for call in self.completed_calls():
            best = _longest_prefix_leaf(branches, leaves, call.prompt_ids)
            if best is None:
                cause = ("template" if call.rewritten else "drift") if branches else "start"
                base = _Branch(TrajectoryBuilder(group=self.group), [], cause)
                base_len = 0
            else:
                base = branches[best]
                leaves.remove(best)
                base_len = len(base.builder.token_ids)
            new_images = [_shift(im) for im in call.images if im.start >= base_len]
            forks = [base] + [base.fork() for _ in call.choices[1:]]
            for i, (b, comp) in enumerate(zip(forks, call.choices, strict=True)):
                b.builder.add_observation(call.prompt_ids[base_len:], new_images)
                b.builder.add_action(
                    comp.token_ids,
                    comp.logprobs,
                    policy_version=comp.policy_version,
                    finish_reason=comp.finish_reason,
                    version_changes=comp.version_changes,
                )
                b.calls.append((call.call_id, i))
                if i == 0 and best is not None:
                    leaves.append(best)
                else:
                    branches.append(b)
                    leaves.append(len(branches) - 1)
        return branches

    def summary(self) -> dict:
        done = self.completed_calls()
        branches = self._merge()
        return {
            "id": self.id,
            "object": "session",
            "created": int(self.created),
            "group": self.group,
            "seed": self.seed,
            "closed": self.closed,
            "num_calls": len(done),
            "aborted_calls": len(self.calls) - len(done),
            "in_flight": self.in_flight,
            "replaced_calls": self.replaced_calls,
            "drift_events": sum(b.drift for b in branches),
            "template_segments": sum(b.cause == "template" for b in branches),
            "num_trajectories": len(branches),
            "reward": sum(r.value for r in self.rewards),
            "store_errors": list(self.store_errors),
        }


def _longest_prefix_leaf(
    branches: list[_Branch], leaves: list[int], prompt: Sequence[int]
) -> int | None:
    best, best_len = None, -1
    for i in leaves:
        ids = branches[i].builder.token_ids
        n = len(ids)
        if best_len < n <= len(prompt) and prompt[:n] == ids:
            best, best_len = i, n
    return best


def _shift(im: Image) -> Image:
    # Prompt positions equal trajectory positions: the prompt extends the branch's ids.
    return Image(pixels=im.pixels, start=im.start, end=im.end)


class SessionStore(Protocol):
    def get(self, session_id: str) -> Session | None: ...
    def create(
        self, session_id: str | None = None, *, group: str | None = None,
        info: dict | None = None, seed: int | None = None,
    ) -> Session: ...
    def list(self) -> list[Session]: ...
    def delete(self, session_id: str) -> bool: ...
    async def sync(self) -> None:
        """Return once every change made so far is stored (a no-op in memory)."""


class InMemorySessionStore:
    """Sessions in a dict. A lock guards the dict so a trainer thread may read while the
    server's event loop records."""

    def __init__(self) -> None:
        self._sessions: dict[str, Session] = {}
        self._lock = threading.Lock()

    def get(self, session_id: str) -> Session | None:
        return self._sessions.get(session_id)

    def create(
        self, session_id: str | None = None, *, group: str | None = None,
        info: dict | None = None, seed: int | None = None,
    ) -> Session:
        with self._lock:
            sid = uuid.uuid4().hex if session_id is None else check_session_id(session_id)
            if sid in self._sessions:
                raise KeyError(f"session {sid!r} already exists")
            session = Session(sid, group=group, info=info, seed=seed)
            self._sessions[sid] = session
            return session

    def list(self) -> list[Session]:
        with self._lock:
            return list(self._sessions.values())

    def delete(self, session_id: str) -> bool:
        with self._lock:
            return self._sessions.pop(session_id, None) is not None

    async def sync(self) -> None:
        return None
