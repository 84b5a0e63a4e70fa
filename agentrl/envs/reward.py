"""Single-turn RL as an environment: `RewardEnv` shows a prompt, scores one response, ends.

    env = RewardEnv(dataset=[{"prompt": "2+2?", "label": "4"}],
                    reward_fn=lambda prompt, response, label: float(label in response))

OpenRLHF-style reward files (`reward_func(queries, prompts, labels)`) load with
`load_reward_func(path)`. `SingleTurnEnv` ("agentrl/SingleTurn-v0", `agentrl train --dataset
data.jsonl --reward_fn rewards.py:score`) is the same env built from a file and a spec string.
"""

from __future__ import annotations

import json
import math
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import numpy as np

from agentrl.data import read_rows
from agentrl.envs.chat import ChatEnv, StepResult
from agentrl.envs.template import Message
from agentrl.plugins import load_callable, load_module_file

RewardFn = Callable[[str, str, Any], "float | dict[str, Any]"]


class RewardFunctionError(ValueError):
    """A reward function raised or returned something that is not a number."""


class RewardEnv(ChatEnv):
    """One-step environment over a prompt dataset and a reward function.

    Args:
        dataset: rows (mappings) or a .jsonl path; each row has `prompt_key` (a string, or a
            list of chat messages) and optionally `label_key`.
        reward_fn: `reward_fn(prompt, response, label) -> float | {"reward": float, ...}`;
            extra dict keys go to `info`.
        system_prompt: prepended as a system message when the prompt is a string.
    """

    def __init__(
        self,
        dataset: Sequence[Mapping[str, Any]] | str | Path,
        reward_fn: RewardFn,
        *,
        prompt_key: str = "prompt",
        label_key: str = "label",
        system_prompt: str | None = None,
    ) -> None:
        self.rows = (read_rows(dataset, what="dataset").rows
                     if isinstance(dataset, str | Path) else list(dataset))
        if not self.rows:
            raise ValueError("RewardEnv needs a non-empty dataset")
        for i, row in enumerate(self.rows):
            if prompt_key not in row:
                raise ValueError(
                    f"dataset row {i} has no {prompt_key!r} key (keys: {sorted(row)}); pass "
                    f"prompt_key= to name the prompt column"
                )
        if not callable(reward_fn):
            raise TypeError(f"reward_fn must be callable, got {type(reward_fn).__name__}")
        self.reward_fn = reward_fn
        self.prompt_key, self.label_key = prompt_key, label_key
        self.system_prompt = system_prompt
        self.index = -1

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[list[Message], dict[str, Any]]:
        options = options or {}
        self.index = int(options.get("index", self.np_random.integers(len(self.rows))))
        prompt = self.rows[self.index][self.prompt_key]
        if isinstance(prompt, str):
            messages = [{"role": "user", "content": prompt}]
            if self.system_prompt:
                messages.insert(0, {"role": "system", "content": self.system_prompt})
        else:
            messages = [dict(m) for m in prompt]
        return messages, {"index": self.index}

    def step(self, assistant_text: str) -> StepResult:
        row = self.rows[self.index]
        reward, extra = call_reward_fn(
            self.reward_fn,
            row[self.prompt_key],
            assistant_text,
            row.get(self.label_key),
            sample=self.index,
        )
        return [], reward, True, False, {**extra, "index": self.index}


def call_reward_fn(
    fn: RewardFn, prompt: Any, response: str, label: Any, *, sample: int
) -> tuple[float, dict[str, Any]]:
    """Call a reward function and check what it returned; errors name the function and sample."""
    name = getattr(fn, "__qualname__", repr(fn))
    where = f"reward function {name!r} on sample {sample} (prompt {str(prompt)[:80]!r})"
    try:
        out = fn(prompt, response, label)
    except Exception as e:
        raise RewardFunctionError(f"{where} raised {type(e).__name__}: {e}") from e
    extra: dict[str, Any] = {}
    if isinstance(out, Mapping):
        if "reward" not in out:
            raise RewardFunctionError(
                f"{where} returned a dict without a 'reward' key: {sorted(out)}"
            )
        extra = {k: v for k, v in out.items() if k != "reward"}
        out = out["reward"]
    if hasattr(out, "item") and getattr(out, "size", getattr(out, "numel", lambda: 1)) in (1,):
        out = out.item()
    if isinstance(out, bool) or not isinstance(out, int | float | np.number):
        raise RewardFunctionError(
            f"{where} returned {out!r} ({type(out).__name__}); expected a float or "
            f"{{'reward': float, ...}}"
        )
    if not math.isfinite(float(out)):
        raise RewardFunctionError(f"{where} returned a non-finite reward {out!r}")
    return float(out), extra


def load_reward_func(path: str | Path) -> RewardFn:
    """Load an OpenRLHF-style reward file defining `reward_func(queries, prompts, labels)`.

    It may return a list/tensor of rewards or a dict with a "rewards" entry; the adapter
    returned here scores one sample at a time as `reward_fn(prompt, response, label)`, with
    query = prompt + response as OpenRLHF passes it.
    """
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"reward file {str(path)!r} does not exist")
    module = load_module_file(path)
    func = getattr(module, "reward_func", None)
    if not callable(func):
        # ValueError, not TypeError: a bad reward file, which the CLIs report as a bad value.
        raise ValueError(f"{path} must define reward_func(queries, prompts, labels)")  # noqa: TRY004

    def reward_fn(prompt: Any, response: str, label: Any) -> float | dict[str, Any]:
        text = prompt if isinstance(prompt, str) else json.dumps(prompt)
        out = func([text + response], [text], [label])
        if isinstance(out, Mapping):
            rewards = out.get("rewards", out.get("scores"))
            extra = {k: _first(v) for k, v in out.items() if k not in ("rewards", "scores")}
            return {"reward": _first(rewards), **extra}
        return _first(out)

    reward_fn.__qualname__ = f"{path.name}:reward_func"
    return reward_fn


def _first(x: Any) -> Any:
    if hasattr(x, "tolist"):
        x = x.tolist()
    return x[0] if isinstance(x, list | tuple) else x


def reward_fn_from_spec(spec: str, **remote: Any) -> RewardFn:
    """`--reward_fn`: `file.py:fn` or `package.module:fn` scoring `fn(prompt, response, label)`
    one sample at a time, or a bare `file.py` defining OpenRLHF's batched
    `reward_func(queries, prompts, labels)`; an http(s) URL is a reward service (`RemoteReward`,
    with the `remote` options)."""
    if spec.startswith(REWARD_MODEL_PREFIX):
        from trainers.reward_model import ModelReward  # trainers' model code, loaded on use

        key = (spec, tuple(sorted(remote.items())))
        with _clients_lock:
            if key not in _clients:
                _clients[key] = ModelReward(spec[len(REWARD_MODEL_PREFIX):], **remote)
            return _clients[key]
    if spec.startswith(("http://", "https://")):
        key = (spec, tuple(sorted(remote.items())))
        with _clients_lock:  # one client (one batching queue) per service in a process
            if key not in _clients:
                _clients[key] = RemoteReward(spec, **remote)
            return _clients[key]
    if spec.endswith(".py"):
        return load_reward_func(spec)
    return load_callable(spec, "reward_fn")


REWARD_MODEL_PREFIX = "reward-model:"
"""`reward-model:DIR` scores with a reward model trained by `agentrl rm` (`--reward.model`)."""
_clients: dict[tuple[str, tuple[tuple[str, Any], ...]], BatchedReward] = {}
_clients_lock = threading.Lock()


class SingleTurnEnv(RewardEnv):
    """`RewardEnv` from a dataset file and a reward spec (what `agentrl train --dataset ...
    --reward_fn ...` builds); it pickles by the spec, as user functions may not."""

    def __init__(self, dataset: str, reward_fn: str, *, prompt_key: str = "prompt",
                 label_key: str = "label", system_prompt: str | None = None,
                 reward_options: dict[str, Any] | None = None) -> None:
        """`reward_options`: for a reward service URL, `RemoteReward`'s keyword arguments."""
        self.reward_spec, self.reward_options = reward_fn, dict(reward_options or {})
        super().__init__(dataset, reward_fn_from_spec(reward_fn, **self.reward_options),
                         prompt_key=prompt_key, label_key=label_key,
                         system_prompt=system_prompt)

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k != "reward_fn"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.reward_fn = reward_fn_from_spec(self.reward_spec, **self.reward_options)


class RewardServiceError(RuntimeError):
    """The reward service did not score a sample: the episode is discarded and counted."""


class BatchedReward:
    """`reward_fn(prompt, response, label)` whose calls from concurrent episodes (env steps run
    in a thread pool) are scored together: up to `max_batch` at a time, gathered for
    `window_s`, by `_score` (a subclass's). A failure ends the episodes of that batch as
    discarded (`RewardServiceError`: counted, not a crashed run)."""

    def __init__(self, name: str, *, max_batch: int = 64, window_s: float = 0.01,
                 wait_s: float = 600.0) -> None:
        import queue
        import threading

        self.max_batch, self.window_s, self.wait_s = max_batch, window_s, wait_s
        self.__qualname__ = name  # how errors name it
        self._queue: queue.SimpleQueue[tuple[dict[str, Any], Future[dict[str, Any]]]] = (
            queue.SimpleQueue())
        self._sender: threading.Thread | None = None
        self._lock = threading.Lock()

    def _score(self, items: list[dict[str, Any]]) -> list[dict[str, Any] | RewardServiceError]:
        """Each item's {"reward": float, **info}, or the error for it."""
        raise NotImplementedError

    def __call__(self, prompt: Any, response: str, label: Any) -> dict[str, Any]:
        import threading

        done: Future[dict[str, Any]] = Future()
        self._queue.put(({"prompt": prompt, "response": response, "label": label}, done))
        with self._lock:
            if self._sender is None:
                self._sender = threading.Thread(target=self._send_loop, daemon=True,
                                                name="agentrl-reward-client")
                self._sender.start()
        # The sender answers every call; the bound only guards against a bug leaving one hung.
        return done.result(timeout=self.wait_s)

    def _send_loop(self) -> None:
        import queue
        import time

        while True:
            batch = [self._queue.get()]
            deadline = time.monotonic() + self.window_s
            while len(batch) < self.max_batch:
                try:
                    batch.append(self._queue.get(timeout=max(0.0, deadline - time.monotonic())))
                except queue.Empty:
                    break
            try:
                results = self._score([item for item, _ in batch])
            except Exception as e:  # noqa: BLE001 - whatever it is, no episode may hang on it
                error = e if isinstance(e, RewardServiceError) else RewardServiceError(
                    f"{self.__qualname__}: {type(e).__name__}: {e}")
                for _, done in batch:
                    done.set_exception(error)
                continue
            for (_, done), result in zip(batch, results, strict=True):
                if isinstance(result, RewardServiceError):
                    done.set_exception(result)
                else:
                    done.set_result(result)


class RemoteReward(BatchedReward):
    """Scored by an HTTP reward service (`agentrl reward-serve`): POST {"items": [{"prompt",
    "response", "label"}, ...]} -> {"rewards": [...], "infos": [...]}. A timeout or 5xx is
    retried `retries` times; then, or on a 4xx or a malformed answer, `RewardServiceError`."""

    def __init__(self, url: str, *, timeout_s: float = 30.0, retries: int = 2,
                 max_batch: int = 64, window_s: float = 0.01) -> None:
        super().__init__(f"reward service {url}", max_batch=max_batch, window_s=window_s,
                         wait_s=(retries + 1) * timeout_s + 60)
        self.url, self.timeout_s, self.retries = url, timeout_s, retries
        self.requests = 0
        """HTTP requests sent (batches and retries)."""
        self._client: Any = None
        """The sender thread's httpx.Client, made at its first batch and kept: every batch
        after it goes over the same kept-alive connection. A client per batch (its TLS context
        and a new connection each time) cost 22.4 ms a batch against a local service, the kept
        one 0.94 ms (one-item batches, plain http on loopback, 2-vCPU AMD EPYC)."""

    def _score(self, items: list[dict[str, Any]]) -> list[dict[str, Any] | RewardServiceError]:
        return self._post(items)

    def _post(self, items: list[dict[str, Any]]) -> list[dict[str, Any] | RewardServiceError]:
        import httpx

        if self._client is None:
            self._client = httpx.Client(timeout=self.timeout_s)
        why = ""
        for attempt in range(self.retries + 1):
            self.requests += 1
            try:
                r = self._client.post(self.url, json={"items": items})
            except httpx.HTTPError as e:
                why = f"{type(e).__name__}: {e}"
                continue
            if r.status_code >= 500:
                why = f"HTTP {r.status_code}: {r.text[:200]}"
                continue
            if r.status_code != 200:
                raise RewardServiceError(f"reward service {self.url} refused the batch: HTTP "
                                         f"{r.status_code}: {r.text[:300]}")
            return _results(self.url, r, len(items))
        raise RewardServiceError(f"reward service {self.url} did not answer ({why}) in "
                                 f"{self.retries + 1} tries of {self.timeout_s:g} s")


def _results(url: str, r: Any, n: int) -> list[dict[str, Any] | RewardServiceError]:
    """Each item's {"reward": float, **info}, or the error the service gave for it."""
    try:
        body = r.json()
        rewards = body["rewards"]
        infos, errors = body.get("infos") or [{}] * n, body.get("errors") or [None] * n
        if not len(rewards) == len(infos) == len(errors) == n:
            raise ValueError(f"{len(rewards)} rewards for {n} items")
        return [RewardServiceError(f"reward service {url}: {e}") if e is not None
                else {"reward": float(x), **dict(i)}
                for x, i, e in zip(rewards, infos, errors, strict=True)]
    except (ValueError, KeyError, TypeError) as e:
        raise RewardServiceError(f"reward service {url} answered malformed JSON ({e}); it "
                                 f"must return {{\"rewards\": [float, ...]}} with one reward "
                                 f"per item") from None
