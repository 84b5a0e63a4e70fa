"""`agentrl eval` and `agentrl rollout` refuse a model their engine cannot load before anything
loads, with the train command's check (agentrl.models.named.check_engine_loads)."""

from __future__ import annotations

import pytest

from agentrl.cli import main


@pytest.fixture
def nothing_loads(monkeypatch):
    """vLLM as if installed; loading a model, a tokenizer or an engine fails the test."""
    import importlib.util

    import agentrl.engine
    from agentrl import models

    find = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: object() if name == "vllm" else find(name, *a))
    for module, name in ((models, "load_model"), (models, "load_tokenizer"),
                         (agentrl.engine, "open_engine")):
        monkeypatch.setattr(module, name, lambda *a, _n=name, **k: pytest.fail(f"{_n} ran"))


@pytest.mark.parametrize("command", [["rollout", "--out", "unused.jsonl"], ["eval"]])
def test_vllm_with_a_model_built_in_memory_is_refused_before_loading(command, nothing_loads,
                                                                      capsys):
    assert main([*command, "--env", "reverse", "--model", "tiny", "--engine", "vllm"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert ("--engine vllm loads the model from a directory, but --model tiny is built in memory "
            "and has none: use --model smollm2-135m-instruct (the embedded model)") in err
