"""The `agentrl` command. Each subcommand lives in its own module and is imported only when
run, so `agentrl --help` is instant and `agentrl envs` never loads torch. The library's own
commands are listed here; trainers/ and servers/ add theirs through the `agentrl.commands`
entry-point group, as any installed package may.

Flags are spelled with underscores in every subcommand (`--max_new_tokens`,
`--rollout.n_samples_per_prompt`); the hyphenated spelling is accepted everywhere as an alias."""

from __future__ import annotations

import os
import sys

COMMAND_ENTRY_POINT_GROUP = "agentrl.commands"
"""Upper layers add commands through this entry-point group: each entry names a dict like
`LIBRARY_COMMANDS` (trainers/commands.py, servers/commands.py), imported without torch."""

# name -> ("module:function", one-line help). Functions take argv (list[str]) and return an
# exit code.
LIBRARY_COMMANDS: dict[str, tuple[str, str]] = {
    "eval": ("agentrl.rollout.evaluate:main", "evaluate a model on an environment: pass@1, pass@k"),
    "rollout": ("agentrl.rollout.cli:main", "sample trajectories from an env and write JSON lines"),
    "envs": ("agentrl.envs.cli:main", "list registered environments"),
}


def commands() -> dict[str, tuple[str, str]]:
    """Every command: the library's and those installed packages add (a broken provider is
    skipped with a warning, so the others still run)."""
    import importlib.metadata
    import logging

    found: dict[str, tuple[str, str]] = {}
    for ep in sorted(importlib.metadata.entry_points(group=COMMAND_ENTRY_POINT_GROUP),
                     key=lambda ep: ep.name):
        try:
            found.update(ep.load())
        except Exception as e:  # noqa: BLE001 (one broken provider must not hide the rest)
            logging.getLogger(__name__).warning(
                "agentrl command provider %r (%s) failed to load: %s", ep.name, ep.value, e)
    return {**found, **LIBRARY_COMMANDS}


def _usage(table: dict[str, tuple[str, str]]) -> str:
    width = max(map(len, table))
    lines = ["usage: agentrl <command> [options]", "", "commands:"]
    lines += [f"  {name:<{width}}  {help_}" for name, (_, help_) in table.items()]
    lines += ["", "Run `agentrl <command> --help` for a command's options."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    table = commands()
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(_usage(table))
        return 0
    if argv[0] in ("-V", "--version"):
        from agentrl import __version__

        print(f"agentrl {__version__}")
        return 0
    name, rest = argv[0], argv[1:]
    if name not in table:
        import difflib

        hint = difflib.get_close_matches(name, table, n=1)
        did_you_mean = f" Did you mean {hint[0]!r}?" if hint else ""
        print(f"agentrl: unknown command {name!r}.{did_you_mean}\n\n{_usage(table)}",
              file=sys.stderr)
        return 2
    # Modules named on the command line (`--env echo_env:me/Echo-v0`, `--agent my_agent:run`)
    # import from the current directory, as with `python -m`; last, so they shadow nothing
    # installed. Ray's workers get the driver's directory on their path too.
    if os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())
    from agentrl.plugins import load_callable

    return int(load_callable(table[name][0], "main")(underscored(rest)) or 0)


def underscored(argv: list[str]) -> list[str]:
    """Flag names with underscores, the one spelling every subcommand defines
    (`--rollout.max-new-tokens 64` -> `--rollout.max_new_tokens 64`); values are left alone."""
    out = []
    for a in argv:
        if a.startswith("--") and len(a) > 2:
            name, eq, value = a.partition("=")
            a = "--" + name[2:].replace("-", "_") + eq + value
        out.append(a)
    return out


if __name__ == "__main__":
    sys.exit(main())
