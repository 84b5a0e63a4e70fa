"""Rollouts: drive many environment episodes concurrently against an `Engine`.

    trajs = await collect(engine, lambda: gym.make("agentrl/Reverse-v0", tokenizer=tok),
                          num_prompts=32, n_samples_per_prompt=4, sampling=SamplingParams())

`collect` imports no torch itself; the engine brings it.
"""

from agentrl.rollout.collector import collect, collect_sync

__all__ = ["collect", "collect_sync"]
