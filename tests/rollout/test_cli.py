"""`agentrl rollout` end to end with the tiny model."""

from __future__ import annotations

import pytest

from agentrl.cli import main
from agentrl.trajectory_files import load_jsonl


def test_rollout_cli_writes_jsonl(tmp_path, capsys):
    out = tmp_path / "r.jsonl"
    rc = main(
        [
            "rollout",
            "--env",
            "reverse",
            "--model",
            "tiny",
            "-n",
            "2",
            "--prompts",
            "3",
            "--max-tokens",
            "8",
            "--out",
            str(out),
            "--no-progress",
        ]
    )
    assert rc == 0
    trajs = load_jsonl(out)
    assert len(trajs) == 6 and [t.group for t in trajs] == ["0", "0", "1", "1", "2", "2"]
    assert all(0 < t.num_policy_tokens <= 8 for t in trajs)
    printed = capsys.readouterr().out
    assert "6 episodes" in printed and "mean reward" in printed and str(out) in printed


def test_rollout_cli_bad_env(tmp_path, capsys):
    rc = main(["rollout", "--env", "revers", "--model", "tiny", "--out", str(tmp_path / "x.jsonl")])
    assert rc == 2
    assert "Did you mean 'reverse'" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["max_turns", "max_episode_tokens"])
def test_budgets_below_one_name_the_flag(name):
    from agentrl.rollout.cli import RolloutArgs
    from agentrl.rollout.evaluate import EvalArgs

    for args in (lambda **kw: RolloutArgs(env="reverse", **kw), EvalArgs):
        with pytest.raises(ValueError, match=rf"^--{name} must be an integer >= 1 \(or unset "
                                             rf"for no limit\), got 0$"):
            args(**{name: 0})


def test_engine_and_device_are_checked_before_loading(tmp_path, capsys, monkeypatch):
    import torch

    from agentrl import models

    monkeypatch.setattr(models, "load_model", lambda *a, **k: pytest.fail("model was loaded"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    out = str(tmp_path / "x.jsonl")
    assert main(["rollout", "--env", "reverse", "--model", "tiny", "--engine", "vlm",
                 "--out", out]) == 2
    assert "Did you mean 'vllm'" in capsys.readouterr().err
    assert main(["eval", "--env", "reverse", "--model", "tiny", "--device", "cuda"]) == 2
    assert "no CUDA device is visible" in capsys.readouterr().err
    assert main(["rollout", "--env", "reverse", "--model", "tiny", "--tensor-parallel-size", "2",
                 "--out", out]) == 2
    assert "--tensor_parallel_size > 1 and --enable_sleep need --engine vllm" in (
        capsys.readouterr().err)


def test_one_flag_style_for_every_command(caplog):
    """Every command parses through agentrl.command_line: booleans take a value in any case, the
    bare flag or its --no_ form; eval and rollout spell the per-turn budget as train does
    (--max_new_tokens), the old --max_tokens working for one release with a warning."""
    from agentrl.command_line import parse_flags
    from agentrl.rollout.cli import RENAMED, RolloutArgs
    from agentrl.rollout.evaluate import EvalArgs
    from servers.cli import ServeArgs

    args = parse_flags(RolloutArgs, ["--env", "reverse", "--max_tokens", "8", "--progress",
                                     "FALSE"], prog="agentrl rollout", renamed=RENAMED)
    assert args.max_new_tokens == 8 and args.progress is False
    assert "--max_tokens is now --max_new_tokens" in caplog.text
    assert parse_flags(EvalArgs, ["--no_progress"], prog="agentrl eval").progress is False
    assert parse_flags(EvalArgs, [], prog="agentrl eval").temperature == 0.0  # greedy evals
    serve = parse_flags(ServeArgs, ["--engines", "2", "--allow_image_urls"], prog="agentrl serve",
                        renamed={"--engines": "--num_engines"})
    assert serve.num_engines == 2 and serve.allow_image_urls is True
    with pytest.raises(ValueError, match=r"^--gpu_memory_utilization must be in \(0, 1\]"):
        EvalArgs(gpu_memory_utilization=1.5)


def test_the_rollout_file_shows_episode_text_escaped(tmp_path):
    """#34 item 10: text of an episode reaches the file `agentrl rollout` writes through `info`
    (math-tir's `answer` is the policy's own boxed text). JSON escapes every control and
    non-ASCII character there, so `cat rollouts.jsonl` shows them instead of obeying them: a
    guard against writing the file with ensure_ascii=False, which passes U+202E and C1 raw."""
    from agentrl.trajectory_files import save_jsonl
    from agentrl.types import TrajectoryBuilder

    text = "\x1b]52;c;cHduZWQ=\x07\x1b]0;pwned\x07\x1b[2J\u202e\x9b"
    builder = TrajectoryBuilder(group="0")
    builder.add_observation([5, 6])
    builder.add_action([7], [-0.5])
    save_jsonl([builder.build(terminated=True, truncated=False, info={"answer": text})],
               tmp_path / "r.jsonl")
    written = (tmp_path / "r.jsonl").read_bytes()
    assert written.isascii() and not any(b < 0x20 and b != 0x0A for b in written)
    assert load_jsonl(tmp_path / "r.jsonl")[0].info["answer"] == text
