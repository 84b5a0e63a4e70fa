"""Dataset rows from local files, for every `--dataset` flag (sft, dpo, rm, and train's
single-turn RL) and the math environments' `data_path`: a JSONL (or JSON list) file, a Parquet
file, or a local Hugging Face `datasets` directory (one `save_to_disk` wrote, or data files
`load_dataset` reads). Nothing is fetched from a hub.

Bad rows are reported by where they are (`file:line`, or the row index): a line that is not
JSON, a row that is not an object or lacks a required key. `on_bad="stop"` (default) raises at
the first; `"skip"` drops them and counts them in `Rows.skipped`. A dataset with no usable row
raises before anything else is loaded.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

OnBad = Literal["stop", "skip"]


class DataError(ValueError):
    """A dataset that cannot be read, or a row that cannot be used."""


@dataclass
class Rows:
    rows: list[dict[str, Any]] = field(default_factory=list)
    where: list[str] = field(default_factory=list)
    """Where each row came from (`file:line` or `file[row]`), for messages about it."""
    skipped: list[str] = field(default_factory=list)
    """One reason per row skipped with on_bad="skip"."""

    def __len__(self) -> int:
        return len(self.rows)


def read_rows(path: str | Path, *, keys: Mapping[str, str] | Sequence[str] = (),
              on_bad: OnBad = "stop", what: str = "dataset") -> Rows:
    """The rows of `path` that are objects holding every key in `keys` (a mapping names the
    flag that sets each key, for the message about a row that lacks it)."""
    flags = dict(keys) if isinstance(keys, Mapping) else {k: "" for k in keys}
    if on_bad not in ("stop", "skip"):
        raise ValueError(f"on_bad must be 'stop' or 'skip', got {on_bad!r}")
    p = Path(path)
    if not p.exists():
        raise DataError(f"{what} {str(p)!r} does not exist")
    out = Rows()
    for where, row, error in raw_rows(p):
        if error is None and not isinstance(row, dict):
            error = f"a row must be a JSON object, got {type(row).__name__}"
        if error is None:
            missing = [k for k in flags if k not in row]
            if missing:
                named = [flags[k] for k in missing if flags[k]]
                hint = f"; name the column with {', '.join(named)}" if named else ""
                error = f"no {', '.join(map(repr, missing))} key (it has {sorted(row)[:12]}){hint}"
        if error is not None:
            if on_bad == "stop":
                raise DataError(f"{where}: {error} (skip such rows with --bad_rows skip)")
            out.skipped.append(f"{where}: {error}")
            continue
        out.rows.append(row)
        out.where.append(where)
    if not out.rows:
        reason = f"; skipped: {out.skipped[0]}" + (
            f" (and {len(out.skipped) - 1} more)" if len(out.skipped) > 1 else "") \
            if out.skipped else ""
        raise DataError(f"{what} {str(p)!r} has no usable rows{reason}")
    return out


def raw_rows(p: Path, *, all_splits: bool = False) -> Iterator[tuple[str, Any, str | None]]:
    """Every row of `p` as (where, row, None), or (where, None, why) for a line that is not
    JSON; a file that cannot be read at all raises DataError. A `datasets` directory with
    several splits gives its 'train' split, or every split with `all_splits` (a reader that
    makes its own split, like the math environments)."""
    if p.is_dir():
        yield from _hf_rows(p, all_splits)
        return
    suffix = p.suffix.lower()
    if suffix == ".parquet":
        import pyarrow.parquet as pq

        for i, row in enumerate(pq.read_table(p).to_pylist()):
            yield f"{p}[{i}]", row, None
    elif suffix == ".json":
        try:
            data = json.loads(p.read_text())
        except json.JSONDecodeError as e:
            raise DataError(f"{p}: not valid JSON ({e}); a .json dataset is one list of "
                            f"objects, a .jsonl one object per line") from None
        if not isinstance(data, list):
            raise DataError(f"{p}: a .json dataset must be a list of objects")
        for i, row in enumerate(data):
            yield f"{p}[{i}]", row, None
    elif suffix in (".jsonl", ".ndjson"):
        with p.open() as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    yield f"{p}:{lineno}", json.loads(line), None
                except json.JSONDecodeError as e:
                    yield f"{p}:{lineno}", None, f"not valid JSON ({e})"
    else:
        raise DataError(f"{p}: unknown dataset format {suffix or '(no suffix)'!r}; use .jsonl, "
                        f".json, .parquet or a directory saved by datasets' save_to_disk")


def _hf_rows(p: Path, all_splits: bool) -> Iterator[tuple[str, Any, str | None]]:
    import datasets

    try:
        if (p / "dataset_info.json").exists() or (p / "dataset_dict.json").exists():
            ds = datasets.load_from_disk(str(p))
        else:  # data files (parquet, jsonl, ...) that datasets recognises
            ds = datasets.load_dataset(str(p))
    except (FileNotFoundError, ValueError) as e:
        raise DataError(f"{p}: not a directory datasets can read: one save_to_disk wrote, or "
                        f"data files ({e})") from None
    if isinstance(ds, datasets.DatasetDict):
        if all_splits:
            ds = datasets.concatenate_datasets(list(ds.values()))
        elif "train" not in ds:
            raise DataError(f"{p}: a DatasetDict without a 'train' split (it has "
                            f"{sorted(ds)}); point at one split's directory")
        else:
            ds = ds["train"]
    for i, row in enumerate(ds):
        yield f"{p}[{i}]", row, None
