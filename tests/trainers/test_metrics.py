"""MetricsLogger against the real integrations: Weights & Biases through the real `wandb` in
offline mode (no key, no network; the run read back from the .wandb file it writes) and
TensorBoard's event files read back with TensorBoard's own EventAccumulator."""

from __future__ import annotations

import json
import logging
import re
import struct
import sys
from pathlib import Path

import pytest

from trainers.metrics import MetricsLogger

wandb = pytest.importorskip("wandb")


@pytest.fixture
def wandb_offline(tmp_path, monkeypatch):
    """W&B in offline mode with no key: nothing reaches the network, the home directory or the
    git repository, and wandb's service process is ended after the test."""
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_DIR", raising=False)
    wb_home = tmp_path / "wandb_home"
    for name, value in {
        "WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_CONSOLE": "off",
        "WANDB_DISABLE_GIT": "true", "WANDB_DISABLE_CODE": "true",
        "WANDB_ERROR_REPORTING": "false", "WANDB_PROJECT": "agentrl-test",
        "WANDB_CONFIG_DIR": str(wb_home / "config"), "WANDB_CACHE_DIR": str(wb_home / "cache"),
        "WANDB_DATA_DIR": str(wb_home / "data"), "WANDB_ARTIFACT_DIR": str(wb_home / "art"),
    }.items():
        monkeypatch.setenv(name, value)
    yield
    wandb.teardown()


def _wandb_records(path: Path) -> list:
    """The records of a run's .wandb file, decoded with wandb's own protobuf schema. wandb 0.31
    ships no Python reader for the file (its `datastore` module went with the Go core), so the
    framing is read here: LevelDB's log format (32 KiB blocks of records, each a 7-byte header:
    crc32c, length, type FULL=1 / FIRST=2 / MIDDLE=3 / LAST=4) after a 7-byte ":W&B" header."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    ident, magic, version = struct.unpack("<4sHB", data[:7])
    assert (ident, magic, version) == (b":W&B", 0xBEE1, 0), "not a .wandb file of this format"
    block, pos, pending, records = 32768, 7, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        assert kind in (1, 2, 3, 4), f"bad record type {kind} at byte {pos}"
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def _wandb_run(wandb_root: Path) -> dict:
    """The one offline run under `wandb_root`: its name, project, config and history rows."""
    # wandb 0.31's finish() can return before its service process has written the last step to
    # the file (5 times in 15 here, read at once); ending the service, as a process exit does,
    # writes it.
    wandb.teardown()
    (run_file,) = wandb_root.glob("wandb/offline-run-*/run-*.wandb")
    run: dict = {"history": []}
    for record in _wandb_records(run_file):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run["name"], run["project"] = record.run.display_name, record.run.project
            run["config"] = {u.key: json.loads(u.value_json) for u in record.run.config.update
                             if u.key != "_wandb"}
        elif kind == "history":
            row = {(i.key or "/".join(i.nested_key)): json.loads(i.value_json)
                   for i in record.history.item}
            run["history"].append({k: v for k, v in row.items()
                                   if k not in ("_runtime", "_timestamp")})
    return run


def _tensorboard_scalars(tb_dir: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tb_dir))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


@pytest.mark.timeout(120)
@pytest.mark.usefixtures("wandb_offline")
def test_offline_wandb_and_tensorboard_hold_what_was_logged(tmp_path):
    run_dir = tmp_path / "run-a"
    config = {"algo": {"estimator": "group_norm", "kl_coef": 0.0}, "actor": {"lr": 1e-3}}
    log = MetricsLogger(run_dir, tensorboard=True, progress=False, config=config)
    log.log(1, {"reward": 0.25, "kl": float("nan"), "note": "text"})
    log.log(2, {"reward": 0.75, "kl": 0.125, "eval/pass@1": 0.5})
    log.close()

    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert rows == [{"step": 1, "reward": 0.25, "kl": "nan", "note": "text"},
                    {"step": 2, "reward": 0.75, "kl": 0.125, "eval/pass@1": 0.5}]

    # W&B: the run lives in RUN_DIR/wandb, named after the run dir, with the config and only the
    # numeric values (a NaN is written to metrics.jsonl as "nan" and to neither integration).
    run = _wandb_run(run_dir)
    assert run["name"] == "run-a" and run["project"] == "agentrl-test"
    assert run["config"] == config
    assert run["history"] == [{"_step": 1, "reward": 0.25},
                              {"_step": 2, "reward": 0.75, "kl": 0.125, "eval/pass@1": 0.5}]

    # TensorBoard: the same scalars at the same steps; "@" is spelled "_at_" in its tags.
    assert _tensorboard_scalars(run_dir / "tb") == {
        "reward": [(1, 0.25), (2, 0.75)], "kl": [(2, 0.125)], "eval/pass_at_1": [(2, 0.5)]}


@pytest.mark.timeout(120)
@pytest.mark.usefixtures("wandb_offline")
def test_wandb_dir_set_by_the_user_is_where_the_offline_run_goes(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "elsewhere"))
    (tmp_path / "elsewhere").mkdir()
    log = MetricsLogger(tmp_path / "run-b", tensorboard=False, progress=False)
    log.log(3, {"reward": 1.0})
    log.close()
    assert not (tmp_path / "run-b" / "wandb").exists()
    assert _wandb_run(tmp_path / "elsewhere")["history"] == [{"_step": 3, "reward": 1.0}]


@pytest.mark.parametrize("env", [{}, {"WANDB_MODE": "disabled", "WANDB_API_KEY": "k" * 40}])
def test_no_wandb_run_unless_asked_for(tmp_path, monkeypatch, env):
    for name in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_DIR"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    log = MetricsLogger(tmp_path / "run", tensorboard=False, progress=False)
    log.log(1, {"reward": 0.5})
    log.close()
    assert log._wandb is None and not (tmp_path / "run" / "wandb").exists()
    assert json.loads((tmp_path / "run" / "metrics.jsonl").read_text()) == {"step": 1,
                                                                            "reward": 0.5}


@pytest.mark.parametrize(("value", "hint"), [("offlien", " (did you mean 'offline'?)"),
                                             ("OFFLINE", " (did you mean 'offline'?)"),
                                             ("yes", "")])
def test_unknown_wandb_mode_is_refused_before_anything_is_written(tmp_path, monkeypatch, value,
                                                                  hint):
    monkeypatch.setenv("WANDB_MODE", value)
    message = f"WANDB_MODE='{value}' is not a W&B mode{hint}: set it to offline (no key needed)"
    with pytest.raises(ValueError, match=re.escape(message)):
        MetricsLogger(tmp_path / "run", tensorboard=False, progress=False)
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_a_missing_wandb_is_a_warning_not_a_crash(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setitem(sys.modules, "wandb", None)  # what `import wandb` meets when absent
    with caplog.at_level(logging.WARNING, logger="trainers.metrics"):
        log = MetricsLogger(tmp_path / "run", tensorboard=False, progress=False)
    log.log(1, {"reward": 0.5})
    log.close()
    assert log._wandb is None and "wandb is not installed (pip install wandb)" in caplog.text
    assert json.loads((tmp_path / "run" / "metrics.jsonl").read_text())["reward"] == 0.5


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.usefixtures("wandb_offline")
def test_a_training_run_sends_its_config_and_metrics_to_offline_wandb_and_tensorboard(make_cfg):
    from trainers.controller import Trainer

    cfg = make_cfg(steps=2, tensorboard=True)
    Trainer(cfg).run()
    run_dir = Path(cfg.run_dir)
    # wandb merges what is logged at one step into one history row; so does this.
    logged: dict[int, dict] = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        logged.setdefault(row.pop("step"), {}).update(
            {k: v for k, v in row.items() if isinstance(v, int | float)})
    assert {1, 2} <= set(logged) and "reward" in logged[2]

    run = _wandb_run(run_dir)
    assert run["config"] == json.loads((run_dir / "config.json").read_text())
    assert {row.pop("_step"): row for row in run["history"]} == logged

    scalars = _tensorboard_scalars(run_dir / "tb")
    assert scalars["reward"] == [(s, pytest.approx(m["reward"], rel=1e-6))
                                 for s, m in sorted(logged.items()) if "reward" in m]
    assert set(scalars) == {k.replace("@", "_at_") for m in logged.values() for k in m}
