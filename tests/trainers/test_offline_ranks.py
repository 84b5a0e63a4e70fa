"""`--num_workers N` for the offline trainers (#18): N data-parallel Ray actors (gloo here) give
the model one process trains, for SFT, DPO and the reward model, on FSDP2 and DeepSpeed; the
epoch's short last step is padded with zero-weight repeats so every rank runs the same passes."""

from __future__ import annotations

import json
import random

import pytest
import torch

from trainers.config import ActorConfig

pytestmark = [pytest.mark.ray, pytest.mark.slow]

WORDS = ["apple", "river", "stone", "cloud", "tiger", "lemon", "piano", "rocket"]


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


def _run(kind: str, tmp_path, name: str, **kw):
    from trainers.dpo import DPOConfig, run_dpo
    from trainers.rm import RMConfig, run_rm
    from trainers.sft import SFTConfig, run_sft

    config, run = {"sft": (SFTConfig, run_sft), "dpo": (DPOConfig, run_dpo),
                   "rm": (RMConfig, run_rm)}[kind]
    # 44 rows, ~4 held out: steps of 16, 16 and a short last one; 2 micro-batches per rank.
    cfg = config(actor=ActorConfig(model="tiny", lr=1e-3), run_dir=str(tmp_path / name),
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
def test_two_workers_train_what_one_process_does(tmp_path, case):
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
    got, want = load_model(two["hf_model"]).state_dict(), load_model(one["hf_model"]).state_dict()
    assert got.keys() == want.keys()
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-3, atol=1e-3)
    if kind == "rm":
        from trainers.rm import load_reward_model

        head_two = load_reward_model(two["reward_model"]).head.weight
        head_one = load_reward_model(one["reward_model"]).head.weight
        torch.testing.assert_close(head_two, head_one, rtol=1e-3, atol=1e-3)
        assert head_one.abs().sum() > 0  # trained: it starts at zero


def test_num_workers_needs_a_distributed_backend():
    from trainers.sft import SFTConfig

    with pytest.raises(ValueError, match="--num_workers 2 trains data-parallel: it needs "
                                         "--backend fsdp2 or deepspeed"):
        SFTConfig(dataset="x.jsonl", num_workers=2, backend="local")
    with pytest.raises(ValueError, match="--batch_size 1 gives some of the 2 workers nothing"):
        SFTConfig(dataset="x.jsonl", num_workers=2, backend="fsdp2", batch_size=1)
