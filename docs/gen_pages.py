"""The documentation's generated pages, made by `mkdocs build` itself (an mkdocs hook, named in
mkdocs.yml), so they cannot drift from the code:

- reference/cli.md: every `agentrl` command and flag, read from the dataclass each command
  hands to `agentrl.command_line.parse_flags` (its fields, types, defaults and docstrings);
- benchmarks/index.md and benchmarks/<name>.md: the recorded results of benchmarks/results/,
  each listed with its date, machine and command, taken from the file.

tests/docs/ import this module to check that the flags listed here are the ones the commands'
parsers accept, and that every `agentrl ...` command shown in the docs uses real flags.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import re
import textwrap
import typing
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"

# Flags a command reads before its dataclass is parsed (trainers/cli.py: build_config).
EXTRA_FLAGS: dict[str, list[tuple[str, str]]] = {
    "train": [
        ("--preset NAME", ("Start from a named preset (trainers/presets.py) instead of the env's "
                           "own; see the command's description for the list.")),
        ("--config FILE", "Start from a JSON config (a run's config.json); flags override it."),
        ("--dataset PATH", ("Shorthand for --dataset.path; without --env the run is single-turn "
                            "RL (agentrl/SingleTurn-v0).")),
    ],
}


# ---------------------------------------------------------------------------------------------
# Commands and their flags


@dataclass(frozen=True)
class Command:
    name: str
    summary: str
    prog: str
    description: str
    cls: type
    default: object | None


@dataclass(frozen=True)
class Flag:
    names: tuple[str, ...]  # "--actor.lr", or ("RUN_DIR",) for a positional argument
    type: str
    default: str  # "required" where there is none
    doc: str
    positional: bool = False


@dataclass(frozen=True)
class Section:
    prefix: str  # "--actor."
    doc: str
    flags: tuple[Flag, ...]


class _Captured(BaseException):  # BaseException: a command's `except Exception` lets it pass
    pass


def commands() -> list[Command]:
    """Each `agentrl` command with the dataclass its parser is generated from: the command is
    run with `--help` while `tyro.cli` is replaced by a recorder, so what is listed is exactly
    what the command parses, defaults from its preset included."""
    import tyro

    from agentrl.cli import commands as table
    from agentrl.plugins import load_callable

    real = tyro.cli

    def record(cls: type, **kwargs: object) -> None:
        raise _Captured(cls, kwargs)

    found = []
    tyro.cli = record  # type: ignore[assignment]
    try:
        for name, (target, summary) in sorted(table().items()):
            try:
                load_callable(target, "main")(["--help"])
            except _Captured as c:
                cls, kwargs = c.args
                found.append(Command(name, summary, str(kwargs.get("prog")),
                                     str(kwargs.get("description") or ""), cls,
                                     kwargs.get("default")))
            else:
                raise RuntimeError(f"agentrl {name} --help parsed nothing through "
                                   "agentrl.command_line.parse_flags; the CLI reference "
                                   "cannot list its flags")
    finally:
        tyro.cli = real  # type: ignore[assignment]
    return found


def _field_docs(cls: type) -> dict[str, tuple[str, str]]:
    """field name -> (annotation source, docstring) for `cls` and its dataclass bases."""
    out: dict[str, tuple[str, str]] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        body = tree.body[0].body  # type: ignore[attr-defined]
        for i, node in enumerate(body):
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                doc = ""
                nxt = body[i + 1] if i + 1 < len(body) else None
                if (isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)
                        and isinstance(nxt.value.value, str)):
                    doc = inspect.cleandoc(nxt.value.value)
                out[node.target.id] = (_type_text(node.annotation), doc)
    return out


def _type_text(node: ast.expr) -> str:
    """The annotation as a reader wants it: Annotated[...] and Positional[...] unwrapped."""
    if isinstance(node, ast.Subscript):
        head = ast.unparse(node.value)
        if head.endswith("Annotated"):
            first = node.slice.elts[0] if isinstance(node.slice, ast.Tuple) else node.slice
            return _type_text(first)
        if head.endswith("Positional"):
            return _type_text(node.slice)
    return ast.unparse(node)


def _aliases(hint: object) -> tuple[str, ...]:
    for meta in getattr(hint, "__metadata__", ()):
        if getattr(meta, "aliases", None):
            return tuple(meta.aliases)
    return ()


def _positional(hint: object) -> bool:
    return any("Positional" in repr(m) for m in getattr(hint, "__metadata__", ()))


def _default(f: dataclasses.Field, owner: object | None) -> str:
    if owner is not None:
        return repr(getattr(owner, f.name))
    if f.default is not dataclasses.MISSING:
        return repr(f.default)
    if f.default_factory is not dataclasses.MISSING:
        return repr(f.default_factory())
    return "required"


def sections(cls: type, default: object | None = None, prefix: str = "--",
             doc: str = "") -> Iterator[Section]:
    """The flags of `cls`, a section per nested dataclass (`--actor.`), top level first."""
    hints = typing.get_type_hints(cls, include_extras=True)
    plain = typing.get_type_hints(cls)
    docs = _field_docs(cls)
    flags, nested = [], []
    for f in dataclasses.fields(cls):
        kind = plain[f.name]
        if isinstance(kind, type) and dataclasses.is_dataclass(kind):
            sub = getattr(default, f.name) if default is not None else None
            nested.append((kind, sub, f"{prefix}{f.name}.", docs[f.name][1]))
            continue
        type_text, field_doc = docs.get(f.name, (str(kind), ""))
        if _positional(hints[f.name]):
            flags.append(Flag((f.name.upper(),), type_text, "required", field_doc, True))
            continue
        value = getattr(default, f.name) if default is not None else None
        if isinstance(value, dict):  # tyro gives each key of a default dict a flag
            flags += [Flag((f"{prefix}{f.name}.{key}",), type(item).__name__, repr(item),
                           field_doc) for key, item in value.items()]
            continue  # (an empty one none: it is set in a --config file or by a preset)
        names = (prefix + f.name, *_aliases(hints[f.name]))
        flags.append(Flag(names, type_text, _default(f, default), field_doc))
    yield Section(prefix, doc or inspect.cleandoc(cls.__doc__ or ""), tuple(flags))
    for kind, sub, sub_prefix, sub_doc in nested:
        yield from sections(kind, sub, sub_prefix, sub_doc)


def flag_names(command: Command) -> set[str]:
    """Every flag `command` accepts: its fields, their aliases, and the flags read before."""
    names = {"--help", "-h"}
    for section in sections(command.cls, command.default):
        for flag in section.flags:
            if not flag.positional:
                names.update(flag.names)
    names.update(spec.split()[0] for spec, _ in EXTRA_FLAGS.get(command.name, []))
    return names


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def cli_reference() -> str:
    cmds = commands()
    out = [
        "# CLI reference",
        "",
        "Generated by `docs/gen_pages.py` when the site is built, from the dataclass each command",
        "parses (`agentrl.command_line.parse_flags`): the flags, types, defaults and texts below",
        "are the ones `agentrl <command> --help` prints. Flags are spelled with underscores; the",
        "hyphenated spelling is accepted too. Booleans take a value (`--use_ray false`) or stand",
        "bare (`--progress`, `--no_progress`).",
        "",
        "| command | what it does |",
        "|---|---|",
    ]
    out += [f"| [`agentrl {c.name}`](#agentrl-{c.name}) | {_cell(c.summary)} |" for c in cmds]
    for c in cmds:
        out += ["", f"## agentrl {c.name}", "", _cell(c.summary) + ".", ""]
        if c.description.strip():
            out += ["```text", inspect.cleandoc(c.description), "```", ""]
        if c.default is not None:
            out += ["Defaults shown are those of the command as run with no flags (for `train`:",
                    "the default env's preset).", ""]
        extra = EXTRA_FLAGS.get(c.name, [])
        for section in sections(c.cls, c.default):
            rows = list(section.flags)
            if not rows and not (extra and section.prefix == "--"):
                continue
            title = "options" if section.prefix == "--" else f"`{section.prefix}*`"
            out += [f"### {c.name}: {title}", ""]
            if section.prefix != "--" and section.doc:
                out += [_cell(section.doc), ""]
            out += ["| flag | type | default | meaning |", "|---|---|---|---|"]
            if section.prefix == "--":
                out += [f"| `{spec}` | | | {_cell(doc)} |" for spec, doc in extra]
            for flag in rows:
                names = ", ".join(f"`{n}`" for n in flag.names)
                out.append(f"| {names} | `{_cell(flag.type)}` | `{_cell(flag.default)}` | "
                           f"{_cell(flag.doc)} |")
            out.append("")
    return "\n".join(out) + "\n"


# ---------------------------------------------------------------------------------------------
# Benchmarks

_DATE = re.compile(r"\b(20\d\d-\d\d-\d\d)\b")
_PROGRAM = (r"(?:cd \S+ && )?(?:/usr/bin/time \S+ )?(?:\.venv/bin/)?"
            r"(?:agentrl|python3?|pytest|bash|make|sbatch) ")
_COMMANDS = (re.compile(rf"^(?:\$ |\s{{4,}})({_PROGRAM}.*)$", re.MULTILINE),  # a code line
             re.compile(rf"`({_PROGRAM}[^`]*)`"))  # else one in running text
_MACHINES = (re.compile(r"Machine:\s*"),
             re.compile(r"(?:AMD EPYC|Intel Xeon|(?:[Oo]ne )?NVIDIA H[12]00|x86_64)"))


@dataclass(frozen=True)
class Result:
    name: str  # the file's stem
    title: str
    date: str
    machine: str
    command: str


def _first_sentence(text: str, start: int) -> str:
    end = re.search(r"[.;](\s|$)", text[start:])
    chunk = text[start: start + end.start() if end else start + 240]
    return " ".join(chunk.split())[:160]


def read_result(path: Path) -> Result:
    """The date, machine and command of a results file: the first of each it states ("not
    stated" where it states none; a date missing from the text is its last commit's)."""
    text = path.read_text()
    title = text.splitlines()[0].lstrip("# ").strip()
    date = _DATE.search(text)
    command = next((m.group(1).strip() for pattern in _COMMANDS
                    if (m := pattern.search(text))), None)
    machine = next((m for pattern in _MACHINES if (m := pattern.search(text))), None)
    when = date.group(1) if date else None
    if when is None:  # the file states none: the date of the commit that last changed it
        committed = _DATE.search(_git("log", "-1", "--format=%cs", "--", str(path)))
        when = f"{committed.group(1)} (commit)" if committed else None
    start = None
    if machine:
        start = machine.end() if machine.group(0).startswith("Machine") else machine.start()
    # A file that states none (a planned run, not yet measured) is listed as such: the index
    # shows what is missing rather than failing the build over another engineer's notes.
    return Result(path.stem, title, when or "not stated",
                  _first_sentence(text, start) if start is not None else "not stated",
                  command or "not stated")


def _git(*args: str) -> str:
    import subprocess

    done = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True,
                          check=False)  # no git (a tarball): no commit date
    return done.stdout


def benchmark_pages() -> dict[str, str]:
    """benchmarks/<name>.md for each results file, and benchmarks/index.md listing them."""
    pages: dict[str, str] = {}
    rows = []
    for path in sorted(RESULTS.glob("*.md")):
        result = read_result(path)
        pages[f"benchmarks/{path.name}"] = _site_links(path.read_text())
        rows.append(f"| [{_cell(result.title)}]({path.name}) | {result.date} | "
                    f"{_cell(result.machine)} | `{_cell(result.command)}` |")
    pages["benchmarks/index.md"] = "\n".join([
        "# Benchmarks",
        "",
        "Every number in these docs comes from one of these files, which record the command,",
        "the machine and the date of each measurement (the files are `benchmarks/results/*.md`",
        "in the repository; this index is generated from them when the site is built). The",
        "date, machine and command shown are the first the file states; most files hold",
        "several runs, each with its own; \"not stated\" marks a file that gives none (a run",
        "planned, not yet measured).",
        "",
        "| result | date | machine | command |",
        "|---|---|---|---|",
        *rows,
        "",
    ])
    return pages


def _site_links(text: str) -> str:
    """A results file as a site page: links to files outside the results folder become plain
    text (the site holds only the docs), links to other results files stay links."""
    def fix(m: re.Match[str]) -> str:
        bang, label, target = m.group(1), m.group(2), m.group(3)
        if "://" in target or target.startswith("#"):
            return m.group(0)
        name = Path(target.split("#")[0]).name
        if (RESULTS / name).is_file() and name.endswith(".md"):
            return f"[{label}]({name})"
        if target.endswith((".png", ".jpg")) and (ROOT / "docs" / "images" / name).is_file():
            return f"{bang}[{label}](../images/{name})"
        return f"{label} (`{target}`)"
    return re.sub(r"(!?)\[([^\]]+)\]\(([^)\s]+)\)", fix, text)


# ---------------------------------------------------------------------------------------------
# The mkdocs hook


def generated_pages() -> dict[str, str]:
    return {"reference/cli.md": cli_reference(), **benchmark_pages()}


def on_files(files, config):  # type: ignore[no-untyped-def]  # mkdocs' hook signature
    from mkdocs.structure.files import File

    for path, content in generated_pages().items():
        files.append(File.generated(config, path, content=content))
    return files
