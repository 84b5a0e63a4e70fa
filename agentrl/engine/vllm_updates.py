"""Changing a running VLLMEngine's weights, and putting it to sleep (agentrl.engine.vllm_engine
starts it and samples from it; this module holds what stops sampling and changes weights).

- Weights: vLLM's own in-place reload, driven in the workers through `collective_rpc`
  (agentrl/engine/vllm_weights.py runs there).
- Partial rollout: an update does not wait for running requests. Generation is paused with
  `pause_generation(mode="keep", clear_cache=True)`: the scheduler stops between two steps and
  preempts every running request, dropping its KV cache; after the update `resume_generation()`
  re-encodes each one's prompt and tokens so far with the new weights (vLLM's recompute
  preemption) and sampling goes on, each token labelled with the version that sampled it
  (agentrl/engine/vllm_convert.py).
- Broadcast weights (`weight_transfer="nccl"` on GPUs, "gloo" on CPUs): vLLM's own
  weight-transfer API, `weight_transfer_config` and `AsyncLLM.init_weight_transfer_engine` /
  `start_weight_update` / `update_weights` / `finish_weight_update`; a trainer's rank 0 sends
  each tensor straight into the workers (agentrl/engine/weight_broadcast.py). NCCL needs CUDA:
  it is tested here against a fake copied from vLLM's source, its gloo twin for real.
- Sleep: vLLM's sleep mode (weights offloaded, KV cache freed) exists on CUDA only and must be
  asked for at start (`enable_sleep=True`). Without it `sleep()` pauses generation (running
  requests end with "abort", the prefix cache is dropped, new requests wait for `wake()`) and
  frees nothing: vLLM allocates its KV cache once, at start.
"""

from __future__ import annotations

from collections.abc import Coroutine, Mapping
from typing import Any

from agentrl.engine.base import NamedTensors
from agentrl.engine.vllm_weights import buckets, with_tied_head


class VLLMWeightUpdates:
    """The weight-update and sleep half of `VLLMEngine` (which sets these attributes when it
    starts): every step runs on vLLM's loop through `_call`."""

    llm: Any
    bucket_bytes: int
    _version: int
    _tied: bool
    _sleep_mode: bool
    _asleep: bool
    _transfer: bool | None  # a broadcast update runs: whether it paused generation

    def _call(self, coro: Coroutine[Any, Any, Any]) -> Any:
        raise NotImplementedError

    def update_weights(self, named_tensors: NamedTensors, version: int) -> None:
        """Load the tensors (Hugging Face names, as `state_dict()` gives them) into every worker
        and switch to `version`. Running requests are paused where they are and go on with the
        new weights (partial rollout: see the module docstring).

        The tensors are read and packed in the calling thread (a trainer's gathering iterator
        runs where it was made), one bucket of at most `bucket_bytes` per RPC. After a failure
        the engine may hold a mix of old and new weights: update again.
        """
        items = named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors
        paused = self._hold()
        try:
            self._rpc("agentrl_start_update")
            try:
                for bucket in buckets(with_tied_head(items, self._tied), self.bucket_bytes):
                    self._rpc("agentrl_load_weights", bucket)
            finally:
                # After a failed load too: finishing puts back the layers that were not loaded.
                self._rpc("agentrl_finish_update")
            self._call(self.llm.reset_prefix_cache())  # no cached KV from the old weights
            # Tokens of the steps after the update are labelled with it (_spans, _Labels).
            self._call(self.llm.update_weight_version(str(int(version))))
            self._version = int(version)
        finally:
            self._release(paused)

    pause_mode = "keep"
    """What a weight update does with running requests (vLLM's pause mode): "keep" stops them
    between two steps to go on with the new weights (partial rollout); "wait", the behaviour
    before partial rollout (benchmarks/partial_rollout.py's baseline), lets them finish on the
    old weights first, so the update waits for the longest."""

    def _hold(self) -> bool:
        """Stop sampling for a weight update: running requests stop between two steps, their
        KV cache dropped, to go on with the new weights; new ones wait. Asleep, generation is
        paused already (sleep mode: wake the weights, the KV cache stays freed). Returns
        whether it paused generation (to resume after)."""
        if not self._asleep:
            self._call(self.llm.pause_generation(mode=self.pause_mode, clear_cache=True))
            return True
        if self._sleep_mode:
            self._call(self.llm.wake_up(tags=["weights"]))
        return False

    def _rpc(self, method: str, *args: Any) -> None:
        self._call(self.llm.collective_rpc(method, args=args))

    # A broadcast update, as agentrl.engine.weight_broadcast.WeightBroadcaster drives it: the
    # steps of vLLM's weight-transfer API (vllm/v1/engine/async_llm.py), each in every worker.
    def init_weight_transfer(self, init_info: Mapping[str, Any]) -> None:
        """Join the trainer's weight group (`AsyncLLM.init_weight_transfer_engine`); returns
        once the trainer has opened its end. `init_info`: the fields of vLLM's
        `NCCLWeightTransferInitInfo` (master_address, master_port, rank_offset, world_size,
        packed)."""
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

        self._need_transfer()
        request = WeightTransferInitRequest(init_info=dict(init_info))
        self._call(self.llm.init_weight_transfer_engine(request))

    def start_weight_transfer(self) -> None:
        """Stop sampling (as `update_weights` does), then `AsyncLLM.start_weight_update`."""
        self._need_transfer()
        if self._transfer is not None:
            raise RuntimeError("a weight transfer is running already: finish it first")
        paused = self._hold()
        try:
            self._call(self.llm.start_weight_update())
        except BaseException:
            self._release(paused)
            raise
        self._transfer = paused

    def receive_weights(self, update_info: Mapping[str, Any]) -> None:
        """Receive and load the tensors `update_info` lists (`NCCLWeightTransferUpdateInfo`:
        names, dtype_names, shapes) as the trainer broadcasts them (`AsyncLLM.update_weights`).

        On a failure vLLM's workers drop the update without finishing its layerwise reload;
        this finishes it (the layers not loaded get their weights back) and resumes sampling
        on the weights as they are: update again.
        """
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        if self._transfer is None:
            raise RuntimeError("receive_weights needs start_weight_transfer first")
        request = WeightTransferUpdateRequest(update_info=dict(update_info))
        try:
            self._call(self.llm.update_weights(request))
        except BaseException:
            paused, self._transfer = self._transfer, None
            try:
                self._rpc("agentrl_finish_update")
            finally:
                self._release(paused)
            raise

    def finish_weight_transfer(self, version: int) -> None:
        """`AsyncLLM.finish_weight_update` (vLLM's weight version too, which labels the tokens
        sampled from now on), drop the prefix cache of the old weights, switch to `version` and
        resume sampling."""
        if self._transfer is None:
            raise RuntimeError("finish_weight_transfer needs start_weight_transfer first")
        paused, self._transfer = self._transfer, None
        try:
            self._call(self.llm.finish_weight_update(weight_version=str(version)))
            self._call(self.llm.reset_prefix_cache())
            self._version = int(version)
        finally:
            self._release(paused)

    def cancel_weight_transfer(self) -> None:
        """Give up a started broadcast update (another engine of its group could not start):
        vLLM's `finish_weight_update` with no version ends its layerwise reload with the layers
        as they were, then sampling resumes; the version stays."""
        if self._transfer is None:
            return
        paused, self._transfer = self._transfer, None
        try:
            self._call(self.llm.finish_weight_update())
        finally:
            self._release(paused)

    def _release(self, paused: bool) -> None:
        if paused:
            self._call(self.llm.resume_generation())

    def _need_transfer(self) -> None:
        if self.llm.vllm_config.weight_transfer_config is None:
            raise ValueError(
                "this vLLM engine takes no broadcast weight updates: create it with "
                "weight_transfer='nccl' (GPUs) or 'gloo' (CPUs)"
            )

    def sleep(self) -> None:
        """Abort running requests; new ones wait for `wake()`. With `enable_sleep` (CUDA) the
        weights also move to host memory and the KV cache is freed (vLLM sleep level 1)."""
        if self._asleep:
            return
        if self._sleep_mode:
            self._call(self.llm.sleep(level=1))
        else:
            self._call(self.llm.pause_generation(mode="abort", clear_cache=True))
        self._asleep = True

    def wake(self) -> None:
        if not self._asleep:
            return
        if self._sleep_mode:
            self._call(self.llm.wake_up())
        else:
            self._call(self.llm.resume_generation())
        self._asleep = False
