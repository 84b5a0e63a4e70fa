"""Reward functions: `reward_fn(prompt, response, label) -> float | {"reward": float, ...}`,
named on the command line by a spec (`--reward_fn`, `--reward.url`, `--reward.model`), and
OpenRLHF-style batched reward files (`reward_func(queries, prompts, labels)`)."""

from __future__ import annotations

import json
import math
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from agentrl.plugins import load_callable, load_module_file
from agentrl.rewards.batched import BatchedReward
from agentrl.rewards.remote import RemoteReward

RewardFn = Callable[[str, str, Any], "float | dict[str, Any]"]


class RewardFunctionError(ValueError):
    """A reward function raised or returned something that is not a number."""


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
        from agentrl.rewards.model import ModelReward  # torch and the model load on use

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
