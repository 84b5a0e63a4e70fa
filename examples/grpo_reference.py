"""GRPO on one page: sample groups of episodes from a token env, score each sample against its
group's mean, and take one clipped policy-gradient step per batch. Plain PyTorch, one process.

    python examples/grpo_reference.py                       # Digits, tiny model: ~20 s, 2 cores
    python examples/grpo_reference.py --env agentrl/Reverse-v0 --steps 60

It uses the library and nothing else: a registered env (`gym.make`), the transformers engine
sampling from the very module being trained, the rollout loop (agentrl/rollout) and the
algorithm functions (agentrl/algorithms). `agentrl train` takes the same step
(trainers/rl_step.py, trainers/policy.py) with Ray, packing, micro-batches, checkpoints,
evals and every option; tests/trainers/test_reference_loop.py holds it to this page: on the
same batch, the same advantages, loss and gradients, and the same weights after one update (up
to AdamW's response to float32 round-off, which the test accounts for).

GRPO: Shao et al. 2024, arXiv:2402.03300, with DAPO's token-mean loss (arXiv:2503.14476).
Shapes: `_B` episodes, `_T` target tokens (position t predicts token t + 1).
"""

from __future__ import annotations

import dataclasses
import sys

import gymnasium as gym
import torch
from torch import Tensor, nn

import agentrl  # noqa: F401 (registers the built-in envs)
from agentrl import algorithms as A
from agentrl.command_line import parse_flags
from agentrl.completion import SamplingParams
from agentrl.engine import Engine, create_engine
from agentrl.models import load_model, load_tokenizer
from agentrl.rollout import collect_sync
from agentrl.seeding import derive_seed
from agentrl.types import Trajectory, dense_group_ids


@dataclasses.dataclass(frozen=True, kw_only=True)
class Args:
    env: str = "agentrl/Digits-v0"
    """A registered token env (`agentrl envs` lists them)."""
    model: str = "tiny"
    """A model name (tiny, smollm2-135m-instruct) or a local Hugging Face model directory."""
    steps: int = 30
    """Batches sampled and trained on."""
    prompts_per_step: int = 8
    """Env resets per batch."""
    n_samples_per_prompt: int = 4
    """Episodes per reset: one group, whose mean reward is each member's baseline."""
    max_new_tokens: int = 8
    """Most tokens per policy turn."""
    temperature: float = 1.0
    """Sampling temperature (the log-probs of the update use it too)."""
    lr: float = 3e-3
    """AdamW learning rate."""
    max_grad_norm: float = 1.0
    """Gradient clipping norm."""
    clip: float = 0.2
    """PPO clip epsilon (inert here: one update per batch keeps the ratio at 1)."""
    seed: int = 0
    """Seed of the sampling."""


def sample(engine: Engine, tokenizer: object, args: Args, step: int) -> list[Trajectory]:
    """One batch: `prompts_per_step` resets of the env, `n_samples_per_prompt` episodes each."""
    return collect_sync(
        engine,
        lambda: gym.make(args.env, tokenizer=tokenizer),
        num_prompts=args.prompts_per_step,
        n_samples_per_prompt=args.n_samples_per_prompt,
        sampling=SamplingParams(temperature=args.temperature, max_tokens=args.max_new_tokens,
                                seed=derive_seed(args.seed, step)),
        seeds=[derive_seed(args.seed, "prompt", step * args.prompts_per_step + i)
               for i in range(args.prompts_per_step)],
        group_prefix=f"s{step}-",
    )


def to_tensors(trajs: list[Trajectory], pad_id: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Right-padded ids_BT and attention_BT [B, T]; mask_BT (1 on the policy's tokens) and
    rewards_BT (each turn's reward on its last token) [B, T-1]."""
    B, T = len(trajs), max(len(t.token_ids) for t in trajs)
    ids_BT = torch.full((B, T), pad_id, dtype=torch.long)
    attention_BT = torch.zeros(B, T, dtype=torch.long)
    mask_BT, rewards_BT = torch.zeros(B, T - 1), torch.zeros(B, T - 1)
    for b, traj in enumerate(trajs):
        n = len(traj.token_ids)
        ids_BT[b, :n], attention_BT[b, :n] = torch.tensor(traj.token_ids), 1
        mask_BT[b, : n - 1] = torch.tensor(traj.loss_mask[1:], dtype=torch.float32)
        for turn in traj.turns:
            if turn.end > turn.start:
                rewards_BT[b, turn.end - 2] += turn.reward
    return ids_BT, attention_BT, mask_BT, rewards_BT


def update(
    model: nn.Module, optimizer: torch.optim.Optimizer, trajs: list[Trajectory], args: Args,
    pad_id: int,
) -> tuple[Tensor, Tensor]:
    """One GRPO step on a batch. Returns its advantages_BT and loss."""
    ids_BT, attention_BT, mask_BT, rewards_BT = to_tensors(trajs, pad_id)
    # A_i = (r_i - mean(r_group)) / (std(r_group) + eps), on every token of episode i.
    advantages_BT, _ = A.compute_advantages(
        "group_norm", rewards_BT=rewards_BT, mask_BT=mask_BT,
        group_ids_B=torch.tensor(dense_group_ids(trajs)))
    logits_BTV = model(input_ids=ids_BT, attention_mask=attention_BT).logits[:, :-1]
    logp_BT = A.logprobs_from_logits(logits_BTV, ids_BT[:, 1:], args.temperature)
    # The batch was sampled by these very weights and is trained on once: the old log-probs
    # are the new ones, the ratio is 1 and the clipped surrogate's gradient is REINFORCE's.
    loss_BT, _ = A.policy_loss(
        "ppo", logp_BT=logp_BT, old_logp_BT=logp_BT.detach(), advantages_BT=advantages_BT,
        mask_BT=mask_BT, clip_low=args.clip, clip_high=args.clip)
    loss = A.aggregate_loss(loss_BT, mask_BT, "token-mean", num_tokens=mask_BT.sum())
    optimizer.zero_grad()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
    optimizer.step()
    return advantages_BT, loss.detach()


def main(args: Args) -> None:
    tokenizer = load_tokenizer(args.model)
    model = load_model(args.model)
    pad = tokenizer.pad_token_id
    pad_id = pad if pad is not None else tokenizer.eos_token_id
    engine = create_engine(model, tokenizer=tokenizer)  # samples from `model` itself
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    for step in range(args.steps):
        model.eval()  # no dropout while sampling
        trajs = sample(engine, tokenizer, args, step)
        model.train()
        _, loss = update(model, optimizer, trajs, args, pad_id)
        # The engine's weights are the module's: a version bump (its cached prefixes go).
        engine.update_weights({}, step + 1)
        reward = sum(t.total_reward for t in trajs) / len(trajs)
        print(f"step {step + 1:3d}  reward {reward:+.3f}  loss {float(loss):+.4f}")
    engine.close()


if __name__ == "__main__":
    main(parse_flags(Args, sys.argv[1:], prog="grpo_reference.py", doc=__doc__))
