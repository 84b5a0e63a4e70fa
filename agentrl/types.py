"""The trajectory: what every producer emits and every consumer reads.

`Trajectory` is one episode, token-exact: the same type comes out of env rollouts and proxy
sessions, goes into the trainers, and round-trips through JSON (agentrl.trajectory_files writes
and reads the files). Images are part of it from the start. What engines are asked and answer
(`SamplingParams`, `Completion`) is agentrl.completion.

Only stdlib and numpy are imported here: `import agentrl` must stay light.
"""

from __future__ import annotations

import base64
import hashlib
import json
import math
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from agentrl.completion import FinishReason, check_version_changes, expand_versions
from agentrl.files import replaced_atomically


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
    state_key: str | None = None
    """The environment state this turn acted from, as the env named it (`info["state_key"]`
    of the reset or step before it); None: the env names none, and GiGPO recognises the state
    by its observation (`agentrl.anchors`)."""

    @property
    def versions(self) -> list[int]:
        """Every version that sampled a token of this turn, in order."""
        return [self.policy_version, *(v for _, v in self.version_changes)]

    def to_dict(self) -> dict:
        d = asdict(self)
        if self.state_key is None:
            del d["state_key"]
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
