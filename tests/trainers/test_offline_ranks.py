"""`--num_workers N` for the offline trainers (#18): N data-parallel Ray actors (gloo here) give
the model one process trains, for SFT, DPO and the reward model, on FSDP2 and DeepSpeed; the
epoch's short last step is padded with zero-weight repeats so every rank runs the same passes.
With LoRA only the adapters train, and they and the merged export are one process's too."""

from __future__ import annotations

import json
import random

import pytest
import torch

from trainers.config import ActorConfig

pytestmark = [pytest.mark.ray, pytest.mark.slow]

WORDS = ["apple", "river", "stone", "cloud", "tiger", "lemon", "piano", "rocket"]
LR = 1e-3  # full fine-tuning; Adam's steps move a weight by about this much each


def _rows(path, kind: str, n: int = 44) -> str:
    rng = random.Random(0)
    with path.open("w") as f:
        for _ in range(n):
            w, other = (" ".join(rng.sample(WORDS, 2)) for _ in range(2))
            row = ({"messages": [{"role": "user", "content": f"Repeat: {w}"},
                                 {"role": "assistant", "content": w}]} if kind == "sft"
                   else {"prompt": f"Repeat: {w}", "chosen": w, "rejected": other + " x"})
            f.write(json.dumps(row) + "\n")
    return str(path)


def _run(kind: str, tmp_path, name: str, *, lora_rank: int = 0, four_bit: bool = False, **kw):
    from trainers.dpo import DPOConfig, run_dpo
    from trainers.rm import RMConfig, run_rm
    from trainers.sft import SFTConfig, run_sft

    config, run = {"sft": (SFTConfig, run_sft), "dpo": (DPOConfig, run_dpo),
                   "rm": (RMConfig, run_rm)}[kind]
    # Adapters start as no change (B = 0): a larger step makes them say something.
    actor = ActorConfig(model="tiny", lr=1e-2 if lora_rank else LR, lora_rank=lora_rank,
                        lora_alpha=2 * lora_rank or 16, load_in_4bit=four_bit)
    # 44 rows, ~4 held out: steps of 16, 16 and a short last one; 2 micro-batches per rank.
    cfg = config(actor=actor, run_dir=str(tmp_path / name),
                 dataset=_rows(tmp_path / f"{kind}.jsonl", kind), eval_fraction=0.1,
                 batch_size=16, micro_batch_size=4, progress=False, tensorboard=False,
                 seed=3, **kw)
    return run(cfg)


CASES = {
    "sft-fsdp2": ("sft", {"backend": "fsdp2"}),
    "dpo-zero2": ("dpo", {"backend": "deepspeed", "zero_stage": 2}),
    "rm-fsdp2": ("rm", {"backend": "fsdp2"}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_two_workers_train_what_one_process_does(ray_cluster, tmp_path, case):
    kind, options = CASES[case]
    if options["backend"] == "deepspeed":
        pytest.importorskip("deepspeed")
    from agentrl.models import load_model

    one = _run(kind, tmp_path, "one", backend="local")
    two = _run(kind, tmp_path, "two", num_workers=2, **options)
    assert two["steps"] == one["steps"] == 3
    for when in ("eval_before", "eval_after"):
        for k, v in one[when].items():
            assert two[when][k] == pytest.approx(v, rel=1e-3, abs=1e-4), (when, k)
    # Per step, the training loss and the gradient norm before clipping: Adam's update hardly
    # depends on the gradient's scale, so a gradient summed over the ranks instead of averaged
    # shows here, not in the weights.
    for key in ("loss", "grad_norm"):
        steps = [[r[key] for r in _metrics(tmp_path / run) if key in r] for run in ("one", "two")]
        assert len(steps[0]) == 3 and steps[1] == pytest.approx(steps[0], rel=1e-4), key
    init = load_model("tiny").state_dict()
    got, want = load_model(two["hf_model"]).state_dict(), load_model(one["hf_model"]).state_dict()
    assert got.keys() == want.keys() == init.keys()
    _assert_same_training(torch.cat([(want[k] - init[k]).flatten() for k in init]),
                          torch.cat([(got[k] - init[k]).flatten() for k in init]))
    if kind == "rm":
        from agentrl.models.value import load_reward_model

        head_two = load_reward_model(two["reward_model"]).head.weight.detach()
        head_one = load_reward_model(one["reward_model"]).head.weight.detach()
        assert float(head_one.abs().max()) > LR  # trained: it starts at zero
        assert float((head_two - head_one).norm() / head_one.norm()) < 1e-3  # 2e-7 measured


def _metrics(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _assert_same_training(moved_one: torch.Tensor, moved_two: torch.Tensor) -> None:
    """Both runs moved the weights (three Adam steps at LR move most weights by ~LR each), and
    by the same amounts: within LR / 100 but at a few weights whose gradient is near Adam's eps
    (its step g / (|g| + eps) amplifies round-off there). Measured on an AVX2 EPYC for SFT, DPO
    and the RM: 63-98% of the weights moved by over LR / 10, the largest by 1.6e-3-3.0e-3; the
    runs differ by at most 1.3e-5 (DPO: 0.0008% of the weights over LR / 100), the norm of the
    difference 1.5e-6-1.8e-5 of the move's."""
    for moved in (moved_one, moved_two):
        assert float(moved.abs().max()) > LR
        assert float((moved.abs() > LR / 10).float().mean()) > 0.3
    off = (moved_two - moved_one).abs()
    assert float((off > LR / 100).float().mean()) < 1e-4
    assert float((moved_two - moved_one).norm() / moved_one.norm()) < 1e-3


def test_num_workers_needs_a_distributed_backend():
    from trainers.sft import SFTConfig

    with pytest.raises(ValueError, match="--num_workers 2 trains data-parallel: it needs "
                                         "--backend fsdp2 or deepspeed"):
        SFTConfig(dataset="x.jsonl", num_workers=2, backend="local")
    with pytest.raises(ValueError, match="--batch_size 1 gives some of the 2 workers nothing"):
        SFTConfig(dataset="x.jsonl", num_workers=2, backend="fsdp2", batch_size=1)
    lora = ActorConfig(lora_rank=8)
    assert SFTConfig(dataset="x.jsonl", num_workers=2, backend="fsdp2", actor=lora).num_workers == 2
    qlora = ActorConfig(lora_rank=8, load_in_4bit=True)
    with pytest.raises(ValueError, match=r"--actor.load_in_4bit \(QLoRA\) with --num_workers > 1: "
                                         r"--backend fsdp2 shards every weight"):
        SFTConfig(dataset="x.jsonl", num_workers=2, backend="fsdp2", actor=qlora)


LORA_CASES = {
    "sft-fsdp2": ("sft", {"backend": "fsdp2"}),
    "dpo-zero2": ("dpo", {"backend": "deepspeed", "zero_stage": 2}),
}


@pytest.mark.parametrize("case", list(LORA_CASES))
def test_two_workers_train_the_adapters_one_process_does(ray_cluster, tmp_path, case):
    """LoRA over ranks: only the adapters train (the base in the checkpoint is the initial
    one, the optimizer holds adapter state only), and the adapters, the merged export and the
    held-out losses are those of one process."""
    kind, options = LORA_CASES[case]
    if options["backend"] == "deepspeed":
        pytest.importorskip("deepspeed")
    from safetensors.torch import load_file

    from agentrl.models import load_model
    from agentrl.models.lora import trainable_parameters, with_lora
    from trainers.checkpoint import load_checkpoint

    one = _run(kind, tmp_path, "one", backend="local", lora_rank=4)
    two = _run(kind, tmp_path, "two", num_workers=2, lora_rank=4, **options)
    assert two["steps"] == one["steps"] == 3
    for when in ("eval_before", "eval_after"):
        for k, v in one[when].items():
            assert two[when][k] == pytest.approx(v, rel=1e-3, abs=1e-4), (when, k)
    adapters = [load_file(tmp_path / run / "adapter" / "adapter_model.safetensors")
                for run in ("one", "two")]
    assert adapters[0].keys() == adapters[1].keys() and adapters[0]
    for k in adapters[0]:
        torch.testing.assert_close(adapters[1][k], adapters[0][k], rtol=1e-3, atol=1e-4)
    base = load_model("tiny").state_dict()
    merged = {run: load_model(r["hf_model"]).state_dict() for run, r in (("one", one),
                                                                         ("two", two))}
    saved = adapters[1]
    for name, w in base.items():
        torch.testing.assert_close(merged["two"][name], merged["one"][name], rtol=1e-3,
                                   atol=1e-4)
        # The export is the initial base plus the saved adapters' B A (scale alpha / r = 2).
        lora = f"base_model.model.{name.removesuffix('.weight')}.lora_"
        if lora + "A.weight" in saved:
            w = w + 2 * saved[lora + "B.weight"] @ saved[lora + "A.weight"]
        torch.testing.assert_close(merged["two"][name], w, rtol=0, atol=1e-5)
    assert max((merged["two"][k] - base[k]).abs().max() for k in base) > 1e-3  # trained
    # Checkpoints are the one-process run's: the whole model (its base as it started), and
    # optimizer state for the adapters only (FSDP2: by name; ZeRO: each rank's partition).
    state, _, _ = load_checkpoint(two["checkpoint"])
    frozen = {k: v for k, v in state["backend"]["model"].items() if "lora_" not in k}
    assert len(frozen) == len(base)
    for k, v in frozen.items():
        assert torch.equal(v, base[k.removeprefix("base_model.model.").replace(".base_layer.",
                                                                              ".")]), k
    optim = state["backend"]["optimizer"]
    if options["backend"] == "fsdp2":
        assert all("lora_" in k for k in optim["state"])
        held = sum(v["exp_avg"].numel() for v in optim["state"].values())
    else:
        held = sum(p.numel() for rank in optim for p in rank["single_partition_of_fp32_groups"])
    trainable, _ = trainable_parameters(with_lora(load_model("tiny"), rank=4, alpha=8))
    assert held == trainable


def test_two_zero2_workers_train_the_qlora_adapters_one_process_does(ray_cluster, tmp_path):
    """QLoRA over ranks: ZeRO-2 keeps the 4-bit base whole on each rank (bitsandbytes' packed
    weights) and shards what trains. Two ranks give one process's held-out losses, adapters and
    merged export; the checkpoint holds the packed base as it was loaded."""
    pytest.importorskip("deepspeed")
    from safetensors.torch import load_file

    from agentrl.models import load_model
    from agentrl.models.lora import load_policy
    from trainers.checkpoint import load_checkpoint

    qlora = {"lora_rank": 4, "four_bit": True}
    one = _run("sft", tmp_path, "one", backend="local", **qlora)
    two = _run("sft", tmp_path, "two", num_workers=2, backend="deepspeed", zero_stage=2, **qlora)
    assert two["steps"] == one["steps"] == 3
    assert one["eval_after"]["eval/loss"] < one["eval_before"]["eval/loss"] - 0.1
    for when in ("eval_before", "eval_after"):
        assert two[when]["eval/loss"] == pytest.approx(one[when]["eval/loss"], rel=1e-3), when
    adapters = [load_file(tmp_path / r / "adapter" / "adapter_model.safetensors")
                for r in ("one", "two")]
    assert adapters[0].keys() == adapters[1].keys() and adapters[0]
    for k in adapters[0]:
        torch.testing.assert_close(adapters[1][k], adapters[0][k], rtol=1e-3, atol=1e-4)
    merged = [load_model(r["hf_model"]).state_dict() for r in (one, two)]
    for k in merged[0]:
        torch.testing.assert_close(merged[1][k], merged[0][k], rtol=1e-3, atol=1e-4)
    state, _, _ = load_checkpoint(two["checkpoint"])
    loaded = load_policy("tiny", dtype="float32", device=torch.device("cpu"), lora_rank=4,
                         lora_alpha=8, load_in_4bit=True).state_dict()
    saved = state["backend"]["model"]
    packed = [k for k, v in loaded.items() if v.dtype == torch.uint8 and k.endswith(".weight")]
    assert packed and all(torch.equal(saved[k], loaded[k]) for k in packed)
