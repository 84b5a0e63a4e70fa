"""The types every producer emits and every consumer reads.

`SamplingParams` and `Completion` are the engine's request and answer. `Trajectory` is one
episode, token-exact: the same type comes out of env rollouts and proxy sessions, goes into the
trainers, and round-trips through JSON lines. Images are part of it from the start.

Only stdlib and numpy are imported here: `import agentrl` must stay light.
"""

from __future__ import annotations

import base64
import hashlib
import json
import math
import uuid
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal

import numpy as np

from agentrl.files import replaced_atomically

_INT32_MAX = 2**31 - 1

FinishReason = Literal["stop", "length", "abort"]
FINISH_REASONS: tuple[str, ...] = ("stop", "length", "abort")


@dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """How to sample one request. Mirrors the OpenAI/vLLM names users already know."""

    temperature: float = 1.0
    """Softmax temperature; 0 means greedy."""
    top_p: float = 1.0
    """Nucleus sampling mass, in (0, 1]."""
    top_k: int = 0
    """Keep only the k most likely tokens; 0 disables. At most 2**31 - 1 (engines hold it in
    32 bits; a k past the vocabulary keeps every token)."""
    max_tokens: int = 256
    """Most new tokens to sample (the completion stops with finish reason `length`)."""
    stop: tuple[str, ...] = ()
    """Stop strings; the completion is cut before them and they are not part of the text."""
    stop_token_ids: tuple[int, ...] = ()
    """Extra token ids that end the completion (the tokenizer's eos always does). Kept."""
    n: int = 1
    """Number of independent samples for the prompt."""
    seed: int | None = None
    """Per-request seed; the same seed, prompt and weights give the same sample. A 64-bit
    signed integer (what engines seed their generators with)."""
    logprobs: bool = True
    """Return the log-probability of each sampled token."""
    raw_logprobs: bool = False
    """If true, logprobs are of the raw model distribution (before temperature/top-p/top-k)
    rather than of the distribution actually sampled from."""
    top_logprobs: int = 0
    """Also return this many most likely alternatives per position (proxy's `top_logprobs`)."""
    logit_bias: tuple[tuple[int, float], ...] = ()
    """(token id, bias in [-100, 100]) pairs added to the logits before sampling (OpenAI's
    `logit_bias`). The logprobs are then of that biased distribution, the one sampled from
    (with `raw_logprobs`, of the model's own)."""
    grammar: str | None = None
    """A grammar the completion must match, in xgrammar's EBNF (`agentrl.engine.grammar` builds
    them from JSON schemas and tool lists). Tokens it forbids get probability 0 before any other
    processing, so every reported logprob, raw ones too, is of that masked distribution; the
    completion ends once the grammar is complete."""

    def __post_init__(self) -> None:
        if not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"SamplingParams.n must be an integer >= 1, got {self.n!r}")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 0:
            raise ValueError(
                f"SamplingParams.max_tokens must be an integer >= 0, got {self.max_tokens!r}"
            )
        if not (isinstance(self.temperature, int | float) and 0 <= self.temperature < math.inf):
            raise ValueError(f"SamplingParams.temperature must be a finite number >= 0 "
                             f"(0 = greedy), got {self.temperature!r}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p!r}")
        # Out-of-range numbers must fail here, alone: inside an engine's batch they fail every
        # request batched with them (#34).
        if not isinstance(self.top_k, int) or not 0 <= self.top_k <= _INT32_MAX:
            raise ValueError(f"SamplingParams.top_k must be an integer in [0, {_INT32_MAX}] "
                             f"(0 = off), got {self.top_k!r}")
        if self.seed is not None and not (isinstance(self.seed, int | np.integer)
                                          and -(2**63) <= self.seed < 2**63):
            raise ValueError(f"SamplingParams.seed must be None or an integer in "
                             f"[{-(2**63)}, {2**63 - 1}], got {self.seed!r}")
        if not isinstance(self.top_logprobs, int) or not 0 <= self.top_logprobs <= 20:
            raise ValueError(
                f"SamplingParams.top_logprobs must be an integer in [0, 20], "
                f"got {self.top_logprobs!r}"
            )
        for pair in self.logit_bias:
            if not (isinstance(pair, tuple) and len(pair) == 2 and isinstance(pair[0], int)
                    and pair[0] >= 0 and isinstance(pair[1], int | float)
                    and -100 <= pair[1] <= 100):
                raise ValueError(f"SamplingParams.logit_bias must be (token id >= 0, bias in "
                                 f"[-100, 100]) pairs, got {pair!r}")
        if self.grammar is not None and not (isinstance(self.grammar, str) and self.grammar):
            raise ValueError("SamplingParams.grammar must be a non-empty EBNF string or None; "
                             "build one with agentrl.engine.grammar.json_schema_grammar(...)")
        if isinstance(self.stop, str) or isinstance(self.stop_token_ids, int):
            raise TypeError(
                "SamplingParams.stop / stop_token_ids take a tuple, e.g. stop=('\\n\\n',)"
            )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass(kw_only=True)
class Completion:
    """One sample: exactly the token ids drawn, their log-probabilities and why it ended."""

    token_ids: list[int]
    logprobs: list[float] | None
    finish_reason: FinishReason
    policy_version: int = 0
    """Version of the weights that sampled the first token (every token, unless
    `version_changes` says otherwise)."""
    stop_reason: str | int | None = None
    """The stop string or stop token id that ended it, if any."""
    top_logprobs: list[list[tuple[int, float]]] | None = None
    """Per position, the most likely (token id, logprob) pairs, if asked for."""
    version_changes: list[tuple[int, int]] = field(default_factory=list)
    """Partial rollout: (i, v) = the weights changed to version v while this completion was
    sampled, and tokens i, i+1, ... were sampled by v (with v's log-probs). Empty when one
    version sampled every token."""

    def __post_init__(self) -> None:
        if self.finish_reason not in FINISH_REASONS:
            raise ValueError(
                f"Completion.finish_reason must be one of {FINISH_REASONS}, "
                f"got {self.finish_reason!r}"
            )
        if self.logprobs is not None and len(self.logprobs) != len(self.token_ids):
            raise ValueError(
                f"Completion has {len(self.token_ids)} tokens but {len(self.logprobs)} logprobs"
            )
        check_version_changes(self.version_changes, len(self.token_ids), "Completion")

    def token_versions(self) -> list[int]:
        """The version that sampled each token."""
        return expand_versions(self.policy_version, self.version_changes, len(self.token_ids))

    def delta(self, index: int, start: int = 0, stop: int | None = None,
              last: bool = True) -> CompletionDelta:
        """Tokens [start, stop) as choice `index`'s delta, ending the choice if `last`."""
        stop = len(self.token_ids) if stop is None else stop
        first, changes = shift_version_changes(self.version_changes, start, stop)
        return CompletionDelta(
            index=index,
            token_ids=self.token_ids[start:stop],
            logprobs=self.logprobs[start:stop] if self.logprobs is not None else None,
            top_logprobs=(self.top_logprobs[start:stop] if self.top_logprobs is not None
                          else None),
            finish_reason=self.finish_reason if last else None,
            policy_version=self.policy_version if first is None else first,
            stop_reason=self.stop_reason if last else None,
            version_changes=tuple(changes),
        )


def check_version_changes(changes: Sequence[tuple[int, int]], n: int, what: str) -> None:
    """`changes` are (index, version) pairs with 0 < index < n, indices increasing."""
    last = 0
    for i, _ in changes:
        if not last < i < n:
            raise ValueError(f"{what}.version_changes {list(changes)} must have increasing "
                             f"token indices in (0, {n})")
        last = i


def expand_versions(first: int, changes: Sequence[tuple[int, int]], n: int) -> list[int]:
    """Per-token versions of n tokens: `first`, then each (index, version) change."""
    out = [first] * n
    for i, v in changes:
        out[i:] = [v] * (n - i)
    return out


def shift_version_changes(changes: Sequence[tuple[int, int]], start: int, stop: int
                          ) -> tuple[int | None, list[tuple[int, int]]]:
    """The changes that fall in tokens [start, stop), re-based to `start`, and the version of
    token `start` if a change at or before it set one (None: the first version holds)."""
    first: int | None = None
    out: list[tuple[int, int]] = []
    for i, v in changes:
        if i <= start:
            first = v
        elif i < stop:
            out.append((i - start, v))
    return first, out


@dataclass(frozen=True, kw_only=True)
class CompletionDelta:
    """New tokens of one of a request's n completions, as a streaming engine samples them.

    Concatenating a choice's deltas gives exactly its `Completion` (ids, logprobs, top
    logprobs); `finish_reason` is None until the choice's last delta, which may carry no tokens
    (an abort).
    """

    index: int
    """Which of the request's `n` completions these tokens extend."""
    token_ids: list[int]
    logprobs: list[float] | None
    """Log-probability of each new token; None when the request asked for none."""
    top_logprobs: list[list[tuple[int, float]]] | None = None
    """Per new token, the most likely (token id, logprob) pairs, if asked for."""
    finish_reason: FinishReason | None = None
    policy_version: int = 0
    """Version of the weights that sampled this delta's first token."""
    stop_reason: str | int | None = None
    """On the last delta: the stop string or stop token id that ended the completion, if any."""
    version_changes: tuple[tuple[int, int], ...] = ()
    """As `Completion.version_changes`, with indices into this delta's tokens."""


def image_digest(pixels: np.ndarray) -> bytes:
    """The one content hash of an image (SHA-256 over its shape and pixels): equal images, equal
    digests. Stored images are named by it; engines' caches key image tokens by it."""
    h = hashlib.sha256(f"{pixels.shape}".encode())
    h.update(np.ascontiguousarray(pixels).tobytes())
    return h.digest()


@dataclass(kw_only=True)
class Image:
    """An image the model saw, and where its placeholder tokens sit in `Trajectory.token_ids`."""

    pixels: np.ndarray
    """uint8 array of shape (H, W, 3)."""
    start: int = -1
    """Index of the first placeholder token of this image; -1 if not yet placed."""
    end: int = -1
    """One past the last placeholder token."""

    def __post_init__(self) -> None:
        px = np.asarray(self.pixels)
        if px.dtype != np.uint8 or px.ndim != 3 or px.shape[2] != 3:
            raise ValueError(
                f"Image.pixels must be a uint8 array of shape (H, W, 3), "
                f"got dtype {px.dtype} shape {px.shape}"
            )
        self.pixels = px

    @property
    def sha256(self) -> str:
        """Content hash (shape and pixels): the name the image is stored under."""
        return image_digest(self.pixels).hex()

    def to_dict(self, image_dir: Path | None = None) -> dict:
        """The image inline (base64 pixels), or with `image_dir` by its hash, its pixels saved
        there once as `<sha256>.png`."""
        h, w, _ = self.pixels.shape
        d: dict = {"shape": [h, w, 3], "start": self.start, "end": self.end}
        if image_dir is None:
            d["data"] = base64.b64encode(np.ascontiguousarray(self.pixels).tobytes()).decode()
            return d
        d["sha256"] = digest = self.sha256
        _save_png(self.pixels, Path(image_dir) / f"{digest}.png")
        return d

    @classmethod
    def from_dict(cls, d: dict, image_dir: Path | None = None) -> Image:
        if "data" in d:
            raw = np.frombuffer(base64.b64decode(d["data"]), dtype=np.uint8)
            return cls(pixels=raw.reshape(d["shape"]).copy(), start=d["start"], end=d["end"])
        if image_dir is None:
            raise ValueError(f"image {d.get('sha256')} is stored by hash; load it with its "
                             f"JSONL file (load_jsonl), which knows the images folder")
        png = Path(image_dir) / f"{d['sha256']}.png"
        if not png.exists():
            raise ValueError(f"image {png} is missing (the JSONL's images/ folder travels with it)")
        pixels = _load_png(png)
        if list(pixels.shape) != list(d["shape"]):
            raise ValueError(f"image {png} has shape {pixels.shape}, the record says {d['shape']}")
        return cls(pixels=pixels, start=d["start"], end=d["end"])


@dataclass(kw_only=True)
class Turn:
    """One policy action inside a trajectory: token_ids[start:end] were sampled by the policy.

    The observation that preceded it is token_ids[obs_start:start].
    """

    obs_start: int
    start: int
    end: int
    reward: float = 0.0
    """The environment's reward for this step."""
    policy_version: int = 0
    """Version of the weights that sampled the turn's first token."""
    finish_reason: FinishReason = "stop"
    version_changes: list[tuple[int, int]] = field(default_factory=list)
    """Partial rollout: (i, v) = tokens start+i, ... were sampled by version v (the weights
    changed mid-turn); empty when `policy_version` sampled the whole turn."""

    @property
    def versions(self) -> list[int]:
        """Every version that sampled a token of this turn, in order."""
        return [self.policy_version, *(v for _, v in self.version_changes)]

    def to_dict(self) -> dict:
        d = asdict(self)
        if not self.version_changes:
            del d["version_changes"]  # the common case stays as it was on disk
        else:
            d["version_changes"] = [list(c) for c in self.version_changes]
        return d

    @classmethod
    def from_dict(cls, d: dict) -> Turn:
        d = dict(d)
        d["version_changes"] = [(int(i), int(v)) for i, v in d.get("version_changes", ())]
        return cls(**d)


@dataclass(kw_only=True)
class Trajectory:
    """One episode, token-exact, as every trainer consumes it.

    Invariants (checked by `validate`): `loss_mask` and `logprobs` align with `token_ids`;
    `loss_mask` is 1 exactly on the tokens of the turns; turns are ordered and disjoint.
    """

    token_ids: list[int]
    loss_mask: list[int]
    logprobs: list[float]
    """Sampler log-probability of each policy token; 0.0 on observation tokens."""
    turns: list[Turn]
    terminated: bool = False
    truncated: bool = False
    images: list[Image] = field(default_factory=list)
    group: str | None = None
    """Prompt identity: trajectories of the same group share a baseline (GRPO, RLOO). Named
    once, when the episodes are launched (`group_name`); trainers number groups with
    `dense_group_ids`."""
    uid: str = field(default_factory=lambda: uuid.uuid4().hex)
    info: dict = field(default_factory=dict)
    discard: bool = False
    """The episode says nothing about the policy (its environment or sandbox failed): it is
    counted, kept on disk, and never trained on or scored. An env sets it with
    `info["discard"] = True`; an env that raises gets it too."""

    @property
    def rewards(self) -> list[float]:
        return [t.reward for t in self.turns]

    @property
    def total_reward(self) -> float:
        return float(sum(self.rewards))

    @property
    def policy_versions(self) -> list[int]:
        """Every version that sampled a token, turn by turn (partial rollout: several a turn)."""
        return [v for t in self.turns for v in t.versions]

    def token_versions(self) -> list[int]:
        """The version that sampled each token; -1 on observation tokens."""
        out = [-1] * len(self.token_ids)
        for t in self.turns:
            out[t.start : t.end] = expand_versions(t.policy_version, t.version_changes,
                                                   t.end - t.start)
        return out

    @property
    def prompt_len(self) -> int:
        return self.turns[0].start if self.turns else len(self.token_ids)

    @property
    def num_policy_tokens(self) -> int:
        return int(sum(self.loss_mask))

    def validate(self) -> None:
        n = len(self.token_ids)
        if len(self.loss_mask) != n or len(self.logprobs) != n:
            raise ValueError(
                f"Trajectory {self.uid}: token_ids ({n}), loss_mask ({len(self.loss_mask)}) and "
                f"logprobs ({len(self.logprobs)}) must have the same length"
            )
        expected = [0] * n
        prev_end = 0
        for i, t in enumerate(self.turns):
            if not (prev_end <= t.obs_start <= t.start <= t.end <= n):
                raise ValueError(
                    f"Trajectory {self.uid}: turn {i} spans obs {t.obs_start}, action "
                    f"[{t.start}, {t.end}) which is out of order or out of range (n={n})"
                )
            expected[t.start : t.end] = [1] * (t.end - t.start)
            check_version_changes(t.version_changes, t.end - t.start, f"turn {i}")
            prev_end = t.end
        if expected != list(self.loss_mask):
            raise ValueError(f"Trajectory {self.uid}: loss_mask does not match the turns")
        for img in self.images:
            if img.start >= 0 and not (0 <= img.start <= img.end <= n):
                raise ValueError(f"Trajectory {self.uid}: image placeholder out of range")

    def to_dict(self, image_dir: Path | None = None) -> dict:
        """As JSON-ready data; images inline, or by hash with their PNGs in `image_dir`."""
        d = {
            "uid": self.uid,
            "group": self.group,
            "token_ids": list(map(int, self.token_ids)),
            "loss_mask": list(map(int, self.loss_mask)),
            "logprobs": [float(x) for x in self.logprobs],
            "turns": [t.to_dict() for t in self.turns],
            "terminated": bool(self.terminated),
            "truncated": bool(self.truncated),
            "images": [im.to_dict(image_dir) for im in self.images],
            "info": _jsonable(self.info),
        }
        if self.discard:
            d["discard"] = True
        return d

    @classmethod
    def from_dict(cls, d: dict, image_dir: Path | None = None) -> Trajectory:
        missing = {"token_ids", "loss_mask", "logprobs", "turns"} - d.keys()
        if missing:
            raise ValueError(f"not a Trajectory record: missing keys {sorted(missing)}")
        traj = cls(
            token_ids=list(d["token_ids"]),
            loss_mask=list(d["loss_mask"]),
            logprobs=[float(x) for x in d["logprobs"]],
            turns=[Turn.from_dict(t) for t in d["turns"]],
            terminated=bool(d.get("terminated", False)),
            truncated=bool(d.get("truncated", False)),
            images=[Image.from_dict(x, image_dir) for x in d.get("images", [])],
            group=d.get("group"),
            uid=d.get("uid") or uuid.uuid4().hex,
            info=dict(d.get("info", {})),
            discard=bool(d.get("discard", False)),
        )
        traj.validate()
        return traj

    def to_json(self, image_dir: Path | None = None) -> str:
        return json.dumps(self.to_dict(image_dir), allow_nan=False)

    @classmethod
    def from_json(cls, line: str, image_dir: Path | None = None) -> Trajectory:
        return cls.from_dict(json.loads(line), image_dir)


class TrajectoryBuilder:
    """Appends observations and actions and produces a consistent `Trajectory`.

    Used by the rollout collector and by proxy sessions, so both emit the same thing.
    """

    def __init__(self, group: str | None = None) -> None:
        self.token_ids: list[int] = []
        self.loss_mask: list[int] = []
        self.logprobs: list[float] = []
        self.turns: list[Turn] = []
        self.images: list[Image] = []
        self.group = group
        self._obs_start = 0

    def add_observation(self, tokens: Iterable[int], images: Iterable[Image] = ()) -> None:
        tokens = [int(t) for t in tokens]
        self.token_ids.extend(tokens)
        self.loss_mask.extend([0] * len(tokens))
        self.logprobs.extend([0.0] * len(tokens))
        self.images.extend(images)

    def add_action(
        self,
        tokens: Iterable[int],
        logprobs: Iterable[float] | None,
        *,
        policy_version: int = 0,
        finish_reason: FinishReason = "stop",
        version_changes: Sequence[tuple[int, int]] = (),
    ) -> Turn:
        tokens = [int(t) for t in tokens]
        lps = [0.0] * len(tokens) if logprobs is None else [float(x) for x in logprobs]
        if len(lps) != len(tokens):
            raise ValueError(f"action has {len(tokens)} tokens but {len(lps)} logprobs")
        start = len(self.token_ids)
        self.token_ids.extend(tokens)
        self.loss_mask.extend([1] * len(tokens))
        self.logprobs.extend(lps)
        turn = Turn(
            obs_start=self._obs_start,
            start=start,
            end=len(self.token_ids),
            policy_version=policy_version,
            finish_reason=finish_reason,
            version_changes=[(int(i), int(v)) for i, v in version_changes],
        )
        self.turns.append(turn)
        self._obs_start = len(self.token_ids)
        return turn

    def build(
        self, *, terminated: bool, truncated: bool, info: dict | None = None,
        discard: bool = False,
    ) -> Trajectory:
        traj = Trajectory(
            token_ids=list(self.token_ids),
            loss_mask=list(self.loss_mask),
            logprobs=list(self.logprobs),
            turns=[Turn.from_dict(asdict(t)) for t in self.turns],
            terminated=terminated,
            truncated=truncated,
            images=list(self.images),
            group=self.group,
            info=dict(info or {}),
            discard=discard,
        )
        traj.validate()
        return traj


def group_name(prefix: str, prompt_index: int) -> str:
    """The group of the episodes launched for prompt `prompt_index` of a batch, for env
    rollouts and proxy sessions alike: its samples share a baseline (GRPO, RLOO)."""
    return f"{prefix}{prompt_index}"


def dense_group_ids(trajectories: Sequence[Trajectory]) -> list[int]:
    """Integer id of each trajectory's group, 0, 1, ... in order of first appearance; a
    trajectory without a group is a group of its own.

    The one mapping from group names to the ids trainers use (dynamic filtering, baselines,
    prompt sharing). The trainer numbers a step's whole batch once and gives each rank its
    slice of the ids with its slice of the trajectories, so the ids mean the same on every rank.
    """
    ids: dict[tuple[str, str | int], int] = {}
    return [
        ids.setdefault(("group", t.group) if t.group is not None else ("row", i), len(ids))
        for i, t in enumerate(trajectories)
    ]


def image_dir_of(path: str | Path) -> Path:
    """Where the images of a trajectories JSONL file are stored: `images/` beside it, shared
    by the files of one folder (a run's rollouts), each image once."""
    return Path(path).parent / "images"


def save_jsonl(trajectories: Iterable[Trajectory], path: str | Path) -> int:
    """Write trajectories as JSON lines (atomically: a crash leaves the old file intact). Images
    go once each, as PNG named by content hash, to `image_dir_of(path)`; lines hold the hashes."""
    path = Path(path)
    n = 0
    with replaced_atomically(path) as tmp, tmp.open("w") as f:
        for traj in trajectories:
            f.write(traj.to_json(image_dir_of(path) if traj.images else None) + "\n")
            n += 1
    return n


def iter_jsonl(path: str | Path) -> Iterator[Trajectory]:
    with Path(path).open() as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield Trajectory.from_json(line, image_dir_of(path))
            except (ValueError, TypeError, KeyError) as e:
                raise ValueError(f"{path}:{lineno}: not a valid trajectory: {e}") from e


def load_jsonl(path: str | Path) -> list[Trajectory]:
    return list(iter_jsonl(path))


def _save_png(pixels: np.ndarray, path: Path) -> None:
    """Write once (an existing file of that hash holds the same pixels); atomic."""
    if path.exists():
        return
    from PIL import Image as PILImage

    with replaced_atomically(path) as tmp:
        PILImage.fromarray(np.ascontiguousarray(pixels), "RGB").save(tmp, format="PNG")


def _load_png(path: Path) -> np.ndarray:
    from PIL import Image as PILImage

    with PILImage.open(path) as im:
        return np.asarray(im.convert("RGB"), dtype=np.uint8).copy()


def _jsonable(obj: object) -> object:
    """Best-effort conversion of env `info` values to JSON (numpy scalars, arrays, tuples)."""
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    if obj is None or isinstance(obj, str | int | float | bool):
        return obj
    return repr(obj)
