"""Third-party environments arrive through the `agentrl.environments` entry-point group."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
import textwrap

import pytest


def test_entry_point_plugins_register_and_list(tmp_path, monkeypatch):
    pkg = tmp_path / "myplugin.py"
    pkg.write_text(textwrap.dedent('''
        import agentrl
        from environments.toy.reverse import ReverseEnv

        class PluginEnv(ReverseEnv):
            """A plugin env that reverses words."""

        agentrl.register("myplugin/Plugin-v0", PluginEnv, aliases=("plugin",))
    '''))
    broken = tmp_path / "brokenplugin.py"
    broken.write_text("raise RuntimeError('plugin bug')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    eps = [
        importlib.metadata.EntryPoint("mine", "myplugin", "agentrl.environments"),
        importlib.metadata.EntryPoint("broken", "brokenplugin", "agentrl.environments"),
    ]
    real = importlib.metadata.entry_points
    monkeypatch.setattr(
        importlib.metadata, "entry_points",
        lambda **kw: eps if kw.get("group") == "agentrl.environments" else real(**kw),
    )
    from agentrl.envs import registry

    monkeypatch.setattr(registry, "_PLUGINS_LOADED", False)
    assert registry.load_plugins() == ["mine"]  # the broken one warns, the rest load
    assert registry.resolve_env_id("plugin") == "myplugin/Plugin-v0"
    listed = {e.id: e.summary for e in registry.list_envs()}
    assert listed["myplugin/Plugin-v0"] == "A plugin env that reverses words."


def test_agentrl_envs_cli_lists_builtins():
    out = subprocess.run([sys.executable, "-m", "agentrl.cli", "envs"], capture_output=True,
                         text=True, check=True).stdout
    lines = out.strip().splitlines()
    assert any(line.startswith("agentrl/MathTIR-v0") and "[--env math-tir]" in line
               for line in lines)
    assert len(lines) >= 5


@pytest.mark.parametrize("argv", [["trian"], ["envs", "--bogus"]])
def test_cli_bad_command(argv):
    proc = subprocess.run([sys.executable, "-m", "agentrl.cli", *argv], capture_output=True,
                          text=True, check=False)
    assert proc.returncode == 2
    if argv == ["trian"]:
        assert "Did you mean 'train'" in proc.stderr


def test_commands_come_from_their_providers(monkeypatch, capsys, caplog):
    """trainers/ and servers/ give `agentrl` its commands through the `agentrl.commands` group;
    a provider that fails to load is skipped with a warning and the rest still run."""
    from agentrl import cli

    table = cli.commands()
    assert table["train"][0] == "trainers.cli:main" and table["serve"][0] == "servers.cli:main"
    assert table["eval"] == cli.LIBRARY_COMMANDS["eval"]
    real = importlib.metadata.entry_points
    eps = [*real(group=cli.COMMAND_ENTRY_POINT_GROUP),
           importlib.metadata.EntryPoint("broken", "no_such_module:COMMANDS",
                                         cli.COMMAND_ENTRY_POINT_GROUP)]
    monkeypatch.setattr(
        importlib.metadata, "entry_points",
        lambda **kw: eps if kw.get("group") == cli.COMMAND_ENTRY_POINT_GROUP else real(**kw),
    )
    assert cli.main(["--help"]) == 0
    usage = capsys.readouterr().out
    assert "  train " in usage and "  serve " in usage and "  envs " in usage
    assert "'broken' (no_such_module:COMMANDS) failed to load" in caplog.text
