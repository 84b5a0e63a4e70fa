"""`agentrl envs`: list every registered environment with a one-line summary."""

from __future__ import annotations

import argparse


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="agentrl envs", description=__doc__)
    parser.parse_args(argv)
    from agentrl.envs.registry import list_envs

    envs = list_envs()
    width = max((len(e.id) for e in envs), default=0)
    for e in envs:
        alias = f"  [--env {e.aliases[0]}]" if e.aliases else ""
        print(f"{e.id:<{width}}  {e.summary}{alias}")
    return 0
