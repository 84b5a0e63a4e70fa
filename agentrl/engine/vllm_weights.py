"""Weight updates into vLLM 0.32's workers: what agentrl.engine.vllm_updates sends, and runs there.

vLLM's own in-place reload, as its weight-transfer engines do it
(vllm/distributed/weight_transfer/nccl_engine.py): `initialize_layerwise_reload(model)`, then
`model.load_weights(...)` per chunk, then `finalize_layerwise_reload(model, model_config)`,
which reruns each reloaded layer's weight processing (on CPU: repacking for its GEMM kernels)
and puts back the layers no chunk touched. The three steps run in every worker through
`AsyncLLM.collective_rpc` on `WorkerExtension` (the `worker_extension_cls` engine argument).

`collective_rpc` arguments reach the engine-core process as msgpack, which turns an untyped
tensor into a bare `[dtype, shape, buffer index]` list (vllm/v1/serial_utils.py), so tensors
travel as `(name, dtype, shape, bytes)` and are rebuilt in the worker.

Broadcast updates (agentrl/engine/weight_broadcast.py) use vLLM's own weight-transfer engines
instead; this module registers agentrl's gloo one (agentrl/engine/vllm_gloo.py) with vLLM's
factory in each worker.

This module is imported by vLLM's worker processes: it imports nothing heavy at module level.
"""

from __future__ import annotations

import contextlib
import sys
import warnings
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

WORKER_EXTENSION = "agentrl.engine.vllm_weights.WorkerExtension"
GLOO_BACKEND = "agentrl_gloo"
"""vLLM weight-transfer backend name of agentrl.engine.vllm_gloo.GlooWeightTransferEngine."""

# A tensor as it crosses vLLM's RPC: (name, dtype name, shape, raw bytes).
PackedTensor = tuple[str, str, list[int], bytes]


def pack_tensor(name: str, tensor: torch.Tensor) -> PackedTensor:
    """What survives msgpack to the engine core and pickle to the workers."""
    import torch

    t = tensor.detach().to("cpu").contiguous()
    data = t.reshape(-1).view(torch.uint8).numpy().tobytes()
    return name, str(t.dtype).removeprefix("torch."), list(t.shape), data


def unpack_tensor(item: PackedTensor, device: Any = "cpu") -> tuple[str, torch.Tensor]:
    import torch

    name, dtype_name, shape, data = item
    dtype = getattr(torch, dtype_name)
    if not len(data):
        return name, torch.empty(shape, dtype=dtype, device=device)
    with warnings.catch_warnings():
        # bytes are read-only; load_weights only reads the tensor (it copies into parameters).
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        flat = torch.frombuffer(data, dtype=torch.uint8)
    return name, flat.view(dtype).reshape(shape).to(device)


class WorkerExtension:
    """Mixed into vLLM's worker (`worker_extension_cls`); runs inside each worker process.

    `vllm_config`, `device` and `model_runner` are the worker's own (vLLM 0.32
    `vllm.v1.worker.gpu_worker.Worker`, which the CPU worker subclasses). The three steps are
    those of vLLM's weight-transfer engines (start / update chunks / finish).
    """

    def agentrl_start_update(self) -> None:
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        worker: Any = self
        with set_current_vllm_config(worker.vllm_config):
            initialize_layerwise_reload(worker.model_runner.get_model())

    def agentrl_load_weights(self, packed: list[PackedTensor]) -> int:
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.mtp_validation import (
            disable_mtp_completeness_check,
        )

        worker: Any = self
        weights = [unpack_tensor(p, worker.device) for p in packed]
        # A chunk holds part of the model: no check that it holds every MTP weight.
        with set_current_vllm_config(worker.vllm_config), disable_mtp_completeness_check():
            worker.model_runner.get_model().load_weights(weights)
        return len(weights)

    def agentrl_finish_update(self) -> None:
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        worker: Any = self
        runner = worker.model_runner
        with set_current_vllm_config(worker.vllm_config):
            finalize_layerwise_reload(runner.get_model(), worker.vllm_config.model_config)
        runner.reset_lora_state()


def buckets(items: Iterable[tuple[str, Any]], most_bytes: int) -> Iterator[list[PackedTensor]]:
    bucket: list[PackedTensor] = []
    size = 0
    for name, tensor in items:
        bucket.append(pack_tensor(name, tensor))
        size += len(bucket[-1][3])
        if size >= most_bytes:
            yield bucket
            bucket, size = [], 0
    if bucket:
        yield bucket


def with_tied_head(items: Iterable[tuple[str, Any]], tied: bool) -> Iterator[tuple[str, Any]]:
    """The items, plus `lm_head.weight` = the input embedding where the model ties them and the
    items lack it (`named_parameters()` lists a tied weight once; `state_dict()` under both
    names). vLLM's output layer is a layer of its own that only a load of its own name
    refreshes: on CPU it keeps a repacked copy of the weight, which would stay the old one."""
    embedding, head = None, False
    for name, tensor in items:
        if tied and name.endswith("embed_tokens.weight"):
            embedding = tensor
        head = head or name == "lm_head.weight"
        yield name, tensor
    if embedding is not None and not head:
        yield "lm_head.weight", embedding


def register_weight_transfer_backends() -> None:
    """Make agentrl's weight-transfer backend (GLOO_BACKEND) known to vLLM's
    `WeightTransferEngineFactory` in this process (imported when first used)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    with contextlib.suppress(ValueError):  # registered already
        WeightTransferEngineFactory.register_engine(
            GLOO_BACKEND, "agentrl.engine.vllm_gloo", "GlooWeightTransferEngine"
        )


# vLLM's worker imports this module (worker_extension_cls, vllm/v1/worker/worker_base.py
# `init_worker`) before it loads the model, which is when it creates its weight-transfer engine
# (vllm/v1/worker/gpu_worker.py `load_model`): register it then. Without vLLM loaded (or with a
# stand-in for it) there is nothing to register with, and this module stays light.
if "vllm" in sys.modules:
    with contextlib.suppress(ImportError):
        register_weight_transfer_backends()
