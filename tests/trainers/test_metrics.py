from __future__ import annotations

import json
import sys
import types

from trainers.metrics import MetricsLogger


def test_jsonl_always_and_wandb_only_with_a_key(tmp_path, monkeypatch):
    logged, finished = [], []
    fake = types.SimpleNamespace(
        init=lambda **kw: types.SimpleNamespace(
            log=lambda d, step: logged.append((step, d)), finish=lambda: finished.append(1)
        )
    )
    monkeypatch.setitem(sys.modules, "wandb", fake)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    log = MetricsLogger(tmp_path / "a", tensorboard=False, progress=False)
    log.log(1, {"reward": 0.5, "kl": float("nan")})
    log.close()
    assert logged == []
    row = json.loads((tmp_path / "a" / "metrics.jsonl").read_text())
    assert row == {"step": 1, "reward": 0.5, "kl": "nan"}

    monkeypatch.setenv("WANDB_API_KEY", "test")
    log = MetricsLogger(tmp_path / "b", tensorboard=True, progress=False, config={"x": 1})
    log.log(2, {"reward": 1.0, "note": "text"})
    log.close()
    assert logged == [(2, {"reward": 1.0})] and finished == [1]
    assert any((tmp_path / "b" / "tb").iterdir())
