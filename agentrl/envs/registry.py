"""Registration: `agentrl.register` wraps `gymnasium.register` and knows about chat envs.

Every id is `<namespace>/<Name>-v<N>` (built-ins use `agentrl/`). The entry point may be a
`TokenEnv` class, a `ChatEnv` class, any factory returning either, or a "module:attr" string
(imported only when the env is made, so `import agentrl` stays light). Chat envs are wrapped
in the token-level bridge for `tokenizer=` (an object, a model name, or the default: the embedded
model, or the embedded vision-language model for an env that shows images, `ChatEnv.shows_images`).

`gym.make(id)` alone builds every built-in env. An env whose constructor needs arguments says
which, in one line with an example call (its `register(..., usage=)`), instead of Python's bare
missing-argument TypeError.

Turn and token budgets are not env arguments: the rollout loop enforces them for every env
(`agentrl.rollout.collect(max_turns=, max_episode_tokens=)`). `gym.make(id, max_turns=N)` reaches
only an env whose constructor takes `max_turns` as a rule of its own task (math-tir).
"""

from __future__ import annotations

import difflib
import functools
import importlib
import importlib.metadata
import inspect
import logging
import os
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import gymnasium as gym

from agentrl.plugins import load_attr

if TYPE_CHECKING:
    from gymnasium.envs.registration import EnvCreator

logger = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "agentrl.environments"
_ID_RE = re.compile(r"^[A-Za-z0-9_.\-]+/[A-Z][A-Za-z0-9_]*-v\d+$")
_BRIDGE_KWARGS = ("check_drift", "on_rewrite")
_RUN_BUDGETS = ("max_turns", "max_episode_tokens")


@dataclass(frozen=True)
class EnvInfo:
    id: str
    summary: str
    aliases: tuple[str, ...]
    usage: str = ""
    """An example `gym.make` call with the arguments the env needs (empty: it needs none)."""


_ENVS: dict[str, EnvInfo] = {}
_ALIASES: dict[str, str] = {}


def register(
    id: str,
    entry_point: Callable[..., Any] | str,
    *,
    summary: str | None = None,
    aliases: tuple[str, ...] = (),
    usage: str = "",
    **kwargs: Any,
) -> None:
    """Register an environment id with gymnasium (and agentrl's CLI names).

    Args:
        id: `<namespace>/<Name>-v<N>`, e.g. "agentrl/MathTIR-v0". Bump N when the reward,
            observation or termination changes meaning.
        entry_point: TokenEnv or ChatEnv class, factory, or "module:attr" string.
        summary: one line for `agentrl envs` (defaults to the entry point's docstring).
        aliases: short names for the CLI, e.g. ("math-tir",).
        usage: for an env whose constructor needs arguments, an example call that passes them,
            e.g. "gym.make('my/Env-v0', data='rows.jsonl')"; shown when they are missing.
        **kwargs: default constructor arguments (overridable in `gym.make`).
    """
    if not _ID_RE.match(id):
        raise ValueError(
            f"environment id {id!r} must look like '<namespace>/<Name>-v<N>', "
            f"e.g. 'agentrl/{_suggest_name(id)}-v0'"
        )
    if summary is None and not isinstance(entry_point, str):
        first = (inspect.getdoc(entry_point) or "").strip().splitlines()[0:1]
        summary = first[0] if first else ""
    # gym calls the entry point with the spec's kwargs, which always hold `target`.
    creator = cast("EnvCreator", functools.partial(make_env, registered_id=id))
    gym.register(id=id, entry_point=creator, kwargs={"target": entry_point, **kwargs})
    _ENVS[id] = EnvInfo(id=id, summary=summary or "", aliases=tuple(aliases), usage=usage)
    for alias in aliases:
        _ALIASES[alias] = id


def make_env(
    target: Callable[..., Any] | str, tokenizer: Any = None, *, registered_id: str | None = None,
    **kwargs: Any,
) -> gym.Env:
    """Build the env behind a registered id (gymnasium calls this from `gym.make`; `registered_id`
    names it in errors)."""
    from agentrl.envs.base import TokenEnv
    from agentrl.envs.chat import ChatEnv, ChatTokenEnv

    factory = load_attr(target, "Env") if isinstance(target, str) else target
    bridge_kwargs = {k: kwargs.pop(k) for k in _BRIDGE_KWARGS if k in kwargs}
    if _accepts(factory, "tokenizer") and not (
        inspect.isclass(factory) and issubclass(factory, ChatEnv)
    ):
        kwargs["tokenizer"] = tokenizer
    for name in _RUN_BUDGETS:
        if name in kwargs and not _accepts(factory, name, unknown=True):
            raise TypeError(
                f"{name}={kwargs[name]!r}: {getattr(factory, '__name__', factory)} takes no "
                f"{name}; episode budgets are enforced by the rollout loop for every env: pass "
                f"agentrl.rollout.collect({name}=...) (CLI: --rollout.{name} for train, "
                f"--{name} for rollout and eval)"
            )
    _check_required(factory, kwargs, registered_id)
    env = factory(**kwargs)
    if isinstance(env, ChatEnv):
        return ChatTokenEnv(env, tokenizer, **bridge_kwargs)
    if bridge_kwargs:
        raise TypeError(
            f"{sorted(bridge_kwargs)} apply to chat environments only; "
            f"{type(env).__name__} is a {type(env).__mro__[1].__name__}"
        )
    if not isinstance(env, TokenEnv | gym.Env):
        raise TypeError(
            f"entry point {target!r} returned {type(env).__name__}; expected a TokenEnv or ChatEnv"
        )
    return env


def env_factory(id: str) -> Callable[..., Any] | None:
    """The class or factory behind an id registered through agentrl (None for others)."""
    target = _target(id)
    if target is None:
        return None
    return load_attr(target, "Env") if isinstance(target, str) else target


def env_takes(id: str, name: str) -> bool:
    """Whether the env registered as `id` declares the constructor argument `name` (a rule of
    its own task, like math-tir's `max_turns`: its last turn must give the answer)."""
    factory = env_factory(id)
    if factory is None:
        return False
    try:
        return name in inspect.signature(factory).parameters
    except (TypeError, ValueError):
        return False


def with_turn_budget(id: str, kwargs: dict[str, Any], max_turns: int | None) -> dict[str, Any]:
    """`kwargs` with the run's turn budget added for an env that takes `max_turns` (unless they
    set it): the rollout loop enforces the budget either way, but an env whose own rule depends
    on it (math-tir: the last turn must answer; MiniWoB: an episode out of turns scores -1) has
    to know it. train, eval and rollout all build their env arguments through this."""
    if max_turns is None or "max_turns" in kwargs or not env_takes(id, "max_turns"):
        return kwargs
    return {**kwargs, "max_turns": max_turns}


def resolve_env_id(name: str) -> str:
    """Map a CLI name ("math-tir"), a full id, or user code naming an env to a registered id,
    with a did-you-mean. User code is imported first: `module:ID` (Gymnasium's convention, e.g.
    "echo_env:me/Echo-v0"), `module:EnvClass`, and the same with a file path (`echo_env.py:ID`),
    or a file alone (`echo_env.py`: the one env it registers, or its one env class)."""
    load_plugins()
    if name in _ALIASES:
        return _ALIASES[name]
    if name in gym.registry:
        return name
    if ":" in name or name.endswith(".py"):
        return _env_from_user_code(name)
    candidates = [*_ALIASES, *(k for k in gym.registry if "/" in k)]
    hint = difflib.get_close_matches(name, candidates, n=1, cutoff=0.5)
    did_you_mean = f" Did you mean {hint[0]!r}?" if hint else ""
    raise ValueError(
        f"unknown environment {name!r}.{did_you_mean} Run `agentrl envs` to list them."
    )


def _env_from_user_code(name: str) -> str:
    """The id that `name` (see resolve_env_id) names, importing its module or file."""
    from agentrl.plugins import load_module_file

    where, _, attr = name.rpartition(":") if ":" in name else (name, "", "")
    try:
        if where.endswith(".py"):
            module = load_module_file(_find_file(where))
        else:
            module = importlib.import_module(where)
    except (ImportError, ValueError) as e:
        raise ValueError(f"--env {name}: cannot import {where!r} ({e}). Name a module importable "
                         f"from the current directory or a .py file") from None
    if attr and attr in gym.registry:
        return attr
    if attr and hasattr(module, attr):
        target = getattr(module, attr)
        same = [i for i in _ids_of(module)
                if getattr(_target(i), "__qualname__", None) == getattr(target, "__qualname__", 0)]
        return same[0] if len(same) == 1 else _register_user_env(where, attr, target)
    if attr:
        raise ValueError(f"--env {name}: {where} registers no env {attr!r} and defines no "
                         f"{attr!r}. Registered there: {_ids_of(module) or 'none'}")
    ids = _ids_of(module)
    if len(ids) == 1:
        return ids[0]
    classes = _env_classes_of(module)
    if not ids and len(classes) == 1:
        return _register_user_env(where, classes[0].__name__, classes[0])
    found = ids or [c.__name__ for c in classes]
    raise ValueError(f"--env {name}: name one of {found or 'its envs'} as {where}:NAME"
                     + ("" if found else f" ({where} registers no env and defines no env class)"))


def _find_file(path: str) -> str:
    """`path` as given, else under a directory of sys.path (a Ray worker's has the driver's
    working directory, where the user named it)."""
    if os.path.isabs(path) or os.path.isfile(path):
        return path
    for d in sys.path:
        candidate = os.path.join(d or ".", path)
        if os.path.isfile(candidate):
            return candidate
    return path  # load_module_file says it does not exist


def _ids_of(module: Any) -> list[str]:
    """The ids registered through agentrl whose entry point `module` defines (by its source
    file: the same file imported as a module and by its path is one module here)."""
    return sorted(i for i in _ENVS if _defined_in(_target(i), module))


def _target(env_id: str) -> Any:
    """The entry point registered for `env_id` as given (a "module:attr" string is not
    imported)."""
    return (gym.spec(env_id).kwargs or {}).get("target")


def _defined_in(obj: Any, module: Any) -> bool:
    home = sys.modules.get(getattr(obj, "__module__", None) or "")
    return home is module or (home is not None and getattr(home, "__file__", None) is not None
                              and home.__file__ == getattr(module, "__file__", None))


def _env_classes_of(module: Any) -> list[type]:
    from agentrl.envs.base import TokenEnv
    from agentrl.envs.chat import ChatEnv

    return [v for v in vars(module).values()
            if inspect.isclass(v) and issubclass(v, ChatEnv | TokenEnv)
            and v.__module__ == module.__name__]


def _register_user_env(where: str, attr: str, target: Any) -> str:
    """Register a class or factory named on the command line as `<module>/<Attr>-v0`."""
    if not callable(target):
        raise ValueError(  # noqa: TRY004 - a bad flag value, which the CLIs report as such
            f"--env {where}:{attr} is a {type(target).__name__}, not an env class, a factory "
            f"or a registered id")
    stem = re.sub(r"[^A-Za-z0-9_.\-]", "_", where.rsplit("/", 1)[-1].removesuffix(".py"))
    env_id = f"{stem}/{attr[:1].upper()}{re.sub(r'[^A-Za-z0-9_]', '_', attr[1:])}-v0"
    if env_id not in gym.registry:
        register(env_id, target)
    return env_id


def list_envs() -> list[EnvInfo]:
    """Every environment registered through agentrl (built-ins and plugins)."""
    load_plugins()
    return sorted(_ENVS.values(), key=lambda e: e.id)


_PLUGINS_LOADED = False


def load_plugins() -> list[str]:
    """Import the `agentrl.environments` entry points of installed packages (once).

    An entry point may name a module (importing it registers its envs) or a callable (called
    with no arguments). A broken plugin logs a warning and does not stop the others.
    """
    global _PLUGINS_LOADED
    loaded: list[str] = []
    if _PLUGINS_LOADED:
        return loaded
    _PLUGINS_LOADED = True
    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        try:
            obj = ep.load()
            if callable(obj) and not inspect.isclass(obj) and not inspect.ismodule(obj):
                obj()
            loaded.append(ep.name)
        except Exception as e:  # noqa: BLE001 (a third-party plugin must not break agentrl)
            logger.warning("agentrl env plugin %r (%s) failed to load: %s", ep.name, ep.value, e)
    return loaded


def _accepts(fn: Callable[..., Any], name: str, *, unknown: bool = False) -> bool:
    """Whether `fn` takes a keyword `name`, declared or through **kwargs (`unknown` when its
    signature cannot be read)."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return unknown
    return name in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


def _check_required(
    factory: Callable[..., Any], kwargs: dict[str, Any], env_id: str | None
) -> None:
    """Raise a TypeError naming the constructor arguments `kwargs` lacks, with an example call,
    before Python's bare "missing 2 required positional arguments" would."""
    try:
        params = inspect.signature(factory).parameters.values()
    except (TypeError, ValueError):
        return
    named = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    missing = [p.name for p in params
               if p.kind in named and p.default is p.empty and p.name not in kwargs]
    if not missing:
        return
    info = _ENVS.get(env_id or "")
    shown = env_id or getattr(factory, "__name__", repr(factory))
    example = (info.usage if info is not None and info.usage else
               f"gym.make({shown!r}, {', '.join(f'{n}=...' for n in missing)})")
    raise TypeError(f"{shown} needs {' and '.join(f'{n}=' for n in missing)}, which "
                    f"{'was' if len(missing) == 1 else 'were'} not given; e.g. {example}")


def _suggest_name(id: str) -> str:
    base = re.sub(r"-v\d+$", "", id.split("/")[-1])
    return "".join(w[:1].upper() + w[1:] for w in re.split(r"[^A-Za-z0-9]+", base) if w) or "MyEnv"
