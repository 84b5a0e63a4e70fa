"""The commands servers/ gives `agentrl` (through the `agentrl.commands` entry point), each
imported only when run: name -> ("module:function", one-line help)."""

COMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("servers.cli:main", "serve a model through the recording OpenAI-compatible proxy"),
    "reward-serve": ("servers.reward_serve:main",
                     "serve a reward function over HTTP (for agentrl train --reward.url)"),
    "view": ("servers.viewer.cli:main",
             "browse a run's trajectories in a local web page (a run dir, a JSONL, a proxy)"),
}
