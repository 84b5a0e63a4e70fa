"""LoRA and QLoRA (#18 item 4): merged weights are the adapted model's, the reference is the base
with the adapters off (no copy), only adapters train, runs export a plain model; QLoRA runs on
this CPU with bitsandbytes' 4-bit kernels, and refuses clearly where they cannot run."""

from __future__ import annotations

import json

import pytest
import torch

from agentrl.models import load_model
from agentrl.models.lora import (
    adapters_off,
    load_policy,
    merged_weights,
    save_merged,
    trainable_parameters,
    with_lora,
)
from tests.trainers.test_sft import _chats


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
    from agentrl.models.value import ValueModel

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


def _qlora(seed: int = 0):
    """The tiny model for QLoRA: its linear layers in 4 bits (bitsandbytes' NF4, here on the
    CPU), rank-4 adapters with something to say."""
    model = load_policy("tiny", dtype="float32", device=torch.device("cpu"), lora_rank=4,
                        lora_alpha=8, load_in_4bit=True)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return model


Q_PROJ = "base_model.model.model.layers.0.self_attn.q_proj.base_layer"


def test_a_4bit_base_merges_as_the_values_it_stands_for(tiny_tokenizer):
    """QLoRA: bitsandbytes keeps a frozen weight packed in uint8 (its `quant_state` says how)
    and saves its packing state beside it (`weight.absmax`, ...). The merge dequantizes each
    packed weight before adding scale * B A and leaves the packing state out: a plain model
    loads the merged weights and computes what the 4-bit model computes, also after an eval
    pass (where bitsandbytes would repack the weight in place on AVX512-BF16 CPUs)."""
    model = _qlora()
    packed = model.get_parameter(Q_PROJ + ".weight")
    before = packed.detach().clone()
    full = load_model("tiny").state_dict()["model.layers.0.self_attn.q_proj.weight"]
    assert packed.dtype == torch.uint8 and packed.numel() * 2 == full.numel()  # 2 a byte
    assert not any(p.requires_grad for n, p in model.named_parameters() if "lora_" not in n)
    ids = torch.tensor([tiny_tokenizer.encode("The quick brown fox jumps over")])
    with torch.no_grad():
        training = model(input_ids=ids).logits
        model.eval()
        adapted = model(input_ids=ids).logits
        assert torch.equal(packed, before)  # not repacked
        torch.testing.assert_close(adapted, training, rtol=0, atol=1e-6)
        merged = merged_weights(model)
        assert merged.keys() == load_model("tiny").state_dict().keys()  # no packing state
        plain = load_model("tiny").eval()
        far = (plain(input_ids=ids).logits - adapted).abs().max()
        plain.load_state_dict(merged)
        torch.testing.assert_close(plain(input_ids=ids).logits, adapted, rtol=0, atol=1e-5)
    assert far > 1e-2  # the 4-bit base and the adapters are not the plain model
    # NF4 keeps each weight within its block's absmax / 7-ish: close to the base, not equal.
    b, a = (model.get_parameter(Q_PROJ.replace("base_layer", f"lora_{x}.default") + ".weight")
            for x in "BA")
    error = (merged["model.layers.0.self_attn.q_proj.weight"] - 2 * (b @ a) - full).abs()
    assert 0 < error.mean() < 0.1 * full.abs().mean()


def test_a_qlora_checkpoint_loads_back_onto_its_own_base_only():
    model = _qlora()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    assert Q_PROJ + ".weight.absmax" in state  # bitsandbytes' packing state, saved beside
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.add_(1.0)
    model.load_state_dict(state)
    for name, p in model.named_parameters():
        assert torch.equal(p, state[name]), name
    other = dict(state)
    other[Q_PROJ + ".weight"] = torch.zeros_like(state[Q_PROJ + ".weight"])
    with pytest.raises(ValueError, match="4-bit base in this checkpoint is not the model's"):
        model.load_state_dict(other)


@pytest.mark.slow
@pytest.mark.parametrize("four_bit", [False, True], ids=["lora", "qlora"])
def test_lora_sft_trains_only_the_adapters_and_exports_a_plain_model(tmp_path, tiny_tokenizer,
                                                                      four_bit):
    """QLoRA too: the export is the model the run trained (the adapters merged into its 4-bit
    base, dequantized), as a plain directory that loads without bitsandbytes' config, and
    `agentrl export --merge` writes the same again."""
    from agentrl.cli import main
    from trainers.config import ActorConfig
    from trainers.sft import SFTConfig, SFTTrainer, load_sft_data, run_sft

    cfg = SFTConfig(dataset=str(_chats(tmp_path / "chats.jsonl")), eval_fraction=0.1,
                    actor=ActorConfig(model="tiny", lr=1e-2, lora_rank=8, lora_alpha=16,
                                      load_in_4bit=four_bit),
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
    assert "quantization_config" not in json.loads((run / "hf" / "config.json").read_text())
    if four_bit:  # the export computes what the trained 4-bit model computes
        from peft import set_peft_model_state_dict
        from safetensors.torch import load_file

        trained = load_policy("tiny", dtype="float32", device=torch.device("cpu"),
                              lora_rank=8, lora_alpha=16, load_in_4bit=True)
        set_peft_model_state_dict(trained, load_file(run / "adapter" /
                                                     "adapter_model.safetensors"))
        ids = torch.tensor([tiny_tokenizer.encode("Repeat: apple river")])
        with torch.no_grad():
            torch.testing.assert_close(exported.eval()(input_ids=ids).logits,
                                       trained.eval()(input_ids=ids).logits, rtol=0, atol=1e-5)
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


def test_qlora_refuses_what_bitsandbytes_cannot_run_and_lora_settings_are_checked(
        monkeypatch):
    import importlib.util
    import platform

    from agentrl.models.lora import check_4bit_device
    from trainers.config import ActorConfig

    check_4bit_device(torch.device("cpu"))  # this machine: x86-64 with AVX2 at least
    with pytest.raises(ValueError, match="4-bit kernels run on CUDA GPUs.*the device "
                                         "is mps"):
        load_policy("tiny", dtype="float32", device=torch.device("mps"), lora_rank=8,
                    load_in_4bit=True)
    monkeypatch.setattr(platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "DEFAULT")
    with pytest.raises(ValueError, match=r"this CPU \(x86_64, DEFAULT\) has no AVX2"):
        check_4bit_device(torch.device("cpu"))
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "bitsandbytes" else find_spec(name, *a))
    with pytest.raises(ValueError, match="needs bitsandbytes: pip install bitsandbytes"):
        check_4bit_device(torch.device("cuda"))
    with pytest.raises(ValueError, match="set --actor.lora_rank too"):
        ActorConfig(load_in_4bit=True)
    with pytest.raises(ValueError, match="this model's linear layers are"):
        with_lora(load_model("tiny"), rank=4, alpha=8, targets=("nope_proj",))


@pytest.mark.slow
@pytest.mark.parametrize("four_bit", [False, True], ids=["lora", "qlora"])
def test_lora_grpo_learns_the_digits_env(tmp_path, four_bit):
    """LoRA adapters (lm_head included: the tiny model's answer is mostly its head) learn the
    toy task GRPO learns with full fine-tuning; so do QLoRA's, on the 4-bit base (the colocated
    engine samples from it)."""
    from trainers.cli import main

    run = tmp_path / "run"
    argv = ["--env", "digits", "--algo.estimator", "group_norm", "--actor.lora_rank", "16",
            "--actor.lora_alpha", "32", "--actor.lr", "1e-2", "--actor.lora_targets", "q_proj",
            "v_proj", "up_proj", "down_proj", "lm_head", "--steps", "16", "--use_ray", "false",
            "--run_dir", str(run), "--progress", "false", "--tensorboard", "false",
            "--actor.load_in_4bit", str(four_bit).lower()]
    assert main(argv) == 0
    rewards = [json.loads(x)["reward"] for x in (run / "metrics.jsonl").read_text().split("\n")
               if '"reward"' in x]
    assert max(rewards[:3]) < 0.15 and min(rewards[-3:]) > 0.5, rewards
    assert (run / "adapter" / "adapter_config.json").is_file() and (run / "hf").is_dir()
