"""A fake of the parts of vLLM's documented V1 API that agentrl's vLLM backend uses.

It follows the documented behaviour (docs.vllm.ai: AsyncLLM, SamplingParams, TokensPrompt,
RequestOutput/CompletionOutput/Logprob, collective_rpc, sleep/wake_up, abort), not vLLM's code:
`generate` is an async generator of RequestOutputs that must run on the loop that created the
engine, FINAL_ONLY yields one output, DELTA outputs hold only the tokens (and logprobs) new since
the previous output of the request, aborted requests finish with "abort", generation while
asleep is an error, and collective_rpc calls a method of the worker extension class on the worker.

The "model" is one integer weight w: after token t it emits (t + w) % vocab with logprob
-0.25 * w (raw) or -0.5 * w (processed), so tests can see weight updates and logprob modes.
"""

from __future__ import annotations

import asyncio
import enum
import importlib
import sys
import types
from dataclasses import dataclass
from typing import Any, ClassVar

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
    top_k: int = -1
    max_tokens: int | None = 16
    stop: list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    logprobs: int | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE

    def __post_init__(self) -> None:
        if self.n < 1:
            raise ValueError("n must be at least 1")
        if not 0 < self.top_p <= 1:
            raise ValueError("top_p must be in (0, 1]")


def TokensPrompt(**kwargs: Any) -> dict:
    return dict(kwargs)


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool


class AsyncEngineArgs:
    def __init__(self, model: str, **kwargs: Any) -> None:
        self.model = model
        self.kwargs = kwargs


class _ModelConfig:
    max_model_len = MAX_LEN

    def get_vocab_size(self) -> int:
        return VOCAB


class _FakeModel:
    def __init__(self) -> None:
        self.w = 1

    def load_weights(self, weights):
        for name, t in weights:
            if name == "w":
                self.w = int(t.item())


class _Worker:
    device = "cpu"

    def __init__(self) -> None:
        self.model_runner = types.SimpleNamespace(model=_FakeModel())


class AsyncLLM:
    instances: ClassVar[list[AsyncLLM]] = []

    def __init__(self, args: AsyncEngineArgs) -> None:
        self.args = args
        self.loop = asyncio.get_running_loop()  # vLLM's output handler is bound to this loop
        self.model_config = _ModelConfig()
        mode = args.kwargs.get("logprobs_mode", "raw_logprobs")
        self.scale = -0.25 if mode == "raw_logprobs" else -0.5
        ext = args.kwargs.get("worker_extension_cls")
        bases = (_Worker,)
        if ext:
            module, _, name = ext.rpartition(".")
            bases = (getattr(importlib.import_module(module), name), _Worker)
        self.worker = type("Worker", bases, {})()
        self.sleeping = False
        self.aborted: set[str] = set()
        self.rpc_calls: list[str] = []
        self.prefix_resets = 0
        self.shut_down = False
        AsyncLLM.instances.append(self)

    @classmethod
    def from_engine_args(cls, args: AsyncEngineArgs) -> AsyncLLM:
        return cls(args)

    async def generate(self, prompt: dict, sampling_params: SamplingParams, request_id: str):
        assert asyncio.get_running_loop() is self.loop, "AsyncLLM used from another event loop"
        if self.sleeping:
            raise RuntimeError("engine is sleeping")
        sp = sampling_params
        ids = list(prompt["prompt_token_ids"])
        outs = [
            CompletionOutput(
                index=j,
                text="",
                token_ids=[],
                cumulative_logprob=None,
                logprobs=[] if sp.logprobs is not None else None,
            )
            for j in range(sp.n)
        ]
        last = ids[-1]
        sent = 0  # tokens already handed out (DELTA)
        for _ in range(sp.max_tokens):
            await asyncio.sleep(0)
            if request_id in self.aborted:
                for o in outs:
                    o.finish_reason = "abort"
                break
            tok = (last + self.worker.model_runner.model.w) % VOCAB
            for o in outs:
                o.token_ids.append(tok)
                if o.logprobs is not None:
                    o.logprobs.append(
                        {tok: Logprob(self.scale * self.worker.model_runner.model.w, 1)}
                    )
            last = tok
            if sp.stop_token_ids and tok in sp.stop_token_ids:
                for o in outs:
                    o.finish_reason, o.stop_reason = "stop", tok
                break
            if sp.output_kind is not RequestOutputKind.FINAL_ONLY:
                yield RequestOutput(request_id, ids, _view(outs, sp, sent), False)
                sent = len(outs[0].token_ids)
        else:
            for o in outs:
                o.finish_reason = "length"
        yield RequestOutput(request_id, ids, _view(outs, sp, sent), True)

    async def abort(self, request_id: str) -> None:
        self.aborted.add(request_id)

    async def sleep(self, level: int = 1) -> None:
        self.sleeping = True

    async def wake_up(self, tags: list[str] | None = None) -> None:
        self.sleeping = False

    async def reset_prefix_cache(self) -> bool:
        self.prefix_resets += 1
        return True

    async def collective_rpc(
        self,
        method: str,
        timeout: float | None = None,
        args: tuple = (),
        kwargs: dict | None = None,
    ) -> list:
        self.rpc_calls.append(method)
        return [getattr(self.worker, method)(*args, **(kwargs or {}))]

    async def get_tokenizer(self):
        return "fake-tokenizer"

    def shutdown(self) -> None:
        self.shut_down = True


def _view(outs: list[CompletionOutput], sp: SamplingParams, sent: int) -> list[CompletionOutput]:
    """What an output holds: everything so far, or with DELTA only what is new since `sent`."""
    if sp.output_kind is not RequestOutputKind.DELTA:
        return outs
    return [
        CompletionOutput(
            index=o.index,
            text="",
            token_ids=o.token_ids[sent:],
            cumulative_logprob=None,
            logprobs=o.logprobs[sent:] if o.logprobs is not None else None,
            finish_reason=o.finish_reason,
            stop_reason=o.stop_reason,
        )
        for o in outs
    ]


def install(monkeypatch) -> None:
    """Put the fake under the module names agentrl.engine.vllm imports."""
    mods = {
        "vllm": {"SamplingParams": SamplingParams, "TokensPrompt": TokensPrompt},
        "vllm.sampling_params": {
            "RequestOutputKind": RequestOutputKind,
            "SamplingParams": SamplingParams,
        },
        "vllm.inputs": {"TokensPrompt": TokensPrompt},
        "vllm.engine": {},
        "vllm.engine.arg_utils": {"AsyncEngineArgs": AsyncEngineArgs},
        "vllm.v1": {},
        "vllm.v1.engine": {},
        "vllm.v1.engine.async_llm": {"AsyncLLM": AsyncLLM},
    }
    for name, attrs in mods.items():
        mod = types.ModuleType(name)
        mod.__dict__.update(attrs)
        monkeypatch.setitem(sys.modules, name, mod)
