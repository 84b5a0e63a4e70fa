"""A reward model (`agentrl rm`) as the reward of single-turn RL: `agentrl train --dataset
data.jsonl --reward.model runs/rm/reward_model`.

Episodes' (prompt, response) pairs are gathered into batches (`agentrl.rewards.batched.
BatchedReward`) and scored by one `RewardModelScorer`: in its own Ray actor when Ray is running
(one per reward model and cluster, found by name, so every rollout worker's envs share it;
`--reward.num_gpus` gives it a GPU), else in this process. The scorer renders the prompt as the
environments do and the response as the assistant turn a policy writing it samples (the reward
model's own chat template and tokenizer), and reads the reward model's value at the last token.
"""

from __future__ import annotations

import hashlib
import threading
from typing import Any

from agentrl.rewards.batched import BatchedReward, RewardServiceError


class RewardModelScorer:
    """Scores (prompt, response) items with a reward model directory, a padded batch at a
    time."""

    def __init__(self, path: str, device: str = "auto") -> None:
        from agentrl.backends import resolve_device
        from agentrl.envs.template import ChatTemplateBridge
        from agentrl.models import load_tokenizer
        from agentrl.models.value import load_reward_model

        self.device = resolve_device(device)
        self.model = load_reward_model(path).to(self.device)
        self.tokenizer = load_tokenizer(path)
        self.bridge = ChatTemplateBridge(self.tokenizer)
        self._lock = threading.Lock()

    def _ids(self, prompt: Any, response: str) -> list[int]:
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        return self.bridge.prompt_ids(messages) + self.bridge.action_ids(response)

    def score(self, items: list[dict[str, Any]]) -> list[float]:
        import torch

        seqs = [self._ids(it["prompt"], it["response"]) for it in items]
        width = max(map(len, seqs))
        pad = self.tokenizer.pad_token_id
        pad = int(pad if pad is not None else self.tokenizer.eos_token_id)
        ids = torch.full((len(seqs), width), pad, dtype=torch.long)
        mask = torch.zeros(len(seqs), width, dtype=torch.long)
        for i, s in enumerate(seqs):
            ids[i, : len(s)] = torch.tensor(s)
            mask[i, : len(s)] = 1
        last = torch.tensor([len(s) - 1 for s in seqs])
        with self._lock, torch.no_grad():
            out = self.model(ids.to(self.device), mask.to(self.device), at=last.to(self.device))
        return [float(x) for x in out.float().cpu()]


class ModelReward(BatchedReward):
    """`reward_fn(prompt, response, label)` scored by a reward model (the label is unused)."""

    def __init__(self, path: str, *, max_batch: int = 64, num_gpus: float = 0.0,
                 window_s: float = 0.01) -> None:
        super().__init__(f"reward model {path}", max_batch=max_batch, window_s=window_s)
        self.path, self.num_gpus = path, num_gpus
        self._scorer: Any = None
        self._remote = False

    def _score(self, items: list[dict[str, Any]]) -> list[dict[str, Any] | RewardServiceError]:
        if self._scorer is None:
            self._scorer, self._remote = _scorer(self.path, self.num_gpus)
        if self._remote:
            import ray

            rewards = ray.get(self._scorer.score.remote(items))
        else:
            rewards = self._scorer.score(items)
        return [{"reward": r} for r in rewards]


_local: dict[str, RewardModelScorer] = {}
_local_lock = threading.Lock()


def _scorer(path: str, num_gpus: float) -> tuple[Any, bool]:
    """The Ray actor scoring with `path` (created by the first caller), or a local scorer."""
    import sys

    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        name = "agentrl-reward-model-" + hashlib.sha256(path.encode()).hexdigest()[:16]
        actor = ray.remote(RewardModelScorer).options(
            name=name, get_if_exists=True, num_cpus=0, num_gpus=num_gpus,
        ).remote(path, "cuda" if num_gpus else "cpu")
        return actor, True
    with _local_lock:
        if path not in _local:
            _local[path] = RewardModelScorer(path)
        return _local[path], False
