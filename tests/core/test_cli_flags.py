"""One flag spelling in every subcommand (underscores), the hyphenated one accepted as an alias."""

from __future__ import annotations

import pytest

from agentrl.cli import underscored


def test_flag_names_get_underscores_and_values_do_not():
    argv = ["--rollout.max-new-tokens", "64", "--env", "math-tir", "--run-dir=runs/a-b", "-n", "2",
            "--no-progress", "--"]
    assert underscored(argv) == ["--rollout.max_new_tokens", "64", "--env", "math-tir",
                                 "--run_dir=runs/a-b", "-n", "2", "--no_progress", "--"]


@pytest.mark.parametrize("flag", ["--num_problems", "--num-problems"])
def test_eval_takes_both_spellings(flag):
    from agentrl.command_line import parse_flags
    from agentrl.rollout.evaluate import EvalArgs

    args = parse_flags(EvalArgs, underscored([flag, "7", "--max-new-tokens", "9"]),
                       prog="agentrl eval")
    assert (args.num_problems, args.max_new_tokens) == (7, 9)


@pytest.mark.parametrize("flag",
                         ["--rollout.n_samples_per_prompt", "--rollout.n-samples-per-prompt"])
def test_train_takes_both_spellings(flag):
    from trainers.cli import build_config

    cfg = build_config(underscored(["--env", "digits", flag, "3", "--use-ray", "false"]))
    assert cfg.rollout.n_samples_per_prompt == 3 and cfg.use_ray is False
