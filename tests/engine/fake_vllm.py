"""A fake of vLLM 0.32 on a CUDA machine, for what the CPU build cannot run: sleep mode and
the NCCL weight transfer.

Everything else of the vLLM backend is tested against the real vLLM CPU build
(tests/engine/test_vllm_real.py). This fake copies the behaviour of vLLM 0.32.0's source, not
its docs:

- `AsyncLLM.sleep(level=1, mode="abort")` pauses the scheduler (aborting running requests),
  then offloads the weights and frees the KV cache (sleeping tags "weights", "kv_cache");
  `wake_up(tags)` wakes the given tags (all if None) and resumes scheduling only once nothing
  sleeps (vllm/v1/engine/core.py `EngineCore.sleep` / `wake_up`). Requests added while paused
  wait; `pause_generation(mode="wait")` lets running requests finish first, `mode="keep"`
  freezes them between two steps until `resume_generation()`.
- Weight versions (vllm/v1/engine/core.py `_attach_weight_version`, output_processor.py
  `RequestState.track_weight_version`): each step's tokens are labelled with the engine's
  `weight_version` ("default" until `update_weight_version` or `finish_weight_update` sets
  it); the request's state in `output_processor.request_states` (keyed by internal id, listed
  under the request id in `output_processor.external_req_ids`) keeps `weight_version_starts`,
  (label, index of the first token it sampled), and a finished `CompletionOutput` carries
  `weight_versions`, the spans `WeightVersionSpan(version, start, end)`.
- `collective_rpc` arguments reach the worker through msgpack: tuples become lists and an
  untyped tensor becomes `[dtype, shape, buffer index]` (vllm/v1/serial_utils.py).
- `SamplingParams` refuses n > 1 with greedy sampling; `get_tokenizer()` is synchronous.
- Weight transfer (`weight_transfer_config={"backend": "nccl"}`): `AsyncLLM.
  init_weight_transfer_engine` / `start_weight_update` / `update_weights` /
  `finish_weight_update(weight_version)` run the worker methods of the same names in every
  worker through `collective_rpc` (vllm/v1/engine/async_llm.py); the worker refuses an update
  out of order and drops it on a failure without finishing the layerwise reload
  (vllm/v1/worker/gpu_worker.py). The worker's `NCCLWeightTransferEngine`
  (vllm/distributed/weight_transfer/nccl_engine.py, nccl_common.py) parses the init info as
  the kw-only `NCCLWeightTransferInitInfo` (unknown or missing keys fail), joins the group at
  rank `rank_offset + dp_rank * world_size + rank`, and per update receives one broadcast per
  name of `NCCLWeightTransferUpdateInfo` (lists of one length), loading each as it arrives.
  The trainer's `nccl_common.trainer_init` opens rank 0 and, like NCCL's init, returns once
  every rank has joined; its `PyNcclCommunicator.broadcast` wants a contiguous tensor on its
  device, sent from rank 0.
- Tensor parallel: `tensor_parallel_size` workers, each with its own copy of the model;
  sampling fails if they disagree (an update that missed a shard).

The "model" is one integer weight w: after token t it emits (t + w) % VOCAB with logprob
-0.5 * w, so tests can see weight updates. It has no other weight (loading one fails).
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import importlib
import os
import queue
import sys
import threading
import time
import types
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

VOCAB = 100
MAX_LEN = 64


class RequestOutputKind(enum.Enum):
    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


@dataclass
class StructuredOutputsParams:
    """vllm/sampling_params.py: one constraint kind of json, regex, choice, grammar, ..."""

    grammar: str | None = None
    json: str | dict | None = None


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int | None = 16
    stop: list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    logprobs: int | None = None
    logit_bias: dict[int, float] | None = None
    structured_outputs: StructuredOutputsParams | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE

    def __post_init__(self) -> None:
        if self.temperature == 0 and self.n > 1:
            raise ValueError(f"n must be 1 when using greedy sampling, got {self.n}.")


def TokensPrompt(**kwargs: Any) -> dict:
    return dict(kwargs)


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None


@dataclass
class WeightVersionSpan:
    version: str
    start: int
    end: int


@dataclass
class CompletionOutput:
    index: int
    token_ids: list[int]
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    weight_versions: list[WeightVersionSpan] | None = None


@dataclass
class _RequestState:
    request_index: int
    weight_version_starts: list[tuple[str, int]] = field(default_factory=list)


@dataclass
class RequestOutput:
    request_id: str
    outputs: list[CompletionOutput]
    finished: bool


class AsyncEngineArgs:
    def __init__(self, model: str, **kwargs: Any) -> None:
        self.model = model
        self.kwargs = kwargs


class _ModelConfig:
    max_model_len = MAX_LEN
    hf_text_config = types.SimpleNamespace(tie_word_embeddings=False)

    def get_vocab_size(self) -> int:
        return VOCAB


class _Model:
    def __init__(self, llm: AsyncLLM) -> None:
        self.llm = llm
        self.w = 1
        self.reloading = False

    def load_weights(self, weights):
        assert self.reloading, "load_weights outside initialize/finalize_layerwise_reload"
        if "weights" in self.llm.sleeping_tags:
            raise RuntimeError("weights are offloaded (asleep): wake_up(tags=['weights']) first")
        for name, t in weights:
            if name != "w":
                raise KeyError(name)  # as vLLM's Llama load_weights does for a name it lacks
            self.w = int(t.item())
        return {name for name, _ in weights}


class _Worker:
    device = torch.device("cpu")

    def __init__(self, model: _Model, rank: int, world_size: int, transfer: Any) -> None:
        self.model = model
        self.rank = rank
        self.model_runner = types.SimpleNamespace(
            get_model=lambda: model, reset_lora_state=lambda: None
        )
        self.vllm_config = types.SimpleNamespace(
            model_config=_ModelConfig(),
            parallel_config=types.SimpleNamespace(
                rank=rank, world_size=world_size, data_parallel_index=0
            ),
            weight_transfer_config=transfer,
        )
        # Worker.load_model: an engine from the factory when weight_transfer_config is set.
        self.weight_transfer_engine = _NCCLEngine(self) if transfer is not None else None
        self._weight_update_active = False

    # vllm/v1/worker/gpu_worker.py, the weight-transfer methods
    def _check_weight_transfer_engine(self) -> None:
        if self.weight_transfer_engine is None:
            raise RuntimeError(
                "Weight transfer not configured. "
                "Please set weight_transfer_config to enable weight transfer."
            )

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        self._check_weight_transfer_engine()
        engine = self.weight_transfer_engine
        engine.init_transfer_engine(engine.parse_init_info(init_info))

    def start_weight_update(self) -> None:
        self._check_weight_transfer_engine()
        if self._weight_update_active:
            raise RuntimeError(
                "start_weight_update called while a weight update is already "
                "active. Call finish_weight_update first."
            )
        self.weight_transfer_engine.start_weight_update()
        self._weight_update_active = True

    def update_weights(self, update_info: dict) -> None:
        self._check_weight_transfer_engine()
        if not self._weight_update_active:
            raise RuntimeError("start_weight_update must be called before update_weights.")
        try:
            self.weight_transfer_engine.update_weights(update_info)
        except BaseException:
            self._weight_update_active = False
            raise

    def finish_weight_update(self) -> None:
        self._check_weight_transfer_engine()
        if not self._weight_update_active:
            raise RuntimeError(
                "finish_weight_update called without a matching start_weight_update."
            )
        self.weight_transfer_engine.finish_weight_update()
        self._weight_update_active = False
        self.model_runner.reset_lora_state()


# ------------------------------------------------------------------ the NCCL weight transfer
_INIT_FIELDS = {"master_address", "master_port", "rank_offset", "world_size",
                "nccl_unique_id_b64", "packed", "packed_buffer_size_bytes", "packed_num_buffers"}
WAIT = 10.0  # seconds a rank waits for its peers, as NCCL would (forever)


class _Group:
    """One NCCL group: rank 0 (the trainer) broadcasts, every other rank receives in order."""

    groups: ClassVar[dict[tuple[str, int], _Group]] = {}

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.inboxes: dict[int, queue.Queue] = {}
        self.joined = threading.Condition()
        self.sent: list[tuple[str, tuple[int, ...]]] = []  # dtype, shape of each broadcast

    def join(self, rank: int) -> queue.Queue:
        if not 0 < rank < self.world_size:
            raise RuntimeError(f"NCCL rank {rank} outside [1, {self.world_size})")
        with self.joined:
            if rank in self.inboxes:
                raise RuntimeError(f"NCCL rank {rank} joined twice")
            self.inboxes[rank] = queue.Queue()
            self.joined.notify_all()
            return self.inboxes[rank]

    def wait_for_all(self) -> None:
        with self.joined:
            if not self.joined.wait_for(lambda: len(self.inboxes) == self.world_size - 1, WAIT):
                raise TimeoutError(f"NCCL init: {len(self.inboxes) + 1} of {self.world_size} "
                                   f"ranks joined")


class PyNcclCommunicator:
    """The trainer's rank 0 (vllm/distributed/device_communicators/pynccl.py)."""

    def __init__(self, group: _Group) -> None:
        self.group, self.rank, self.device = group, 0, torch.device("cpu")
        self.destroyed = False

    def broadcast(self, tensor: torch.Tensor, src: int, stream=None) -> None:
        assert not self.destroyed and src == self.rank == 0
        assert tensor.device == self.device, "pynccl: tensor on another device"
        assert tensor.is_contiguous(), "pynccl sends numel elements from data_ptr()"
        self.group.sent.append((str(tensor.dtype), tuple(tensor.shape)))
        for inbox in self.group.inboxes.values():
            inbox.put(tensor.clone())

    def destroy(self) -> None:
        self.destroyed = True


def _trainer_init(init_info: dict, rank: int = 0) -> PyNcclCommunicator:
    """nccl_common.trainer_init: the trainer hosts the rendezvous and joins as rank 0."""
    assert rank == 0
    group = _Group(init_info["world_size"])
    _Group.groups[(init_info["master_address"], init_info["master_port"])] = group
    group.wait_for_all()
    return PyNcclCommunicator(group)


@dataclass
class NCCLWeightTransferInitInfo:
    master_address: str | None = None
    master_port: int | None = None
    rank_offset: int = field(kw_only=True)
    world_size: int = field(kw_only=True)
    nccl_unique_id_b64: str | None = None
    packed: bool = False
    packed_buffer_size_bytes: int = 1 << 30
    packed_num_buffers: int = 2


@dataclass
class NCCLWeightTransferUpdateInfo:
    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]

    def __post_init__(self) -> None:
        if not len(self.names) == len(self.dtype_names) == len(self.shapes):
            raise ValueError("`dtype_names` and `shapes` should be of the same size as `names`")


class _NCCLEngine:
    """A worker's NCCLWeightTransferEngine (unpacked: what the trainer asks for)."""

    def __init__(self, worker: _Worker) -> None:
        self.worker = worker
        self.model = worker.model
        self.inbox: queue.Queue | None = None
        self.init_info: NCCLWeightTransferInitInfo | None = None
        self.rank: int | None = None
        self.received: list[str] = []  # names, in the order they arrived

    def parse_init_info(self, init_dict: dict) -> NCCLWeightTransferInitInfo:
        try:
            return NCCLWeightTransferInitInfo(**init_dict)
        except TypeError as e:
            raise ValueError(f"Invalid init_info for NCCLWeightTransferEngine: {e}") from e

    def init_transfer_engine(self, init_info: NCCLWeightTransferInitInfo) -> None:
        pc = self.worker.vllm_config.parallel_config
        rank = pc.data_parallel_index * pc.world_size + pc.rank + init_info.rank_offset
        key = (init_info.master_address, init_info.master_port)
        deadline = time.monotonic() + WAIT
        while key not in _Group.groups:  # the StatelessProcessGroup client retries
            if time.monotonic() > deadline:
                raise TimeoutError(f"no trainer at {key}")
            time.sleep(0.005)
        group = _Group.groups[key]
        assert group.world_size == init_info.world_size
        self.inbox, self.init_info, self.rank = group.join(rank), init_info, rank

    def start_weight_update(self) -> None:
        _initialize_layerwise_reload(self.model)

    def finish_weight_update(self) -> None:
        _finalize_layerwise_reload(self.model, None)

    def update_weights(self, update_info: dict) -> None:
        try:
            info = NCCLWeightTransferUpdateInfo(**update_info)
        except TypeError as e:
            raise ValueError(f"Invalid update_info for NCCLWeightTransferEngine: {e}") from e
        if self.inbox is None:
            raise RuntimeError("NCCL weight transfer not initialized. "
                               "Call init_transfer_engine() first.")
        assert not self.init_info.packed, "the fake receives unpacked only"
        for name, dtype_name, shape in zip(info.names, info.dtype_names, info.shapes):
            weight = self.inbox.get(timeout=WAIT)
            assert weight.dtype == getattr(torch, dtype_name) and list(weight.shape) == shape, (
                f"{name}: broadcast {weight.dtype} {list(weight.shape)}, expected {dtype_name} "
                f"{shape}"
            )
            self.received.append(name)
            self.model.load_weights([(name, weight)])


@dataclass
class WeightTransferInitRequest:
    init_info: dict = field(default_factory=dict)


@dataclass
class WeightTransferUpdateRequest:
    update_info: dict = field(default_factory=dict)


def _msgpack(obj: Any) -> Any:
    """What an untyped collective_rpc argument looks like after vLLM's msgpack round trip."""
    if isinstance(obj, torch.Tensor):
        return [str(obj.dtype).removeprefix("torch."), list(obj.shape), 1]
    if isinstance(obj, list | tuple):
        return [_msgpack(x) for x in obj]
    if isinstance(obj, dict):
        return {k: _msgpack(v) for k, v in obj.items()}
    return obj


class AsyncLLM:
    instances: ClassVar[list[AsyncLLM]] = []

    def __init__(self, args: AsyncEngineArgs) -> None:
        self.args = args
        self.loop = asyncio.get_running_loop()  # vLLM's output handler is bound to this loop
        self.model_config = _ModelConfig()
        ext = args.kwargs.get("worker_extension_cls")
        bases: tuple[type, ...] = (_Worker,)
        if ext:
            module, _, name = ext.rpartition(".")
            bases = (getattr(importlib.import_module(module), name), _Worker)
        transfer = args.kwargs.get("weight_transfer_config")
        if transfer is not None:
            transfer = types.SimpleNamespace(**transfer)  # AsyncEngineArgs takes a dict
            assert transfer.backend == "nccl", f"backend {transfer.backend!r} is not registered"
        self.vllm_config = types.SimpleNamespace(weight_transfer_config=transfer)
        tp = args.kwargs.get("tensor_parallel_size", 1)
        worker_cls = type("Worker", bases, {})
        self.workers = [worker_cls(_Model(self), r, tp, transfer) for r in range(tp)]
        self.weight_version = "default"
        self.sleeping_tags: set[str] = set()
        self.unpaused = asyncio.Event()
        self.unpaused.set()
        self.running: dict[str, bool] = {}  # request id -> aborted
        self.output_processor = types.SimpleNamespace(external_req_ids={}, request_states={})
        self.calls: list[str] = []
        self.prompts: list[dict] = []  # every prompt generate() got (a TokensPrompt dict)
        # What vLLM's engine-core process, spawned now, would inherit.
        self.cuda_visible_devices = os.environ.get("CUDA_VISIBLE_DEVICES")
        AsyncLLM.instances.append(self)

    @classmethod
    def from_engine_args(cls, args: AsyncEngineArgs) -> AsyncLLM:
        return cls(args)

    @property
    def model(self) -> _Model:
        """The model every tensor-parallel shard computes together."""
        ws = {w.model.w for w in self.workers}
        assert len(ws) == 1, f"tensor-parallel shards hold different weights: {ws}"
        assert not any(w.model.reloading for w in self.workers), (
            "sampling mid-reload: the layers are on the meta device"
        )
        return self.workers[0].model

    async def generate(self, prompt: dict, sampling_params: SamplingParams, request_id: str):
        assert asyncio.get_running_loop() is self.loop, "AsyncLLM used from another event loop"
        await self.unpaused.wait()
        sp = sampling_params
        self.prompts.append(prompt)
        self.running[request_id] = False
        out = CompletionOutput(0, [], [] if sp.logprobs is not None else None)
        state = _RequestState(request_index=0)
        processor = self.output_processor
        processor.external_req_ids[request_id] = [request_id]
        processor.request_states[request_id] = state
        last, sent = prompt["prompt_token_ids"][-1], 0
        try:
            for _ in range(sp.max_tokens):
                await asyncio.sleep(0.001)
                # mode="keep" freezes running requests here (an abort still ends them).
                while not self.unpaused.is_set() and not self.running[request_id]:
                    await asyncio.sleep(0.001)
                if self.running[request_id]:
                    out.finish_reason = "abort"
                    break
                last = (last + self.model.w) % VOCAB
                starts = state.weight_version_starts
                if not starts or starts[-1][0] != self.weight_version:
                    starts.append((self.weight_version, len(out.token_ids)))
                out.token_ids.append(last)
                if out.logprobs is not None:
                    out.logprobs.append({last: Logprob(-0.5 * self.model.w, 1)})
                if sp.output_kind is RequestOutputKind.DELTA:
                    yield RequestOutput(request_id, [_since(out, sent)], False)
                    sent = len(out.token_ids)
            else:
                out.finish_reason = "length"
            del processor.request_states[request_id], processor.external_req_ids[request_id]
            ends = [start for _, start in state.weight_version_starts[1:]] + [len(out.token_ids)]
            out.weight_versions = [
                WeightVersionSpan(v, start, end)
                for (v, start), end in zip(state.weight_version_starts, ends, strict=True)
            ]
            yield RequestOutput(request_id, [_since(out, sent)], True)
        finally:
            del self.running[request_id]
            processor.request_states.pop(request_id, None)
            processor.external_req_ids.pop(request_id, None)

    async def abort(self, request_id: str) -> None:
        if request_id in self.running:
            self.running[request_id] = True

    async def pause_generation(self, *, mode: str = "abort", clear_cache: bool = True) -> None:
        self.calls.append(f"pause:{mode}")
        self.unpaused.clear()
        if mode == "abort":
            for rid in self.running:
                self.running[rid] = True
        if mode == "keep":
            return
        while self.running:
            await asyncio.sleep(0.001)

    async def resume_generation(self) -> None:
        self.calls.append("resume")
        self.unpaused.set()

    async def sleep(self, level: int = 1, mode: str = "abort") -> None:
        if not self.args.kwargs.get("enable_sleep_mode"):
            raise RuntimeError("sleep mode was not enabled")
        self.calls.append(f"sleep:{level}")
        await self.pause_generation(mode=mode)
        self.sleeping_tags = {"weights", "kv_cache"}

    async def wake_up(self, tags: list[str] | None = None) -> bool:
        self.calls.append(f"wake_up:{','.join(tags) if tags else 'all'}")
        self.sleeping_tags -= set(tags) if tags else set(self.sleeping_tags)
        if not self.sleeping_tags:
            self.unpaused.set()
        return not self.sleeping_tags

    async def reset_prefix_cache(self) -> bool:
        return True

    async def collective_rpc(self, method: str, timeout=None, args: tuple = (), kwargs=None):
        self.calls.append(method)
        args, kwargs = _msgpack(args), _msgpack(kwargs or {})
        return [getattr(w, method)(*args, **kwargs) for w in self.workers]

    # vllm/v1/engine/async_llm.py, the weight-transfer API
    async def init_weight_transfer_engine(self, request: WeightTransferInitRequest) -> None:
        await self.collective_rpc(
            "init_weight_transfer_engine", kwargs={"init_info": request.init_info}
        )

    async def start_weight_update(self) -> None:
        await self.collective_rpc("start_weight_update")

    async def update_weights(self, request: WeightTransferUpdateRequest) -> None:
        await self.collective_rpc("update_weights", kwargs={"update_info": request.update_info})

    async def finish_weight_update(self, weight_version: str | None = None) -> None:
        await self.collective_rpc("finish_weight_update")
        if weight_version is not None:
            await self.update_weight_version(weight_version)

    async def update_weight_version(self, new_version: str) -> None:
        self.calls.append(f"weight_version:{new_version}")
        self.weight_version = new_version

    def get_tokenizer(self) -> str:
        return "fake-tokenizer"

    def shutdown(self) -> None:
        pass


def _since(out: CompletionOutput, sent: int) -> CompletionOutput:
    return CompletionOutput(
        out.index,
        out.token_ids[sent:],
        out.logprobs[sent:] if out.logprobs is not None else None,
        out.finish_reason,
        weight_versions=out.weight_versions,
    )


def _initialize_layerwise_reload(model: _Model) -> None:
    model.reloading = True


def _finalize_layerwise_reload(model: _Model, model_config: Any) -> None:
    model.reloading = False


def install(monkeypatch) -> None:
    """Put the fake under the module names agentrl.engine.vllm_engine imports."""
    platform = types.SimpleNamespace(
        device_type="cuda", is_cpu=lambda: False, is_sleep_mode_available=lambda: True
    )
    mods = {
        "vllm": {"SamplingParams": SamplingParams, "TokensPrompt": TokensPrompt},
        "vllm.sampling_params": {
            "RequestOutputKind": RequestOutputKind,
            "SamplingParams": SamplingParams,
            "StructuredOutputsParams": StructuredOutputsParams,
        },
        "vllm.inputs": {"TokensPrompt": TokensPrompt},
        "vllm.platforms": {"current_platform": platform},
        "vllm.config": {"set_current_vllm_config": lambda config: contextlib.nullcontext()},
        "vllm.engine": {},
        "vllm.engine.arg_utils": {"AsyncEngineArgs": AsyncEngineArgs},
        "vllm.model_executor": {},
        "vllm.model_executor.model_loader": {},
        "vllm.model_executor.model_loader.mtp_validation": {
            "disable_mtp_completeness_check": contextlib.nullcontext
        },
        "vllm.model_executor.model_loader.reload": {
            "initialize_layerwise_reload": _initialize_layerwise_reload,
            "finalize_layerwise_reload": _finalize_layerwise_reload,
        },
        "vllm.v1": {},
        "vllm.v1.engine": {},
        "vllm.v1.engine.async_llm": {"AsyncLLM": AsyncLLM},
        "vllm.distributed": {},
        "vllm.distributed.weight_transfer": {},
        "vllm.distributed.weight_transfer.base": {
            "WeightTransferInitRequest": WeightTransferInitRequest,
            "WeightTransferUpdateRequest": WeightTransferUpdateRequest,
        },
        "vllm.distributed.weight_transfer.nccl_common": {"trainer_init": _trainer_init},
    }
    monkeypatch.setattr(_Group, "groups", {})
    for name, attrs in mods.items():
        mod = types.ModuleType(name)
        mod.__dict__.update(attrs)
        monkeypatch.setitem(sys.modules, name, mod)
