"""Each tutorial page's code runs as written (#35): the fenced blocks with a `title="FILE"` are
written to a fresh directory, and the `$ ` lines of its `console` blocks are run there in order
with this environment's `python` and `agentrl`. Then what the page says they print or leave
behind is checked. Blocks fenced as `bash` are shown, not run (GPU, cluster and long commands);
tests/docs/test_commands.py checks their flags."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TUTORIALS = ROOT / "docs" / "tutorials"
FENCE = re.compile(r"^```(\w+)([^\n]*)\n(.*?)^```", re.DOTALL | re.MULTILINE)


def files_and_commands(page: Path) -> tuple[dict[str, str], list[str]]:
    files, commands = {}, []
    for lang, attrs, body in FENCE.findall(page.read_text()):
        title = re.search(r'title="([^"]+)"', attrs)
        if title:
            files[title.group(1)] = body
        elif lang == "console":
            commands += [line[2:] for line in body.splitlines() if line.startswith("$ ")]
    return files, commands


def run_page(name: str, tmp_path: Path, timeout: int = 600) -> list[str]:
    """Write the page's files into tmp_path, run its commands there; their outputs, in order."""
    files, commands = files_and_commands(TUTORIALS / name)
    assert commands, f"{name} has no console commands"
    for file, text in files.items():
        (tmp_path / file).write_text(text)
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    bin_dir = str(Path(sys.executable).parent)
    env = {**os.environ, "PATH": bin_dir + os.pathsep + os.environ["PATH"], "PYTHONPATH": ""}
    outputs = []
    for command in commands:
        done = subprocess.run(["bash", "-c", command], cwd=tmp_path, env=env, text=True,
                              capture_output=True, timeout=timeout, check=False)
        assert done.returncode == 0, f"{name}: `{command}` failed:\n{done.stderr[-3000:]}"
        outputs.append(done.stdout)
    return outputs


def steps_logged(run_dir: Path) -> list[int]:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["step"] for r in rows if "reward" in r]


def test_every_tutorial_runs_something():
    pages = sorted(p.name for p in TUTORIALS.glob("*.md"))
    assert pages == sorted(f"{n}.md" for n in [
        "write-an-environment", "rl-on-a-dataset", "framework-agent", "vlm-and-gui",
        "sft-dpo-rl", "scale-out"])
    for page in pages:
        assert files_and_commands(TUTORIALS / page)[1], page


@pytest.mark.embedded
def test_write_an_environment(tmp_path):
    play, train = run_page("write-an-environment.md", tmp_path)
    lines = play.strip().splitlines()
    assert lines[-1] == "1.0 True"  # the right tokens earn the reward and end the episode
    assert "Repeat after me: stone" in play and "<|im_start|>assistant" in play
    # The page shows what the script prints, as it prints it.
    assert "Repeat after me: stone<|im_end|>" in (TUTORIALS / "write-an-environment.md").read_text()
    assert json.loads(train)["steps"] == 2
    assert steps_logged(tmp_path / "run") == [1, 2]
    assert (tmp_path / "run" / "hf").is_dir()


def test_rl_on_a_dataset(tmp_path):
    (train,) = run_page("rl-on-a-dataset.md", tmp_path)
    assert json.loads(train)["steps"] == 2
    assert steps_logged(tmp_path / "run") == [1, 2]
    for step in (1, 2):  # 2 prompts x 2 samples, each one scored step
        path = next((tmp_path / "run" / "rollouts").glob(f"step_*{step}.jsonl"))
        episodes = [json.loads(line) for line in path.read_text().splitlines()]
        assert len(episodes) == 4 and all(len(e["turns"]) == 1 for e in episodes)


@pytest.mark.slow
def test_framework_agent(tmp_path):
    (train,) = run_page("framework-agent.md", tmp_path)
    assert json.loads(train)["steps"] == 2
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    started = [r["agents_started"] for r in rows if "agents_started" in r]
    assert started == [4.0, 4.0]  # 2 tasks x 2 samples, each an Agents SDK run through the proxy
    assert all(r["agents_failed"] == 0 for r in rows if "agents_failed" in r)


@pytest.mark.slow
def test_vlm_and_gui(tmp_path):
    import shutil

    if not shutil.which("chromium") or not shutil.which("chromedriver"):
        pytest.skip("MiniWoB++ needs Debian's chromium and chromium-driver (make setup)")
    look, train = run_page("vlm-and-gui.md", tmp_path)
    assert look.splitlines()[0] == "119 prompt tokens and 1 image of shape (112, 112, 3)"
    assert 'Task: Click on the "submit" button.' in look and '[9] button "submit"' in look
    assert json.loads(train)["steps"] == 1
    images = list((tmp_path / "run" / "rollouts" / "images").glob("*.png"))
    assert images, "the screenshots were not stored with the trajectories"


@pytest.mark.slow
def test_sft_dpo_rl(tmp_path):
    outputs = run_page("sft-dpo-rl.md", tmp_path)
    for stage, output in zip(("sft", "dpo", "rl"), outputs, strict=True):
        assert (tmp_path / stage / "hf").is_dir(), stage
        assert f'"hf_model": "{stage}/hf"' in output, output[-500:]
    dpo_config = json.loads((tmp_path / "dpo" / "config.json").read_text())
    rl_config = json.loads((tmp_path / "rl" / "config.json").read_text())
    assert dpo_config["actor"]["model"] == "sft/hf" and rl_config["actor"]["model"] == "dpo/hf"
    assert steps_logged(tmp_path / "rl") == [1, 2]


def test_scale_out(tmp_path):
    _, help_text = run_page("scale-out.md", tmp_path, timeout=120)
    for flag in ("--ray.address", "--rollout.mode", "--rollout.num_engines", "--backend",
                 "--num_policy_workers", "--actor.device", "--rollout.enable_sleep"):
        assert flag in help_text, flag
