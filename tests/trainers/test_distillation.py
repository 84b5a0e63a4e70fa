"""On-policy distillation (--algo.teacher, #37 item 1) in the trainer: the teacher's log-probs
laid out as the batch's, the advantages teacher-minus-student per token (mixed with the env's
at --algo.teacher_coef < 1), the student moved toward the teacher, and a teacher with another
vocabulary refused before any model loads."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from agentrl.engine.fakes import FakeEngine, fake_logprob
from agentrl.types import Image, TrajectoryBuilder


def _save(model, tok, path) -> str:
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


def _sharp(tok, seed: int = 1, noise: float = 0.0):
    """A tiny Llama with its weights scaled up (far from uniform), moved by `noise` of each
    weight's spread: a teacher near enough the un-moved one for a few steps to close on."""
    from agentrl.models.tiny import tiny_model

    model = tiny_model(tok, seed=seed)
    gen = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.mul_(4.0)
            p.add_(torch.randn(p.shape, generator=gen) * p.std() * noise)
    return model.eval()


@pytest.fixture(scope="module")
def teacher_dir(tiny_tokenizer, tmp_path_factory):
    return _save(_sharp(tiny_tokenizer, noise=0.25), tiny_tokenizer,
                 tmp_path_factory.mktemp("teacher"))


def _forward_logprobs(model, ids) -> torch.Tensor:
    """log p(ids[t+1] | ids[:t+1]) for every t, from a plain forward."""
    with torch.no_grad():
        logp = model(torch.tensor([ids])).logits[0, :-1].float().log_softmax(-1)
    return logp.gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]


def test_teacher_logprobs_take_the_batch_layout_and_the_images(tiny_tokenizer):
    """Each trajectory is scored whole from its first policy token, with its images; the
    scores sit where the batch's per-target tensors hold that token (t: token t+1)."""
    from trainers.distillation import teacher_logprobs

    b = TrajectoryBuilder()
    pixels = np.zeros((4, 4, 3), dtype=np.uint8)
    b.add_observation([11, 12, 13], [Image(pixels=pixels, start=1, end=2)])
    b.add_action([21, 22], [-1.0, -1.0])
    b.add_observation([14])
    b.add_action([23], [-1.0])
    with_images = b.build(terminated=True, truncated=False)
    c = TrajectoryBuilder()
    c.add_observation([15, 16])
    c.add_action([24], [-1.0])
    plain = c.build(terminated=True, truncated=False)
    engine = FakeEngine(tiny_tokenizer)
    got = teacher_logprobs(engine, [with_images, plain], 6)
    assert [(ids, start, n_images) for ids, start, n_images in engine.scored] == [
        ([11, 12, 13, 21, 22, 14, 23], 3, 1), ([15, 16, 24], 2, 0)]
    want = torch.zeros(2, 6)
    want[0, 2:6] = torch.tensor([fake_logprob(t) for t in (21, 22, 14, 23)])
    want[1, 1] = fake_logprob(24)
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("coef", [1.0, 0.5])
def test_advantages_are_teacher_minus_student_per_token(make_cfg, recorded_rollouts,
                                                        teacher_dir, monkeypatch, coef):
    """A step's advantages: c x (the teacher's log-prob of each sampled token, from a plain
    forward of the teacher, less the sampler's) + (1 - c) x the env's group_norm advantage."""
    from agentrl.models import load_model
    from agentrl.trajectory_files import load_jsonl
    from trainers import rl_step
    from trainers.policy import PolicyWorker

    seen = {}
    real = rl_step.batch_advantages

    def spy(algo, batch, kl, kl_coef, **kw):
        seen["batch"] = batch
        seen["env"] = rl_step._estimated(algo, batch, kl, kl_coef, 0)[0]
        seen["adv"] = real(algo, batch, kl, kl_coef, **kw)[0]
        return real(algo, batch, kl, kl_coef, **kw)

    monkeypatch.setattr(rl_step, "batch_advantages", spy)
    cfg = make_cfg(algo={"teacher": teacher_dir, "teacher_coef": coef})
    worker = PolicyWorker(cfg, with_engine=False)
    teacher = load_model(teacher_dir).eval()
    trajs = load_jsonl(recorded_rollouts)[:8]
    metrics = worker.train(trajs, 0.0)
    adv, mask, env = seen["adv"], seen["batch"].mask, seen["env"]
    gaps = []
    for b, traj in enumerate(trajs):
        n = len(traj.token_ids) - 1
        sel = mask[b, :n].bool()
        gap = _forward_logprobs(teacher, traj.token_ids) - torch.tensor(traj.logprobs[1:])
        want = coef * gap + (1 - coef) * env[b, :n]
        torch.testing.assert_close(adv[b, :n][sel], want[sel], atol=1e-5, rtol=0)
        assert bool((adv[b][~mask[b].bool()] == 0).all())
        gaps.append(gap[sel])
    assert metrics["teacher_kl"] == pytest.approx(-float(torch.cat(gaps).mean()), abs=1e-5)
    assert metrics["teacher_kl"] > 0.01  # the teacher differs: the test compares something
    worker.close()


def test_distillation_moves_the_student_toward_the_teacher(make_cfg, tiny_tokenizer,
                                                           teacher_dir, tmp_path):
    """Four steps of pure distillation (digits, 32 episodes a step) from the un-moved model
    toward the teacher: the exact reverse KL over the vocabulary, on a fixed set of the
    student's episodes, falls by more than a quarter."""
    from trainers.policy import PolicyWorker

    student = _save(_sharp(tiny_tokenizer), tiny_tokenizer, tmp_path / "student")
    cfg = make_cfg(actor={"model": student, "lr": 1e-3}, algo={"teacher": teacher_dir})
    worker = PolicyWorker(cfg)
    teacher = _sharp(tiny_tokenizer, noise=0.25)

    def reverse_kl(trajs) -> float:
        total, count = 0.0, 0
        with torch.no_grad():
            for traj in trajs:
                ids = torch.tensor([traj.token_ids])
                s = worker.model(ids).logits[0, :-1].log_softmax(-1)
                t = teacher(ids).logits[0, :-1].log_softmax(-1)
                sel = torch.tensor(traj.loss_mask[1:]).bool()
                total += float((s.exp() * (s - t)).sum(-1)[sel].sum())
                count += int(sel.sum())
        return total / count

    fixed = worker.collect(list(range(100, 108)), 0)
    before = reverse_kl(fixed)
    for step in range(4):
        worker.train(worker.collect(list(range(step * 8, step * 8 + 8)), step), 0.0)
    after = reverse_kl(fixed)
    worker.close()
    assert after < 0.75 * before, (before, after)


@pytest.fixture
def nothing_starts(monkeypatch):
    """Starting Ray or loading a model fails the test."""
    import ray

    from agentrl import models

    monkeypatch.setattr(ray, "init", lambda *a, **k: pytest.fail("Ray was started"))
    monkeypatch.setattr(models, "load_model", lambda *a, **k: pytest.fail("a model was loaded"))


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--algo.teacher", "smollm2-135m-instruct"],
         ("--algo.teacher smollm2-135m-instruct does not share the tokenizer of --actor.model "
          "tiny (49152 vs 384 tokens")),
        (["--algo.teacher", "tiny-qwen2-vl"],
         "--algo.teacher tiny-qwen2-vl does not share the tokenizer of --actor.model tiny"),
        (["--algo.teacher", "tiny-llama3"], "--algo.teacher: unknown model 'tiny-llama3'"),
        (["--algo.teacher", "tiny", "--rollout.engine", "vllm",
          "--actor.model", "smollm2-135m-instruct"],
         ("--rollout.engine vllm loads the model from a directory, but --algo.teacher tiny is "
          "built in memory")),
        (["--algo.teacher", "tiny", "--algo.teacher_coef", "0"],
         "--algo.teacher_coef must be in (0, 1]"),
    ],
)
def test_a_teacher_that_cannot_work_is_refused_before_any_model_loads(argv, says, nothing_starts,
                                                                      tmp_path, capsys):
    from trainers.cli import main

    run = tmp_path / "run"
    assert main(["--env", "digits", *argv, "--run_dir", str(run)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and says in err, err
    assert not run.exists()


def test_a_teacher_with_the_same_vocabulary_passes(nothing_starts, teacher_dir):
    """tiny-think has tiny's vocabulary (another chat template); a saved directory too. Pure
    distillation needs no group: one sample a prompt is accepted with group_norm."""
    from trainers.cli import build_config

    for teacher in ("tiny-think", teacher_dir):
        cfg = build_config(["--env", "digits", "--algo.teacher", teacher,
                            "--rollout.n_samples_per_prompt", "1"])
        assert cfg.algo.teacher == teacher and cfg.algo.pure_distillation
