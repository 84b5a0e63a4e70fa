"""An env written in a file of one's own reaches the CLI without packaging (#35): `--env` takes
Gymnasium's `module:ID`, `module:EnvClass`, a .py file (with or without `:NAME`), imports it and
resolves the id; what it cannot resolve is a one-line error naming the forms."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import pytest

from agentrl.envs import resolve_env_id

# The README's EchoEnv, as a new user saves it in echo_env.py; {ns} keeps each test's ids apart.
ECHO = '''
import agentrl

class EchoEnv(agentrl.ChatEnv):
    """Repeat the word the user says."""

    def reset(self, *, seed=None, options=None):
        self.word = str(self.np_random.choice(["apple", "river", "stone"]))
        return [{{"role": "user", "content": f"Repeat after me: {{self.word}}"}}]

    def step(self, assistant_text):
        reward = float(assistant_text.strip().lower() == self.word)
        return [], reward, True, False, {{"word": self.word}}

agentrl.register("{ns}/Echo-v0", EchoEnv)
'''


@pytest.fixture
def echo_module(tmp_path, monkeypatch):
    """A module `echo_<hex>` in a fresh directory that is the current one and on sys.path (as
    the CLI puts it); returns (module name, the id it registers)."""
    name = f"echo_{uuid.uuid4().hex[:8]}"
    ns = f"me{uuid.uuid4().hex[:6]}"
    (tmp_path / f"{name}.py").write_text(ECHO.format(ns=ns))
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    return name, f"{ns}/Echo-v0"


def test_each_form_resolves_to_the_env_the_file_defines(echo_module):
    import gymnasium as gym

    name, env_id = echo_module
    assert resolve_env_id(f"{name}:{env_id}") == env_id  # Gymnasium's module:id
    assert resolve_env_id(f"{name}.py") == env_id  # the one env the file registers
    assert resolve_env_id(f"{name}.py:{env_id}") == env_id
    # The class it registered: that id, not a second one.
    assert resolve_env_id(f"{name}:EchoEnv") == env_id
    env = gym.make(env_id, tokenizer="tiny")
    obs, _ = env.reset(seed=0)
    assert "Repeat after me" in env.unwrapped.tokenizer.decode(obs["tokens"])


def test_an_unregistered_class_is_registered_under_its_module(tmp_path, monkeypatch):
    name = f"plain_{uuid.uuid4().hex[:8]}"
    source = ECHO.split("agentrl.register")[0]  # the class alone, never registered
    (tmp_path / f"{name}.py").write_text(source.format())
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert resolve_env_id(f"{name}:EchoEnv") == f"{name}/EchoEnv-v0"
    assert resolve_env_id(f"{name}.py") == f"{name}/EchoEnv-v0"  # its one env class


def test_what_cannot_be_resolved_says_what_to_name(echo_module, tmp_path):
    name, env_id = echo_module
    with pytest.raises(ValueError, match=rf"registers no env 'Nope'.*{env_id}"):
        resolve_env_id(f"{name}:Nope")
    with pytest.raises(ValueError, match="cannot import 'no_such_module'"):
        resolve_env_id("no_such_module:me/X-v0")
    with pytest.raises(ValueError, match="does not exist"):
        resolve_env_id("missing.py")
    two = tmp_path / "two_envs.py"
    two.write_text(ECHO.format(ns=f"a{uuid.uuid4().hex[:6]}")
                   + "\nagentrl.register('b" + uuid.uuid4().hex[:6] + "/Echo-v0', EchoEnv)\n")
    with pytest.raises(ValueError, match=r"name one of .* as two_envs\.py:NAME"):
        resolve_env_id("two_envs.py")


@pytest.mark.slow
@pytest.mark.ray
def test_the_cli_trains_the_readmes_env_from_its_file(tmp_path):
    """`agentrl train --env echo_env:me/Echo-v0` from the directory holding echo_env.py, with
    Ray (its workers import the module too), for one step."""
    (tmp_path / "echo_env.py").write_text(ECHO.format(ns="me"))
    agentrl = Path(sys.executable).with_name("agentrl")
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [str(agentrl), "train", "--env", "echo_env:me/Echo-v0", "--actor.model", "tiny",
         "--steps", "1", "--rollout.prompts_per_step", "2", "--rollout.n_samples_per_prompt",
         "2", "--rollout.max_new_tokens", "8", "--progress", "false", "--run_dir", str(run_dir)],
        cwd=tmp_path, capture_output=True, text=True, timeout=600, check=False,
        env={**os.environ, "PYTHONPATH": ""},
    )
    assert proc.returncode == 0, textwrap.shorten(proc.stderr[-3000:], 3000)
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "reward" in r] == [1]
    assert json.loads((run_dir / "config.json").read_text())["env"] == "echo_env:me/Echo-v0"
