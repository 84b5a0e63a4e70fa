"""`agentrl envs`: list every registered environment with a one-line summary."""

from __future__ import annotations

from dataclasses import dataclass

from agentrl.command_line import parse_flags


@dataclass(frozen=True, kw_only=True)
class EnvsArgs:
    """`agentrl envs` takes no options."""


def main(argv: list[str]) -> int:
    parse_flags(EnvsArgs, argv, prog="agentrl envs", doc=__doc__)
    from agentrl.envs.registry import list_envs

    envs = list_envs()
    width = max((len(e.id) for e in envs), default=0)
    for e in envs:
        alias = f"  [--env {e.aliases[0]}]" if e.aliases else ""
        print(f"{e.id:<{width}}  {e.summary}{alias}")
    return 0
