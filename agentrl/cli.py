"""The `agentrl` command. Each subcommand lives in its own module and is imported only when
run, so `agentrl --help` is instant and `agentrl envs` never loads torch.

Flags are spelled with underscores in every subcommand (`--max_new_tokens`,
`--rollout.n_samples_per_prompt`); the hyphenated spelling is accepted everywhere as an alias."""

from __future__ import annotations

import importlib
import sys

# name -> ("module:function", one-line help). Functions take argv (list[str]) and return an
# exit code.
COMMANDS: dict[str, tuple[str, str]] = {
    "train": (
        "trainers.cli:main",
        "run RL training on an environment (agentrl train --env math-tir)",
    ),
    "sft": ("trainers.sft:main",
            "supervised fine-tuning on chat data or on agentrl trajectories (rejection sampling)"),
    "dpo": ("trainers.dpo:main", "preference optimisation: DPO, conservative DPO, IPO"),
    "rm": ("trainers.rm:main", "train a pairwise (Bradley-Terry) reward model"),
    "export": ("trainers.export:main",
               "write a LoRA run's model with its adapters merged (agentrl export RUN --merge)"),
    "eval": ("agentrl.rollout.evaluate:main", "evaluate a model on an environment: pass@1, pass@k"),
    "rollout": ("agentrl.rollout.cli:main", "sample trajectories from an env and write JSON lines"),
    "serve": ("servers.cli:main", "serve a model through the recording OpenAI-compatible proxy"),
    "reward-serve": ("servers.reward_serve:main",
                     "serve a reward function over HTTP (for agentrl train --reward.url)"),
    "envs": ("agentrl.envs.cli:main", "list registered environments"),
    "plot": ("trainers.plot:main", "plot a run's metrics to PNG curves"),
}


def _usage() -> str:
    width = max(map(len, COMMANDS))
    lines = ["usage: agentrl <command> [options]", "", "commands:"]
    lines += [f"  {name:<{width}}  {help_}" for name, (_, help_) in COMMANDS.items()]
    lines += ["", "Run `agentrl <command> --help` for a command's options."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0
    if argv[0] in ("-V", "--version"):
        from agentrl import __version__

        print(f"agentrl {__version__}")
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        import difflib

        hint = difflib.get_close_matches(name, COMMANDS, n=1)
        did_you_mean = f" Did you mean {hint[0]!r}?" if hint else ""
        print(f"agentrl: unknown command {name!r}.{did_you_mean}\n\n{_usage()}", file=sys.stderr)
        return 2
    module, _, func = COMMANDS[name][0].partition(":")
    return int(getattr(importlib.import_module(module), func)(underscored(rest)) or 0)


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
