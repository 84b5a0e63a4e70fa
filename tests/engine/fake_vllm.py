"""A fake of vLLM 0.32 on a CUDA machine, for what the CPU build cannot run: sleep mode.

Everything else of the vLLM backend is tested against the real vLLM CPU build
(tests/engine/test_vllm_real.py). This fake copies the behaviour of vLLM 0.32.0's source, not
its docs:

- `AsyncLLM.sleep(level=1, mode="abort")` pauses the scheduler (aborting running requests),
  then offloads the weights and frees the KV cache (sleeping tags "weights", "kv_cache");
  `wake_up(tags)` wakes the given tags (all if None) and resumes scheduling only once nothing
  sleeps (vllm/v1/engine/core.py `EngineCore.sleep` / `wake_up`). Requests added while paused
  wait; `pause_generation(mode="wait")` lets running requests finish first.
- `collective_rpc` arguments reach the worker through msgpack: tuples become lists and an
  untyped tensor becomes `[dtype, shape, buffer index]` (vllm/v1/serial_utils.py).
- `SamplingParams` refuses n > 1 with greedy sampling; `get_tokenizer()` is synchronous.

The "model" is one integer weight w: after token t it emits (t + w) % VOCAB with logprob
-0.5 * w, so tests can see weight updates.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import importlib
import sys
import types
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

VOCAB = 100
MAX_LEN = 64


class RequestOutputKind(enum.Enum):
    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


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
class CompletionOutput:
    index: int
    token_ids: list[int]
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


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
            if name == "w":
                self.w = int(t.item())
        return {name for name, _ in weights}


class _Worker:
    device = torch.device("cpu")
    vllm_config = types.SimpleNamespace(model_config=_ModelConfig())

    def __init__(self, model: _Model) -> None:
        self.model_runner = types.SimpleNamespace(
            get_model=lambda: model, reset_lora_state=lambda: None
        )


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
        self.model = _Model(self)
        ext = args.kwargs.get("worker_extension_cls")
        bases: tuple[type, ...] = (_Worker,)
        if ext:
            module, _, name = ext.rpartition(".")
            bases = (getattr(importlib.import_module(module), name), _Worker)
        self.worker = type("Worker", bases, {})(self.model)
        self.sleeping_tags: set[str] = set()
        self.unpaused = asyncio.Event()
        self.unpaused.set()
        self.running: dict[str, bool] = {}  # request id -> aborted
        self.calls: list[str] = []
        AsyncLLM.instances.append(self)

    @classmethod
    def from_engine_args(cls, args: AsyncEngineArgs) -> AsyncLLM:
        return cls(args)

    async def generate(self, prompt: dict, sampling_params: SamplingParams, request_id: str):
        assert asyncio.get_running_loop() is self.loop, "AsyncLLM used from another event loop"
        await self.unpaused.wait()
        sp = sampling_params
        self.running[request_id] = False
        out = CompletionOutput(0, [], [] if sp.logprobs is not None else None)
        last, sent = prompt["prompt_token_ids"][-1], 0
        try:
            for _ in range(sp.max_tokens):
                await asyncio.sleep(0.001)
                if self.running[request_id]:
                    out.finish_reason = "abort"
                    break
                last = (last + self.model.w) % VOCAB
                out.token_ids.append(last)
                if out.logprobs is not None:
                    out.logprobs.append({last: Logprob(-0.5 * self.model.w, 1)})
                if sp.output_kind is RequestOutputKind.DELTA:
                    yield RequestOutput(request_id, [_since(out, sent)], False)
                    sent = len(out.token_ids)
            else:
                out.finish_reason = "length"
            yield RequestOutput(request_id, [_since(out, sent)], True)
        finally:
            del self.running[request_id]

    async def abort(self, request_id: str) -> None:
        if request_id in self.running:
            self.running[request_id] = True

    async def pause_generation(self, *, mode: str = "abort", clear_cache: bool = True) -> None:
        self.calls.append(f"pause:{mode}")
        self.unpaused.clear()
        if mode == "abort":
            for rid in self.running:
                self.running[rid] = True
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
        return [getattr(self.worker, method)(*_msgpack(args), **_msgpack(kwargs or {}))]

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
    )


def _initialize_layerwise_reload(model: _Model) -> None:
    model.reloading = True


def _finalize_layerwise_reload(model: _Model, model_config: Any) -> None:
    model.reloading = False


def install(monkeypatch) -> None:
    """Put the fake under the module names agentrl.engine.vllm imports."""
    platform = types.SimpleNamespace(
        device_type="cuda", is_cpu=lambda: False, is_sleep_mode_available=lambda: True
    )
    mods = {
        "vllm": {"SamplingParams": SamplingParams, "TokensPrompt": TokensPrompt},
        "vllm.sampling_params": {
            "RequestOutputKind": RequestOutputKind,
            "SamplingParams": SamplingParams,
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
    }
    for name, attrs in mods.items():
        mod = types.ModuleType(name)
        mod.__dict__.update(attrs)
        monkeypatch.setitem(sys.modules, name, mod)
