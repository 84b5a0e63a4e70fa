"""The engine router (#16 item 1): least outstanding work, conversations stick to one engine,
every engine gets the same weights, devices planned with the arithmetic shown."""

from __future__ import annotations

import asyncio

import pytest

from agentrl.completion import Completion, SamplingParams
from agentrl.engine.affinity import conversation
from agentrl.engine.router import EngineRouter, engine_devices


class Held:
    """An engine whose calls wait for `release`; it records what it was asked."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, int]] = []
        self.release = asyncio.Event()
        self.version, self.max_context = 0, 1000
        self.weights: list = []

    async def generate(self, prompt_ids, params, images=None):
        self.calls.append((len(prompt_ids), params.max_tokens))
        await self.release.wait()
        return [Completion(token_ids=[7] * params.max_tokens,
                           logprobs=[-1.0] * params.max_tokens, finish_reason="length")]

    def update_weights(self, named, version):
        self.weights.append((list(named), version))
        self.version = version


async def test_calls_go_to_the_least_outstanding_work():
    engines = [Held(), Held(), Held()]
    router = EngineRouter(engines)
    big, small = SamplingParams(max_tokens=100), SamplingParams(max_tokens=10)
    tasks = [asyncio.ensure_future(router.generate([1] * 10, big))]  # engine 0: 110 tokens
    await asyncio.sleep(0)
    tasks += [asyncio.ensure_future(router.generate([1] * 10, small)) for _ in range(3)]
    await asyncio.sleep(0)
    # Engines 1 and 2 take a small call each; the third small call goes to the lighter of
    # them (20 < 110), not to the engine with the big one.
    assert [len(e.calls) for e in engines] == [1, 2, 1]
    assert router.outstanding == [110, 40, 20]
    for e in engines:
        e.release.set()
    done = await asyncio.gather(*tasks)
    assert [len(c[0].token_ids) for c in done] == [100, 10, 10, 10]
    assert router.outstanding == [0, 0, 0]


async def test_a_conversation_stays_on_one_engine_and_conversations_spread():
    engines = [Held() for _ in range(4)]
    for e in engines:
        e.release.set()
    router = EngineRouter(engines)

    async def episode(key: str) -> None:
        with conversation(key):
            for turn in range(3):
                await router.generate([1] * (10 + 5 * turn), SamplingParams(max_tokens=4))

    await asyncio.gather(*(episode(f"ep{i}") for i in range(8)))
    assert [len(e.calls) for e in engines] == [6, 6, 6, 6]  # 2 episodes x 3 turns each
    for e in engines:  # each engine saw whole episodes: prompts growing turn by turn
        lengths = sorted(n for n, _ in e.calls)
        assert lengths == [10, 10, 15, 15, 20, 20]
    assert router.stats()["conversations"] == 8


async def test_weights_go_to_every_engine_with_one_version_and_streams_fall_back():
    engines = [Held(), Held()]
    router = EngineRouter(engines)
    router.update_weights(iter([("w", 1), ("b", 2)]), version=3)  # an iterator, read once
    assert all(e.weights == [([("w", 1), ("b", 2)], 3)] for e in engines)
    assert router.version == 3
    engines[1].version = 2
    assert router.version == 2  # the oldest engine's
    for e in engines:
        e.release.set()
    deltas = [d async for d in router.generate_stream([1, 2], SamplingParams(max_tokens=3))]
    assert [(d.index, d.token_ids, d.finish_reason) for d in deltas] == [(0, [7, 7, 7],
                                                                          "length")]


def test_engine_devices_and_the_arithmetic_of_too_many():
    def devices(*args, **kwargs):
        return [(p.device, p.cuda_visible_devices) for p in engine_devices(*args, **kwargs)]

    assert devices(3, "auto", gpus=0) == [("cpu", None)] * 3
    assert devices(2, "cuda", gpus=4) == [("cuda:0", None), ("cuda:1", None)]
    assert devices(1, "cuda:2", gpus=4) == [("cuda:2", None)]
    with pytest.raises(ValueError, match=r"--num_engines 3 x --tensor_parallel_size 2 = 6 GPUs, "
                                         r"but 4 are visible; use at most 2 engines"):
        engine_devices(3, "cuda", gpus=4, tensor_parallel_size=2, engine="vllm")
    # vLLM engines start their processes on GPUs of their own, named as this process sees them
    assert devices(2, "auto", gpus=4, engine="vllm", tensor_parallel_size=2) == [
        ("cuda", "0,1"), ("cuda", "2,3")]
    assert devices(3, "cuda", gpus=3, engine="vllm", visible=["4", "6", "7"]) == [
        ("cuda", "4"), ("cuda", "6"), ("cuda", "7")]
    assert devices(1, "auto", gpus=2, engine="vllm") == [("cuda", None)]
    with pytest.raises(ValueError, match="must be >= 1"):
        engine_devices(0, "cpu", gpus=0)


@pytest.mark.slow
async def test_rollouts_through_the_router_keep_each_group_on_one_engine(tiny_tokenizer):
    """Two real engines behind the router: every turn of a group's episodes is sampled by
    the engine that sampled its first turn."""
    import gymnasium as gym

    from agentrl.engine import create_engine
    from agentrl.rollout import collect

    engines = [create_engine("tiny", tokenizer=tiny_tokenizer) for _ in range(2)]
    seen: dict[int, list[int]] = {0: [], 1: []}
    for i, e in enumerate(engines):
        inner = e.generate

        async def recorded(prompt, params, images=None, *, _i=i, _inner=inner):
            seen[_i].append(len(prompt))
            return await _inner(prompt, params, images)

        e.generate = recorded  # type: ignore[method-assign]
    router = EngineRouter(engines)
    try:
        trajs = await collect(router, lambda: gym.make("agentrl/GuessNumber-v0",
                                                       tokenizer=tiny_tokenizer),
                              num_prompts=4, n_samples_per_prompt=2,
                              sampling=SamplingParams(max_tokens=8, temperature=1.0, seed=0),
                              max_turns=3)
    finally:
        router.close()
    assert len(trajs) == 8 and all(seen.values())  # both engines worked
    assert sum(len(v) for v in seen.values()) == sum(len(t.turns) for t in trajs)
    assert router.stats()["conversations"] == 4  # one per group


def test_a_run_with_more_engines_than_gpus_is_refused_with_the_arithmetic(tmp_path):
    from trainers.cli import build_config
    from trainers.controller import preflight

    cfg = build_config(["--env", "digits", "--actor.device", "cuda", "--rollout.mode", "placed",
                        "--rollout.num_engines", "4", "--run_dir", str(tmp_path)])
    with pytest.raises(ValueError, match=r"--num_policy_workers 1 \+ --rollout.num_engines 4 x "
                                         r"--rollout.tensor_parallel_size 1 = 5 GPUs, but 4 are "
                                         r"visible; use at most 3 engines"):
        preflight(cfg, gpus=4)
    preflight(cfg, gpus=5)
    with pytest.raises(ValueError, match="needs --rollout.mode placed"):
        build_config(["--env", "digits", "--rollout.num_engines", "2"])


class Dying(Held):
    """Dies (EngineGone) on its `fail_at`-th call, and on every call after."""

    def __init__(self, fail_at: int) -> None:
        super().__init__()
        self.fail_at, self.dead = fail_at, False
        self.release.set()

    async def generate(self, prompt_ids, params, images=None):
        from agentrl.engine.router import EngineGone

        if self.dead or len(self.calls) + 1 >= self.fail_at:
            self.dead = True
            raise EngineGone("its process died")
        return await super().generate(prompt_ids, params, images)


async def test_a_dead_engine_costs_only_a_retry_and_is_restarted():
    """#16 item 2: calls on an engine that dies go to the live ones (their conversation
    with them), and the restart function's fresh engine takes its place."""
    import threading

    fresh = Held()
    fresh.release.set()
    restarted = threading.Event()

    def restart(i: int):
        assert i == 1
        restarted.set()
        return fresh

    good, dying = Held(), Dying(fail_at=2)
    good.release.set()
    router = EngineRouter([good, dying], restart=restart)

    async def episode(key: str) -> list[int]:
        out = []
        with conversation(key):
            for _ in range(3):
                [c] = await router.generate([1, 2, 3], SamplingParams(max_tokens=2))
                out += c.token_ids
        return out

    results = await asyncio.gather(*(episode(f"ep{i}") for i in range(4)))
    assert all(r == [7] * 6 for r in results)  # every episode finished, nothing lost
    assert router.retried >= 1 and restarted.wait(5)
    for _ in range(100):  # the replacement lands from its thread
        if router.alive[1]:
            break
        await asyncio.sleep(0.01)
    assert router.alive == [True, True] and router.restarts == 1
    assert router.engines[1] is fresh
    await asyncio.gather(*(episode(f"later{i}") for i in range(4)))
    assert fresh.calls  # the replacement takes calls again
    with pytest.raises(Exception, match="every engine is gone"):
        lone = EngineRouter([Dying(fail_at=1)])
        await lone.generate([1], SamplingParams(max_tokens=1))


def test_engines_in_other_processes_load_an_update_at_the_same_time():
    """Engines with start_update/finish_update (Ray actors) all start loading before the
    router waits for any of them; this process's engines load in between."""
    events: list[str] = []

    class Remote(Held):
        def __init__(self, name: str) -> None:
            super().__init__()
            self.name = name

        def start_update(self, named, version):
            events.append(f"start {self.name}")
            return (list(named), version)

        def finish_update(self, pending, version):
            events.append(f"finish {self.name}")
            self.weights.append(pending)
            self.version = version

    local, a, b = Held(), Remote("a"), Remote("b")
    router = EngineRouter([local, a, b])
    router.update_weights({"w": 1}, version=2)
    assert events == ["start a", "start b", "finish a", "finish b"]
    assert local.weights == a.weights == b.weights == [([("w", 1)], 2)]
    assert router.version == 2
