"""`agentrl serve` flags: the embedded default with no --model, engine and device checked before
any model loads."""

from __future__ import annotations

import importlib.util

import pytest

from agentrl.cli import main


def test_no_model_flag_serves_the_embedded_default():
    import tyro

    from servers.cli import ServeArgs

    args = tyro.cli(ServeArgs, args=[], use_underscores=True)
    assert (args.model, args.engine, args.device) == ("smollm2-135m-instruct", "transformers",
                                                      "auto")
    assert args.max_tokens_default is None
    capped = tyro.cli(ServeArgs, args=["--max_tokens_default", "64"], use_underscores=True)
    assert capped.max_tokens_default == 64
    with pytest.raises(ValueError, match="--max_tokens_default must be >= 1"):
        ServeArgs(max_tokens_default=0)


def test_the_default_max_tokens_caps_requests_that_set_none(make_proxy):
    p = make_proxy(max_tokens_default=7)
    client = p.client()
    msgs = [{"role": "user", "content": "hi"}]
    client.chat.completions.create(model="agentrl", messages=msgs)
    client.chat.completions.create(model="agentrl", messages=msgs, max_completion_tokens=3)
    assert [params.max_tokens for _, params, _ in p.engine.requests] == [7, 3]


def test_an_unknown_engine_says_did_you_mean(capsys, monkeypatch):
    from agentrl import models

    monkeypatch.setattr(models, "load_model", lambda *a, **k: pytest.fail("model was loaded"))
    assert main(["serve", "--engine", "vlm"]) == 2
    assert "agentrl serve: --engine 'vlm' is not an engine. Did you mean 'vllm'" in (
        capsys.readouterr().err)


def test_vllm_without_the_package_says_what_to_install(capsys, monkeypatch):
    import sys

    from agentrl import models

    find = importlib.util.find_spec
    monkeypatch.delitem(sys.modules, "vllm", raising=False)
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "vllm" else find(name, *a))
    monkeypatch.setattr(models, "load_model", lambda *a, **k: pytest.fail("model was loaded"))
    assert main(["serve", "--engine", "vllm"]) == 2
    assert "the vllm package is not installed" in capsys.readouterr().err


def test_a_missing_gpu_fails_before_loading(capsys, monkeypatch):
    import torch

    from agentrl import models

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(models, "load_model", lambda *a, **k: pytest.fail("model was loaded"))
    assert main(["serve", "--model", "tiny", "--device", "cuda"]) == 2
    assert "--device cuda: no CUDA device is visible" in capsys.readouterr().err


def test_more_engines_than_gpus_is_refused_before_loading(capsys, monkeypatch):
    import torch

    from agentrl import models

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(models, "load_model", lambda *a, **k: pytest.fail("model was loaded"))
    assert main(["serve", "--model", "tiny", "--num_engines", "3", "--device", "cuda"]) == 2
    assert "--num_engines 3 x --tensor_parallel_size 1 = 3 GPUs, but 2 are visible" in (
        capsys.readouterr().err)


def test_several_vllm_engines_on_gpus_each_start_on_their_own(capsys, monkeypatch, tmp_path):
    """`--engine vllm --engines 2 --tensor_parallel_size 2` with GPUs 4-7 visible: the first
    engine starts on 4,5, the second on 6,7, behind one router."""
    import torch

    import agentrl.engine
    import agentrl.engine.router
    import servers.cli
    from agentrl.engine.fakes import FakeEngine
    from agentrl.engine.router import EngineRouter
    from agentrl.models import load_tokenizer

    opened: list[dict] = []
    served: list = []
    routers: list = []

    class Recorded(EngineRouter):
        def __init__(self, engines, **kwargs) -> None:
            routers.append(engines)
            super().__init__(engines, **kwargs)

    monkeypatch.setattr(agentrl.engine.router, "EngineRouter", Recorded)

    def open_engine(model, **kwargs):
        opened.append(kwargs)
        return FakeEngine(load_tokenizer("tiny"))

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(agentrl.engine, "open_engine", open_engine)
    monkeypatch.setattr(servers.cli, "_run_with_announce",
                        lambda server, announce: served.append(server.config.app))
    assert main(["serve", "--model", "tiny", "--engine", "vllm", "--num_engines", "2",
                 "--tensor_parallel_size", "2", "--device", "cuda",
                 "--store", str(tmp_path / "sessions.db")]) == 0
    assert [(k["device"], k["cuda_visible_devices"]) for k in opened] == [
        ("cuda", "4,5"), ("cuda", "6,7")]
    assert all(k["tensor_parallel_size"] == 2 for k in opened)
    assert len(served) == 1 and [len(r) for r in routers] == [2]  # one router over both
