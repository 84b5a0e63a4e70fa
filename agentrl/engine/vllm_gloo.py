"""vLLM 0.32's dense NCCL weight-transfer protocol over gloo, for vLLM's CPU build.

vLLM's `NCCLWeightTransferEngine` (vllm/distributed/weight_transfer/nccl_engine.py) needs CUDA:
it joins a `PyNcclCommunicator`, receives on `torch.cuda.current_stream()` and ends each chunk
with `torch.accelerator.synchronize()`. This subclass keeps the rest of it (the init and update
info it parses, vLLM's layerwise reload around an update) and changes only the group: a torch
gloo group (`agentrl.engine.weight_broadcast.GlooCommunicator`) joined at the rank vLLM's
`worker_init_process_group` (vllm/distributed/weight_transfer/nccl_common.py) computes, and the
unpacked receive loop of `receive_weights` without CUDA streams.

Every vLLM worker that imports agentrl's worker extension registers it with vLLM's
`WeightTransferEngineFactory` as "agentrl_gloo" (agentrl/engine/vllm_weights.py). The tests run
the broadcast weight sync with it against the real vLLM CPU build; vLLM's workers import this
module, which imports vLLM.
"""

from __future__ import annotations

import torch
from vllm.distributed.weight_transfer.nccl_engine import (
    NCCLWeightTransferEngine,
    NCCLWeightTransferInitInfo,
    NCCLWeightTransferUpdateInfo,
)

from agentrl.engine.weight_broadcast import GlooCommunicator


class GlooWeightTransferEngine(NCCLWeightTransferEngine):
    """vLLM's dense NCCL weight-transfer engine with a gloo group instead of NCCL."""

    def init_transfer_engine(self, init_info: NCCLWeightTransferInitInfo) -> None:
        if init_info.packed:
            raise ValueError(
                "the gloo weight transfer receives tensor by tensor: send with packed=False "
                "(vLLM's packed transfer needs CUDA streams)"
            )
        if init_info.master_address is None or init_info.master_port is None:
            raise ValueError(
                "the gloo weight transfer meets the trainer at master_address:master_port; an "
                "NCCL unique id is for NCCL groups only"
            )
        # The rank as vLLM's worker_init_process_group computes it: unique over DP replicas.
        pc = self.parallel_config
        rank = init_info.rank_offset + pc.data_parallel_index * pc.world_size + pc.rank
        self.model_update_group = GlooCommunicator(  # type: ignore[assignment]
            init_info.master_address, init_info.master_port, rank, init_info.world_size
        )

    def update_weights(self, update_info: dict) -> None:
        # The base class ends with torch.accelerator.synchronize(), which fails without an
        # accelerator; gloo's broadcast has finished when it returns.
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, update_info: NCCLWeightTransferUpdateInfo) -> None:
        """vLLM's unpacked receive loop: one broadcast from rank 0 per listed tensor, loaded as
        it arrives."""
        from vllm.model_executor.model_loader.mtp_validation import (
            disable_mtp_completeness_check,
        )

        group, model = self.model_update_group, self.model
        if group is None:
            raise RuntimeError("gloo weight transfer not initialized: call init_transfer_engine")
        with disable_mtp_completeness_check():
            for name, dtype_name, shape in zip(
                update_info.names, update_info.dtype_names, update_info.shapes, strict=True
            ):
                weight = torch.empty(shape, dtype=getattr(torch, dtype_name), device=self.device)
                group.broadcast(weight, src=0)
                model.load_weights([(name, weight)])  # type: ignore[operator]
