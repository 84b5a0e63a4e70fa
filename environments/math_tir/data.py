"""Math problems for the math envs: generated offline with reasoning-gym, or read from a file.

Splits are decided by problem identity, not by position: a problem's id is a hash of its
whitespace-normalised question, and the id alone puts it in "train" or "eval". So train and
eval never share a question whatever the seed, task mix, size or file order, and a question
generated twice is one problem.

Loading is cached per process (envs are built by the dozen, one per concurrent episode).
"""

from __future__ import annotations

import difflib
import functools
import hashlib
import json
import logging
import random
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from agentrl.seeding import derive_seed
from environments.math_tir.grading import parse_gold

logger = logging.getLogger(__name__)
T = TypeVar("T")

SPLITS = ("train", "eval")
DIFFICULTIES = ("easy", "medium", "hard")
DEFAULT_EVAL_FRACTION = 0.1

# Per difficulty, reasoning-gym config overrides for the tasks we tuned. Tasks not listed
# here use reasoning-gym's defaults (plus the user's `task_options`).
TASK_PRESETS: dict[str, dict[str, dict[str, object]]] = {
    "easy": {
        "basic_arithmetic": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2,
                             "operators": ("+", "-", "*"), "allow_parentheses": False,
                             "allow_negation": False},
        "chain_sum": {"min_terms": 2, "max_terms": 3, "min_digits": 1, "max_digits": 2},
        "products": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2},
        "simple_equations": {"min_terms": 2, "max_terms": 2, "max_value": 20},
        "lcm": {"max_value": 20},
        "gcd": {"max_value": 100},
        "leg_counting": {"min_animals": 2, "max_animals": 3, "max_instances": 5},
    },
    "medium": {
        "basic_arithmetic": {"min_terms": 3, "max_terms": 4, "min_digits": 1, "max_digits": 3,
                             "operators": ("+", "-", "*"), "allow_parentheses": True,
                             "allow_negation": False},
        "chain_sum": {"min_terms": 3, "max_terms": 5, "min_digits": 2, "max_digits": 3},
        "products": {"min_terms": 2, "max_terms": 3, "min_digits": 2, "max_digits": 3},
        "simple_equations": {"min_terms": 2, "max_terms": 3, "max_value": 100},
        "lcm": {"max_value": 100},
        "gcd": {"max_value": 1000},
        "leg_counting": {"min_animals": 3, "max_animals": 6, "max_instances": 10},
    },
    "hard": {},  # reasoning-gym's defaults: e.g. basic_arithmetic with 2-6 terms, / and ()
}


@dataclass(frozen=True)
class Problem:
    """One question with its reference answer."""

    question: str
    answer: str
    source: str
    """reasoning-gym task name, or the file it was read from."""
    uid: str
    """Identity (hash of the normalised question); decides the split."""


def problem_uid(question: str) -> str:
    return hashlib.sha256(" ".join(question.split()).encode()).hexdigest()[:16]


def split_of(uid: str, eval_fraction: float = DEFAULT_EVAL_FRACTION) -> str:
    """"eval" for a fixed `eval_fraction` of identities, "train" for the rest."""
    return "eval" if int(uid[:8], 16) / 16**8 < eval_fraction else "train"


_PLAIN_NUMBER = re.compile(r"^-?\d+(\.\d+)?$")


def gold_ok(answer: str) -> bool:
    """Whether math-verify can parse a reference answer (plain numbers skip the ~2 ms parse)."""
    return bool(_PLAIN_NUMBER.match(answer.strip())) or bool(parse_gold(answer))


def _drop_unparseable(problems: list[Problem], where: str) -> list[Problem]:
    kept = [p for p in problems if gold_ok(p.answer)]
    if len(kept) < len(problems):
        bad = [p.answer for p in problems if not gold_ok(p.answer)][:3]
        logger.warning(
            "%s: skipped %d of %d problems whose answers math-verify cannot parse (e.g. %s); "
            "they are never scored", where, len(problems) - len(kept), len(problems), bad,
        )
    return kept


def normalize_tasks(tasks: str | Sequence[str] | Mapping[str, float]) -> dict[str, float]:
    """"a,b" / ["a", "b"] / {"a": 3, "b": 1} -> {name: weight}, validated against reasoning-gym."""
    # The package first: importing it registers the tasks, and an env built in another thread
    # at the same time may be doing so (the factory module alone would show half a registry).
    import reasoning_gym  # noqa: F401
    from reasoning_gym.factory import DATASETS

    weights = _weights(tasks)
    if not weights:
        raise ValueError("tasks must name at least one reasoning-gym task, e.g. 'gsm_symbolic'")
    for name, w in weights.items():
        if name not in DATASETS:
            hint = difflib.get_close_matches(name, list(DATASETS), n=1)
            did_you_mean = f" Did you mean {hint[0]!r}?" if hint else ""
            raise ValueError(
                f"unknown reasoning-gym task {name!r}.{did_you_mean} Tasks with tuned "
                f"difficulty presets: {sorted(TASK_PRESETS['easy'])} and gsm_symbolic"
            )
        _check_weight(w, f"task weight for {name!r}")
    return {k: float(v) for k, v in weights.items()}


def normalize_difficulty(difficulty: str | Sequence[str] | Mapping[str, float]) -> dict[str, float]:
    """"medium" / "easy,medium" / {"easy": 1, "medium": 3} -> {difficulty: weight}."""
    weights = _weights(difficulty)
    if not weights:
        raise ValueError(f"difficulty must name one of {DIFFICULTIES} (or a mix such as "
                         f"'easy,medium' or {{'easy': 1, 'medium': 3}})")
    for name, w in weights.items():
        if name not in DIFFICULTIES:
            raise ValueError(f"difficulty must be one of {DIFFICULTIES} (or a mix such as "
                             f"'easy,medium'), got {name!r}")
        _check_weight(w, f"difficulty weight for {name!r}")
    return {k: float(v) for k, v in weights.items()}


def _weights(spec: str | Sequence[str] | Mapping[str, float]) -> dict[str, float]:
    """"a,b" / ["a", "b"] (weight 1 each) / {"a": 3, "b": 1} as {name: weight}, unchecked."""
    if isinstance(spec, str):
        spec = [x.strip() for x in spec.split(",") if x.strip()]
    return dict(spec) if isinstance(spec, Mapping) else {x: 1.0 for x in spec}


def _check_weight(w: object, what: str) -> None:
    if not isinstance(w, int | float) or isinstance(w, bool) or w <= 0:
        raise ValueError(f"{what} must be a positive number, got {w!r}")


def generate_problems(
    tasks: str | Sequence[str] | Mapping[str, float] = "basic_arithmetic",
    *,
    split: str = "train",
    num_problems: int = 1000,
    difficulty: str | Sequence[str] | Mapping[str, float] = "easy",
    seed: int = 0,
    task_options: Mapping[str, Mapping[str, object]] | None = None,
    eval_fraction: float = DEFAULT_EVAL_FRACTION,
) -> tuple[Problem, ...]:
    """`num_problems` distinct problems of `split`, drawn from reasoning-gym tasks.

    Each task gets a share of `num_problems` proportional to its weight, and so does each
    difficulty of a mix (`difficulty="easy,medium"` or `{"easy": 1, "medium": 3}`: the shares
    of each difficulty are generated as for that difficulty alone); the mix is then shuffled
    with `seed`. Fewer come back (with a warning) if a task's problem space is too small to
    fill its share.
    """
    _check_split(split, eval_fraction)
    levels = normalize_difficulty(difficulty)
    if num_problems < 1:
        raise ValueError(f"num_problems must be >= 1, got {num_problems}")
    weights = normalize_tasks(tasks)
    options = {k: dict(v) for k, v in (task_options or {}).items()}
    unknown = set(options) - set(weights)
    if unknown:
        logger.warning("task_options for %s ignored: not in tasks %s", sorted(unknown),
                       sorted(weights))
    key = json.dumps([weights, options], sort_keys=True, default=list)
    if len(levels) == 1:
        return _generate_cached(key, split, num_problems, next(iter(levels)), seed, eval_fraction)
    total = sum(levels.values())
    out: list[Problem] = []
    seen: set[str] = set()
    for level in sorted(levels):
        share = max(1, round(num_problems * levels[level] / total))
        for p in _generate_cached(key, split, share, level, seed, eval_fraction):
            if p.uid not in seen:  # the same question at two difficulties counts once
                seen.add(p.uid)
                out.append(p)
    random.Random(seed).shuffle(out)
    return tuple(out[:num_problems])


@functools.lru_cache(maxsize=32)
def _generate_cached(
    key: str, split: str, num_problems: int, difficulty: str, seed: int, eval_fraction: float
) -> tuple[Problem, ...]:
    weights, options = json.loads(key)
    total = sum(weights.values())
    names = sorted(weights)
    quotas = {n: max(1, round(num_problems * weights[n] / total)) for n in names}
    out: list[Problem] = []
    for name in names:
        config = {**TASK_PRESETS[difficulty].get(name, {}), **options.get(name, {})}
        got = _take(_task_stream(name, config, seed), split, quotas[name], eval_fraction)
        if len(got) < quotas[name]:
            logger.warning(
                "reasoning-gym task %r (%s) yielded only %d distinct %s problems of %d asked; "
                "its problem space is small at this difficulty", name, difficulty, len(got),
                split, quotas[name],
            )
        out.extend(got)
    if len(names) > 1:
        random.Random(seed).shuffle(out)
    return tuple(_drop_unparseable(out, f"reasoning-gym {names}")[:num_problems])


def _task_stream(name: str, config: dict[str, object], seed: int) -> Iterator[Problem]:
    import reasoning_gym

    # Per-task seed, so adding a task to the mix does not change the others' problems.
    task_seed = derive_seed(seed, name)
    size = 200_000  # items are generated lazily by index; this only bounds the search
    try:
        ds = reasoning_gym.create_dataset(name, seed=task_seed, size=size, **config)
    except (TypeError, AssertionError, ValueError) as e:
        raise ValueError(f"reasoning-gym task {name!r} rejected options {config}: {e}") from e
    for i in range(size):
        item = ds[i]
        question, answer = str(item["question"]), str(item["answer"])
        yield Problem(question, answer, name, problem_uid(question))


def _take(stream: Iterator[Problem], split: str, n: int, eval_fraction: float) -> list[Problem]:
    seen: set[str] = set()
    out: list[Problem] = []
    misses = 0
    # Stop after many consecutive duplicates: the task's space is exhausted.
    for p in stream:
        if p.uid in seen:
            misses += 1
            if misses > 2000 + 20 * n:
                break
            continue
        seen.add(p.uid)
        misses = 0
        if split_of(p.uid, eval_fraction) == split:
            out.append(p)
            if len(out) >= n:
                break
    return out


def load_problems(
    path: str | Path,
    *,
    split: str = "train",
    num_problems: int | None = None,
    question_key: str = "question",
    answer_key: str = "answer",
    eval_fraction: float = DEFAULT_EVAL_FRACTION,
) -> tuple[Problem, ...]:
    """Problems of `split` from a .jsonl/.json/.parquet file or a local `datasets` directory.

    Raises ValueError naming the file, row and key for a missing key or a wrong type.
    """
    from agentrl.data import raw_rows

    _check_split(split, eval_fraction)
    path = Path(path).expanduser()
    if not path.exists():
        raise ValueError(f"data_path {str(path)!r} does not exist")
    rows = []
    for where, row, error in raw_rows(path, all_splits=True):  # splits come from problem ids
        if error is not None:
            raise ValueError(f"{where}: {error}")
        rows.append((where, row))
    problems: list[Problem] = []
    seen: set[str] = set()
    for where, row in rows:
        question = _field(row, question_key, where, (str,))
        answer = _field(row, answer_key, where, (str, int, float))
        if not question.strip():
            raise ValueError(f"{where}: key {question_key!r} is an empty string")
        uid = problem_uid(question)
        if uid not in seen and split_of(uid, eval_fraction) == split:
            seen.add(uid)
            problems.append(Problem(question, str(answer).strip(), str(path), uid))
    problems = _drop_unparseable(problems, str(path))
    if not problems:
        raise ValueError(f"{path}: no usable problems in split {split!r} ({len(rows)} rows)")
    return tuple(problems[:num_problems] if num_problems is not None else problems)


def _field(row: object, key: str, where: str, types: tuple[type[T], ...]) -> T:
    if not isinstance(row, Mapping):
        raise ValueError(  # noqa: TRY004 - a bad data file is a bad value, like a bad path
            f"{where}: expected an object with keys, got {type(row).__name__}"
        )
    if key not in row:
        keys = sorted(map(str, row))
        hint = difflib.get_close_matches(key, keys, n=1)
        did_you_mean = f" Did you mean {hint[0]!r}?" if hint else ""
        raise ValueError(
            f"{where}: missing key {key!r}.{did_you_mean} Row keys: {keys}; "
            f"set question_key=/answer_key= (CLI: --env_kwargs '{{\"question_key\": ...}}')"
        )
    value = row[key]
    if isinstance(value, bool) or not isinstance(value, types):
        expected = " or ".join(t.__name__ for t in types)
        raise ValueError(  # noqa: TRY004 - see above
            f"{where}: key {key!r} must be {expected}, got {type(value).__name__} "
            f"{value!r:.60}"
        )
    return value


def _check_split(split: str, eval_fraction: float) -> None:
    if split not in SPLITS:
        hint = "eval" if split in ("test", "validation", "val", "dev") else None
        did_you_mean = f" Did you mean {hint!r}?" if hint else ""
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}.{did_you_mean}")
    if not 0 < eval_fraction < 1:
        raise ValueError(f"eval_fraction must be in (0, 1), got {eval_fraction}")
