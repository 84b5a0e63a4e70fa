"""The CLI reference cannot drift (#35): the flags docs/gen_pages.py lists for each command are
the ones that command's parser accepts, and every `agentrl ...` command shown in a code block of
the README or the docs names a real command and real flags."""

from __future__ import annotations

import importlib.util
import re
import shlex
import sys
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```", re.DOTALL | re.MULTILINE)


@cache
def gen_pages():  # docs/ is not a package: load the build's own generator
    spec = importlib.util.spec_from_file_location("gen_pages", ROOT / "docs" / "gen_pages.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["gen_pages"] = module  # its dataclasses look their module up while defined
    spec.loader.exec_module(module)
    return module


@cache
def accepted() -> dict[str, set[str]]:
    return {c.name: gen_pages().flag_names(c) for c in gen_pages().commands()}


def test_the_reference_lists_what_each_parser_accepts():
    import warnings

    import tyro

    for command in gen_pages().commands():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            parser = tyro.extras.get_parser(command.cls, default=command.default,
                                            config=(tyro.conf.FlagConversionOff,),
                                            use_underscores=True)
        parsed = {s for a in _actions(parser) for s in a.option_strings}
        listed = accepted()[command.name] - {s.split()[0] for s, _ in
                                             gen_pages().EXTRA_FLAGS.get(command.name, [])}
        assert listed == parsed, (command.name, listed ^ parsed)


def _actions(parser):
    yield from parser._actions
    for group in parser._action_groups:
        yield from group._group_actions


def test_the_reference_page_has_every_command_and_flag():
    page = gen_pages().cli_reference()
    for name, flags in accepted().items():
        assert f"## agentrl {name}" in page
        for flag in flags - {"-h", "--help"}:
            assert f"`{flag}" in page, (name, flag)


def shown_commands() -> list[tuple[str, list[str]]]:
    """(page, argv after `agentrl`) for each agentrl command in a code block."""
    found = []
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    for page in pages:
        for lang, body in FENCE.findall(page.read_text()):
            if lang not in ("bash", "console", "text", ""):
                continue
            body = body.replace("\\\n", " ")
            for line in body.splitlines():
                line = line.split(" #")[0].strip().removeprefix("$ ")
                line = re.sub(r"^(/usr/bin/time -v |cd \S+ && )+", "", line)
                if line.startswith("agentrl ") and "<" not in line:
                    found.append((str(page.relative_to(ROOT)), shlex.split(line)[1:]))
    return found


def test_docs_show_many_commands():
    assert len(shown_commands()) > 60


@pytest.mark.parametrize("page,argv", shown_commands(),
                         ids=lambda x: x if isinstance(x, str) else " ".join(x)[:60])
def test_each_shown_command_uses_real_flags(page, argv):
    name, rest = argv[0], argv[1:]
    assert name in accepted(), f"{page}: agentrl {name} is not a command"
    for arg in rest:
        if not arg.startswith("-") or arg in ("-n", "-k", "-h") or re.fullmatch(r"-\d.*", arg):
            continue
        flag = "--" + arg[2:].split("=")[0].replace("-", "_")
        if flag.startswith("--no_") and "--" + flag[5:] in accepted()[name]:
            continue
        assert flag in accepted()[name], f"{page}: agentrl {name} has no flag {flag}"
