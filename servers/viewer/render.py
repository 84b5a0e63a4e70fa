"""What the viewer's pages show of a record: its turns' tokens, decoded one by one, with the
sampler's log-prob, the policy version and the advantage of each; tool calls; images; the
prompt's group side by side.

What a run's rollouts hold (they are written before the step trains): each token's id, its
sampler log-prob and the policy version that sampled it, each turn's reward, the episode's
info. What the step then computed is in its trained/ file (`agentrl.trained_files`, read by
`servers.viewer.trained`): for each trajectory it trained on, the trainer's log-prob of each
sampled token before the update and the advantage the loss used. Where it is, a token shows
its mismatch (sampler minus trainer log-prob, whose token mean is the step's `mismatch`
metric) and the trainer's advantage. Where it is not (an older run, a trajectories file, a
proxy's sessions), the viewer recomputes the outcome advantage of the group estimators
(`group_norm`, `dr_grpo`, `rloo`: the same for every token of an episode with gamma 1) from
the rewards of the step's kept episodes, as `agentrl.algorithms` defines them, before dynamic
filtering and reward shaping; other estimators' advantages depend on the trainer's state (a
critic, whitening over the batch) and are not shown. A record that carries its own
`trainer_logprobs` or `advantages` (aligned with `token_ids`) is shown with them.

Every string sent to the page has its control and bidi characters made visible
(`agentrl.terminal_safe.visible`); the page puts strings in as text, never as markup.
"""

from __future__ import annotations

import json
import math
import statistics
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from agentrl.completion import expand_versions
from agentrl.envs.tool_calls import find_tool_calls
from agentrl.terminal_safe import visible
from servers.viewer.index import Summary, reward_parts
from servers.viewer.trained import Aligned

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

GROUP_ESTIMATORS = ("group_norm", "dr_grpo", "rloo")
"""The estimators whose advantage the viewer recomputes (module docstring)."""
GROUP_NORM_EPS = 1e-9
"""As `agentrl.algorithms.advantages.GROUP_NORM_EPS` (not imported: it would load torch)."""
MAX_TEXT = 20_000
"""Characters of a group member's completion shown side by side."""


class Decoder:
    """Token ids to text, one token at a time (cached per id). The tokenizer loads in a thread
    so the first page does not wait for it; without one (none named, or it failed to load)
    a token shows as its id."""

    def __init__(self, name: str | None) -> None:
        self.name = name
        self.error: str | None = None if name else "no tokenizer named (--tokenizer)"
        self._tokenizer: PreTrainedTokenizerBase | None = None
        self._cache: dict[int, str] = {}
        self._ready = threading.Event()
        if name:
            threading.Thread(target=self._load, name="viewer-tokenizer", daemon=True).start()
        else:
            self._ready.set()

    def _load(self) -> None:
        try:
            from agentrl.models import load_tokenizer

            assert self.name is not None
            self._tokenizer = load_tokenizer(self.name)
        except Exception as e:  # noqa: BLE001 (the page shows ids and says why)
            self.error = f"tokenizer {self.name!r} did not load: {type(e).__name__}: {e}"[:500]
        finally:
            self._ready.set()

    def wait(self, timeout_s: float = 120.0) -> None:
        self._ready.wait(timeout_s)

    def texts(self, ids: Sequence[int]) -> list[str]:
        """Each token's text, as it reads in the decoded sequence (control characters made
        visible), or `⟨id⟩` without a tokenizer."""
        self.wait()
        tok = self._tokenizer
        if tok is None:
            return [f"\u27e8{i}\u27e9" for i in ids]
        missing = [i for i in dict.fromkeys(ids) if i not in self._cache]
        for i in missing:
            try:
                self._cache[i] = visible(str(tok.decode([i])))
            except Exception:  # noqa: BLE001 (an id the vocabulary lacks)
                self._cache[i] = f"\u27e8{i}?\u27e9"
        return [self._cache[i] for i in ids]

    def text(self, ids: Sequence[int]) -> str:
        self.wait()
        if self._tokenizer is None:
            return "".join(self.texts(ids))
        return visible(str(self._tokenizer.decode(list(ids))))


# ------------------------------------------------------------------------------ advantages
def group_advantages(estimator: str | None, summaries: Sequence[Summary]) -> dict[int, float]:
    """The outcome advantage of each kept episode of a step, by file line (every segment of an
    episode gets the episode's), for the group estimators; empty for the others.

    Episode score r = the sum of its segments' rewards; over a group of n kept episodes:
    group_norm (r - mean) / (std_unbiased + 1e-9), dr_grpo r - mean, rloo r - mean of the
    others; 0 where the group scored all equal (`agentrl.algorithms.advantages`)."""
    if estimator not in GROUP_ESTIMATORS:
        return {}
    scores: dict[str, float] = {}
    group_of: dict[str, str] = {}
    lines: dict[str, list[int]] = {}
    for s in summaries:
        if s["corrupt"] or s["discard"]:
            continue
        key = s["episode"]
        scores[key] = scores.get(key, 0.0) + s["reward"]
        group_of.setdefault(key, str(s["group"]) if s["group"] is not None else f"row:{key}")
        lines.setdefault(key, []).append(s["line"])
    by_group: dict[str, list[str]] = {}
    for key, g in group_of.items():
        by_group.setdefault(g, []).append(key)
    out: dict[int, float] = {}
    for keys in by_group.values():
        r = [scores[k] for k in keys]
        for k, adv in zip(keys, _outcome(estimator, r), strict=True):
            out.update(dict.fromkeys(lines[k], adv))
    return out


def _outcome(estimator: str, r: list[float]) -> list[float]:
    n = len(r)
    if n < 2 or max(r) == min(r):
        return [0.0] * n
    mean = sum(r) / n
    if estimator == "rloo":
        return [x - (sum(r) - x) / (n - 1) for x in r]
    if estimator == "dr_grpo":
        return [x - mean for x in r]
    std = statistics.stdev(r)
    return [(x - mean) / (std + GROUP_NORM_EPS) for x in r]


# ------------------------------------------------------------------------------ records
def episode_view(record: dict[str, Any], summary: Summary, advantage: float | None,
                 siblings: list[Summary], group: list[Summary]) -> dict[str, Any]:
    """An episode's page: its summary, turns (without tokens), info, reward parts, images,
    its other segments and its group."""
    info = record.get("info")
    info = info if isinstance(info, dict) else {}
    turns = [{
        "index": i, "reward": float(t.get("reward", 0.0)),
        "policy_version": int(t.get("policy_version", 0)),
        "versions": [int(t.get("policy_version", 0)),
                     *(int(v) for _, v in t.get("version_changes", ()))],
        "finish_reason": visible(str(t.get("finish_reason", ""))),
        "observation_tokens": int(t["start"]) - int(t["obs_start"]),
        "action_tokens": int(t["end"]) - int(t["start"]),
    } for i, t in enumerate(record["turns"])]
    return {
        "summary": visible_fields(summary),
        "advantage": advantage,
        "turns": turns,
        "info": visible(json.dumps(info, indent=1, ensure_ascii=False, default=str)),
        "reward_parts": {visible(k): v for k, v in reward_parts(info).items()},
        "images": [{"index": i, "start": im.get("start", -1), "end": im.get("end", -1),
                    "shape": im.get("shape")} for i, im in enumerate(record.get("images") or ())],
        "segments": [_brief(s) for s in siblings],
        "group": [_brief(s) for s in group],
    }


def turn_view(record: dict[str, Any], turn: int, decoder: Decoder, advantage: float | None, *,
              trained: Aligned | None = None, trained_note: str = "") -> dict[str, Any]:
    """One turn: the observation before it and the sampled tokens, each with its id and text;
    the sampled ones with log-prob, version, advantage and (when recorded) mismatch.
    `trained`: the trainer's log-probs and advantages of the record's tokens (its step's
    trained/ file), else `trained_note` says why there are none."""
    turns = record["turns"]
    if not 0 <= turn < len(turns):
        raise IndexError(f"the episode has {len(turns)} turns, not {turn + 1}")
    t = turns[turn]
    obs_start, start, end = int(t["obs_start"]), int(t["start"]), int(t["end"])
    ids: list[int] = [int(x) for x in record["token_ids"][obs_start:end]]
    texts = decoder.texts(ids)
    n_obs = start - obs_start
    logprobs = record["logprobs"][start:end]
    versions = expand_versions(int(t.get("policy_version", 0)),
                               [(int(i), int(v)) for i, v in t.get("version_changes", ())],
                               end - start)
    trainer: list[float | None] | None
    advantages: list[float | None] | None
    if trained is not None:
        trainer, advantages = trained[0][start:end], trained[1][start:end]
    else:
        advantages = _per_token(record, "advantages", start, end)
        trainer = _per_token(record, "trainer_logprobs", start, end)
    action = []
    for k in range(end - start):
        adv = advantages[k] if advantages is not None else advantage
        trainer_k = trainer[k] if trainer is not None else None
        mismatch = float(logprobs[k]) - trainer_k if trainer_k is not None else None
        action.append([ids[n_obs + k], texts[n_obs + k], _finite(logprobs[k]), versions[k],
                       _finite(adv), _finite(mismatch)])
    action_text = decoder.text(ids[n_obs:])
    images = [{"index": i, "start": im.get("start", -1), "end": im.get("end", -1)}
              for i, im in enumerate(record.get("images") or ())
              if obs_start <= int(im.get("start", -1)) < start]
    return {
        "turn": turn, "turns": len(turns), "reward": float(t.get("reward", 0.0)),
        "finish_reason": visible(str(t.get("finish_reason", ""))),
        "observation": [[i, s] for i, s in zip(ids[:n_obs], texts[:n_obs], strict=True)],
        "action": action,
        "action_text": action_text,
        "tool_calls": [{"name": visible(c.name), "error": visible(c.error or ""),
                        "arguments": visible(json.dumps(c.arguments, ensure_ascii=False))}
                       for c in find_tool_calls(action_text)],
        "images": images,
        "decoded": decoder.error is None,
        "mismatch_recorded": trainer is not None,
        "trained_note": "" if trainer is not None else visible(trained_note),
    }


def group_member(record: dict[str, Any], summary: Summary, advantage: float | None,
                 decoder: Decoder) -> dict[str, Any]:
    """A sample of a prompt's group, side by side with the others: its last completion."""
    turns = record["turns"]
    text = ""
    if turns:
        last = turns[-1]
        text = decoder.text(record["token_ids"][int(last["start"]):int(last["end"])])
    return {**_brief(summary), "advantage": advantage, "text": text[:MAX_TEXT],
            "cut": len(text) > MAX_TEXT}


def _per_token(record: dict[str, Any], key: str, start: int,
               end: int) -> list[float | None] | None:
    values = record.get(key)
    if not isinstance(values, list) or len(values) != len(record["token_ids"]):
        return None
    return [float(x) if isinstance(x, int | float) else None for x in values[start:end]]


def _finite(x: float | None) -> float | None:
    return float(x) if x is not None and math.isfinite(x) else None


def _brief(s: Summary) -> dict[str, Any]:
    keys = ("line", "uid", "segment", "segment_cause", "reward", "discard", "reason", "drift",
            "turns", "corrupt")
    return visible_fields({k: s[k] for k in keys})


def visible_fields(d: dict[str, Any]) -> dict[str, Any]:
    return {k: visible(v) if isinstance(v, str) else v for k, v in d.items()}
