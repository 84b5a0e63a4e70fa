"""The commands trainers/ gives `agentrl` (through the `agentrl.commands` entry point), each
imported only when run: name -> ("module:function", one-line help)."""

COMMANDS: dict[str, tuple[str, str]] = {
    "train": ("trainers.cli:main",
              "run RL training on an environment (agentrl train --env math-tir)"),
    "sft": ("trainers.sft:main",
            "supervised fine-tuning on chat data or on agentrl trajectories (rejection sampling)"),
    "dpo": ("trainers.dpo:main", "preference optimisation: DPO, conservative DPO, IPO"),
    "rm": ("trainers.rm:main", "train a pairwise (Bradley-Terry) reward model"),
    "export": ("trainers.export:main",
               "write a LoRA run's model with its adapters merged (agentrl export RUN --merge)"),
    "plot": ("trainers.plot:main", "plot a run's metrics to PNG curves"),
}
