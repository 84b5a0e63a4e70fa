"""LoRA (#18 item 4): merged weights are the adapted model's, the reference is the base with the
adapters off (no copy), only adapters train, runs export a plain model, QLoRA refuses clearly."""

from __future__ import annotations

import json
import random

import pytest
import torch

from agentrl.models import load_model
from agentrl.models.lora import (
    adapters_off,
    merged_weights,
    save_merged,
    trainable_parameters,
    with_lora,
)


def _adapted(seed: int = 0):
    model = with_lora(load_model("tiny"), rank=4, alpha=8)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # B starts at zero (no change); give the adapters something to say
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return model.eval()


def test_merged_weights_are_the_adapted_model_and_adapters_off_is_the_base(tmp_path,
                                                                          tiny_tokenizer):
    model = _adapted()
    ids = torch.tensor([tiny_tokenizer.encode("The quick brown fox")])
    with torch.no_grad():
        adapted = model(input_ids=ids).logits
        with adapters_off(model):
            base_logits = model(input_ids=ids).logits
        plain = load_model("tiny").eval()
        assert torch.allclose(plain(input_ids=ids).logits, base_logits, atol=1e-6)
        assert not torch.allclose(adapted, base_logits, atol=1e-3)
        plain.load_state_dict(merged_weights(model))
        torch.testing.assert_close(plain(input_ids=ids).logits, adapted, atol=1e-5, rtol=0)
        save_merged(model, tiny_tokenizer, tmp_path / "merged")
        loaded = load_model(str(tmp_path / "merged")).eval()
        torch.testing.assert_close(loaded(input_ids=ids).logits, adapted, atol=1e-5, rtol=0)
    trainable, total = trainable_parameters(model)
    assert 0 < trainable < total // 10


def test_merged_weights_come_from_the_state_given():
    """Sharded over ranks, the model's own tensors are slices: the merge then reads W, A and B
    from the gathered state only (names relative to the module given, a ValueModel's too)."""
    from trainers.critic import ValueModel

    model = _adapted()
    base = load_model("tiny").state_dict()
    no_b = {k: torch.zeros_like(v) if "lora_B" in k else v for k, v in model.state_dict().items()}
    merged = merged_weights(model, no_b)
    assert merged.keys() == base.keys()
    for k, v in merged.items():
        assert torch.equal(v, base[k]), k
    assert merged_weights(model, {}) == {}  # a rank the gather left out
    value = ValueModel(model)
    from_value = merged_weights(value)
    for k, v in merged_weights(model).items():
        if k.startswith("model."):
            assert torch.equal(from_value["backbone." + k.removeprefix("model.")], v), k
    assert not torch.equal(from_value["backbone.layers.0.self_attn.q_proj.weight"],
                           base["model.layers.0.self_attn.q_proj.weight"])


def test_a_4bit_base_merges_as_the_values_it_stands_for(monkeypatch):
    """QLoRA: bitsandbytes keeps a frozen weight packed in uint8 (its `quant_state` says how)
    and saves the state beside it (`weight.absmax`, ...). The merge dequantizes the weight
    before adding scale * B A and leaves the packing state out: an engine loads plain tensors.
    (bitsandbytes' dequantization itself needs CUDA: here a stand-in of its function.)"""
    import sys
    import types

    model = _adapted()
    name = "base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight"
    dense = model.get_parameter(name).detach().clone()
    packed = torch.nn.Parameter(torch.zeros(dense.numel() // 2, 1, dtype=torch.uint8),
                                requires_grad=False)
    packed.quant_state = object()  # type: ignore[attr-defined]
    layer = model.get_submodule(name.removesuffix(".weight"))
    layer.weight = packed
    calls = []

    def dequantize_4bit(tensor, quant_state):
        calls.append((tensor, quant_state))
        return dense

    stub = types.ModuleType("bitsandbytes.functional")
    stub.dequantize_4bit = dequantize_4bit
    monkeypatch.setitem(sys.modules, "bitsandbytes", types.ModuleType("bitsandbytes"))
    monkeypatch.setitem(sys.modules, "bitsandbytes.functional", stub)
    state = {**model.state_dict(), name + ".absmax": torch.ones(4),
             name + ".quant_state.bitsandbytes__nf4": torch.zeros(8, dtype=torch.uint8)}
    merged = merged_weights(model, state)
    [(tensor, quant)] = calls
    assert tensor is packed.data or torch.equal(tensor, packed.data)
    assert quant is packed.quant_state
    plain = name.replace("base_model.model.", "").replace(".base_layer", "")
    a, b = (state[name.replace("base_layer", f"lora_{x}.default")] for x in "AB")
    scale = model.get_submodule(name.removesuffix(".base_layer.weight")).scaling["default"]
    torch.testing.assert_close(merged[plain], dense + scale * (b @ a))
    assert not any("absmax" in k or "quant_state" in k for k in merged)
    assert merged.keys() == load_model("tiny").state_dict().keys()


def _chats(path, n=120):
    rng = random.Random(0)
    words = ["apple", "river", "stone", "cloud", "tiger", "lemon", "piano", "rocket"]
    with path.open("w") as f:
        for _ in range(n):
            w = " ".join(rng.choice(words) for _ in range(3))
            f.write(json.dumps({"messages": [{"role": "user", "content": f"Repeat: {w}"},
                                             {"role": "assistant", "content": w}]}) + "\n")
    return path


@pytest.mark.slow
def test_lora_sft_trains_only_the_adapters_and_exports_a_plain_model(tmp_path, tiny_tokenizer):
    from agentrl.cli import main
    from trainers.config import ActorConfig
    from trainers.sft import SFTConfig, SFTTrainer, load_sft_data, run_sft

    cfg = SFTConfig(dataset=str(_chats(tmp_path / "chats.jsonl")), eval_fraction=0.1,
                    actor=ActorConfig(model="tiny", lr=1e-2, lora_rank=8, lora_alpha=16),
                    run_dir=str(tmp_path / "run"), epochs=2, progress=False,
                    tensorboard=False)
    trainer = SFTTrainer(cfg, load_sft_data(cfg, tiny_tokenizer), tiny_tokenizer)
    frozen = {n: p.detach().clone() for n, p in trainer.model.named_parameters()
              if "lora_" not in n}
    for _ in range(3):
        trainer.train_step(trainer.next_items())
    for n, p in trainer.model.named_parameters():
        if "lora_" not in n:
            assert torch.equal(p, frozen[n]), n
    summary = run_sft(cfg)
    assert summary["eval_after"]["eval/loss"] < summary["eval_before"]["eval/loss"] - 0.3
    run = tmp_path / "run"
    assert (run / "adapter" / "adapter_config.json").is_file()
    exported = load_model(str(run / "hf"))  # a plain model: loads without peft
    assert main(["export", str(run), "--merge", "--out", str(tmp_path / "again")]) == 0
    again = load_model(str(tmp_path / "again"))
    for (n, a), (_, b) in zip(exported.state_dict().items(), again.state_dict().items(),
                              strict=True):
        assert torch.equal(a, b), n
    assert main(["export", str(tmp_path), "--merge"]) == 2  # not a run directory


@pytest.mark.slow
def test_lora_rl_keeps_no_reference_copy_and_its_reference_is_the_base(tiny_tokenizer):
    """With --algo.kl_coef the reference log-probs are the base model's (adapters off), and
    the worker holds one model; the engine samples from the adapted model."""
    from trainers.cli import build_config
    from trainers.logprobs import token_logprobs
    from trainers.policy import PolicyWorker

    cfg = build_config(["--env", "digits", "--actor.lora_rank", "8", "--actor.lr", "1e-2",
                        "--algo.kl_coef", "0.1", "--use_ray", "false"])
    w = PolicyWorker(cfg)
    assert w.ref is None and w.has_ref
    trajs = w.collect(list(range(cfg.rollout.prompts_per_step)), 1)
    w.train(trajs, 0.1)  # adapters move
    trajs = w.collect(list(range(cfg.rollout.prompts_per_step)), 2)
    from trainers.batch import collate

    batch = collate(trajs, w.pad_id)
    w.train(trajs, 0.1)
    base = load_model("tiny")
    rows = (torch.arange(batch.size), int(batch.input_ids.shape[1]))
    with torch.no_grad():
        want = token_logprobs(cfg, w.policy, base, batch, rows)[0]
        with adapters_off(w.model):
            got = token_logprobs(cfg, w.policy, w.model, batch, rows)[0]
        adapted = token_logprobs(cfg, w.policy, w.model, batch, rows)[0]
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    assert (adapted - want).abs().max() > 1e-3  # the policy has moved away from the base
    merged = w.named_weights()
    assert set(merged) == set(base.state_dict())


def test_qlora_needs_a_gpu_and_lora_settings_are_checked():
    from agentrl.models.lora import load_policy
    from trainers.config import ActorConfig

    with pytest.raises(ValueError, match="needs a CUDA GPU"):
        load_policy("tiny", dtype="float32", device=torch.device("cpu"), lora_rank=8,
                    load_in_4bit=True)
    with pytest.raises(ValueError, match="set --actor.lora_rank too"):
        ActorConfig(load_in_4bit=True)
    with pytest.raises(ValueError, match="this model's linear layers are"):
        with_lora(load_model("tiny"), rank=4, alpha=8, targets=("nope_proj",))


@pytest.mark.slow
def test_lora_grpo_learns_the_digits_env(tmp_path):
    """LoRA adapters (lm_head included: the tiny model's answer is mostly its head) learn the
    toy task GRPO learns with full fine-tuning."""
    from trainers.cli import main

    run = tmp_path / "run"
    argv = ["--env", "digits", "--algo.estimator", "group_norm", "--actor.lora_rank", "16",
            "--actor.lora_alpha", "32", "--actor.lr", "1e-2", "--actor.lora_targets", "q_proj",
            "v_proj", "up_proj", "down_proj", "lm_head", "--steps", "16", "--use_ray", "false",
            "--run_dir", str(run), "--progress", "false", "--tensorboard", "false"]
    assert main(argv) == 0
    rewards = [json.loads(x)["reward"] for x in (run / "metrics.jsonl").read_text().split("\n")
               if '"reward"' in x]
    assert max(rewards[:3]) < 0.15 and min(rewards[-3:]) > 0.5, rewards
    assert (run / "adapter" / "adapter_config.json").is_file() and (run / "hf").is_dir()
