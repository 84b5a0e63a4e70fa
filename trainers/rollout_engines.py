"""The trainer's rollout engines: the one `--rollout.engine` names, and the placed run's further
engines (`--rollout.num_engines`), each in a Ray actor of its own, called like a local engine."""

from __future__ import annotations

from typing import Any

import torch

from agentrl.completion import SamplingParams
from trainers.config import TrainConfig


def make_engine(
    cfg: TrainConfig, model: Any, tokenizer: Any, device: torch.device,
    weight_transfer: str | None = None,
) -> Any:
    """The rollout engine `cfg.rollout.engine` names. transformers samples from `model` itself
    (colocated, the module being trained); vllm loads its own copy of `cfg.actor.model` (and
    takes broadcast weight updates with `weight_transfer`: trainers/weight_sync.py)."""
    from agentrl.engine import create_engine, open_engine

    ro = cfg.rollout
    if ro.engine == "transformers":
        return create_engine(model, tokenizer=tokenizer, device=str(device))
    return open_engine(
        cfg.actor.model, engine=ro.engine, device=str(device), tokenizer=tokenizer,
        tensor_parallel_size=ro.tensor_parallel_size,
        gpu_memory_utilization=ro.gpu_memory_utilization, enable_sleep=ro.enable_sleep,
        weight_transfer=weight_transfer, flag_prefix="--rollout.",
    )


def own_engine(cfg: TrainConfig, tokenizer: Any,
                weight_transfer: str | None = None) -> tuple[Any, Any]:
    """(model, engine): an engine with its own copy of the weights (vLLM loads them itself;
    the transformers engine samples from the returned model)."""
    from agentrl.backends import resolve_device
    from agentrl.models import load_model

    device = resolve_device(cfg.actor.device)
    model = None
    if cfg.rollout.engine == "transformers":
        model = load_model(cfg.actor.model).eval().to(device)
    return model, make_engine(cfg, model, tokenizer, device, weight_transfer)


class EngineWorker:
    """One more engine of a placed run (`--rollout.num_engines`), in its own Ray actor: the
    rollout worker's router calls it like a local engine (`RemoteEngine`)."""

    def __init__(self, cfg: TrainConfig, weight_transfer: str | None = None) -> None:
        """`weight_transfer`: the engine also takes broadcast updates (trainers/weight_sync.py)."""
        from agentrl.models import load_tokenizer

        self.model, self.engine = own_engine(cfg, load_tokenizer(cfg.actor.model),
                                              weight_transfer)

    async def generate(self, prompt_ids: list[int], params: SamplingParams,
                       images: Any = None) -> list[Any]:
        return list(await self.engine.generate(prompt_ids, params, images))

    def update_weights(self, named: list[tuple[str, torch.Tensor]], version: int) -> int:
        self.engine.update_weights(named, version)
        return version

    def weight_transfer(self, step: str, *args: Any) -> None:
        """One step of a broadcast update (agentrl.engine.weight_broadcast.RECEIVER_STEPS)."""
        from agentrl.engine.weight_broadcast import receive_step

        receive_step(self.engine, step, *args)

    def info(self) -> tuple[int, int]:
        """(version, max_context)."""
        return int(self.engine.version), int(self.engine.max_context)

    def node(self) -> str:
        from trainers.ray_utils import current_node

        return current_node()

    def close(self) -> None:
        self.engine.close()


class RemoteEngine:
    """An `EngineWorker` actor as an engine (what the router needs of one)."""

    def __init__(self, actor: Any) -> None:
        import ray

        self.actor = actor
        self.version, self.max_context = ray.get(actor.info.remote())

    async def generate(self, prompt_ids: Any, params: SamplingParams,
                       images: Any = None) -> list[Any]:
        import ray

        from agentrl.engine.router import EngineGone

        try:
            return list(await self.actor.generate.remote(list(prompt_ids), params, images))
        except ray.exceptions.RayActorError as e:
            raise EngineGone(f"engine actor died: {e}") from e

    def start_update(self, named: Any, version: int) -> Any:
        """Send the weights and return at once (the router waits for several together)."""
        items = list(named.items()) if hasattr(named, "items") else list(named)
        return self.actor.update_weights.remote(items, version)

    def finish_update(self, pending: Any, version: int) -> None:
        import ray

        from agentrl.engine.router import EngineGone

        try:
            ray.get(pending)
        except ray.exceptions.RayActorError as e:
            raise EngineGone(f"engine actor died: {e}") from e
        self.version = version

    def update_weights(self, named: Any, version: int) -> None:
        self.finish_update(self.start_update(named, version), version)

    def weight_transfer(self, step: str, *args: Any) -> None:
        """One step of a broadcast update, in the actor (`EngineWorker.weight_transfer`)."""
        import ray

        from agentrl.engine.router import EngineGone

        try:
            ray.get(self.actor.weight_transfer.remote(step, *args))
        except ray.exceptions.RayActorError as e:
            raise EngineGone(f"engine actor died: {e}") from e
        if step == "finish_weight_transfer":
            self.version = int(args[0])

    def sleep(self) -> None:
        pass

    def wake(self) -> None:
        pass

    def close(self) -> None:
        import ray

        ray.get(self.actor.close.remote())
