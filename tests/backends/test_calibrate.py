"""Which kernel families are used: forced by the environment, measured once and cached, and
measured again when the cache holds an entry from before a family existed."""

from __future__ import annotations

import json

import pytest
import torch

from agentrl.backends.cpu import calibrate, kernels


@pytest.fixture(scope="module")
def module():
    mod = kernels.module()
    assert mod is not None, "the CPU kernels did not build (see the warning logged above)"
    return mod


@pytest.fixture
def fresh(monkeypatch, tmp_path, module):
    monkeypatch.setattr(calibrate, "_cached", {})
    monkeypatch.setattr(calibrate, "_cache_path", lambda: tmp_path / "choice.json")
    monkeypatch.delenv(kernels.ENV, raising=False)
    return tmp_path / "choice.json"


def test_forced_choices_turn_every_family_on_or_off(fresh, monkeypatch):
    monkeypatch.setenv(kernels.ENV, "1")
    assert calibrate.choice() == calibrate.Choice(True, True, True, True, {})
    monkeypatch.setenv(kernels.ENV, "0")
    assert calibrate.choice() == calibrate.Choice(False, False, False, False, {})
    monkeypatch.setenv(kernels.ENV, "2")
    with pytest.raises(ValueError, match="expected 0"):
        calibrate.choice()


def test_a_cached_entry_missing_a_family_is_measured_again(fresh, monkeypatch):
    key = kernels.source_key()
    fresh.write_text(json.dumps({key: {"decode": True, "train": True, "logprobs": True,
                                       "speedups": {"decode": 2.0}}}))
    measured = {"decode": 2.0, "decode_wide": 0.9, "train": 1.5, "logprobs": 1.01}
    monkeypatch.setattr(calibrate, "measure", lambda mod: measured)
    got = calibrate.choice()
    assert got == calibrate.Choice(decode=True, decode_wide=False, train=True, logprobs=False,
                                   speedups=measured)
    assert json.loads(fresh.read_text())[key]["decode_wide"] is False
    # Read back from the file without measuring.
    monkeypatch.setattr(calibrate, "_cached", {})
    monkeypatch.setattr(calibrate, "measure", lambda mod: pytest.fail("measured again"))
    assert calibrate.choice() == got


def test_the_wide_decode_pair_measures_the_same_step_both_ways(module):
    """Two pairs from the same seed: the first step of each side on its own fresh cache."""
    torch.manual_seed(0)
    torch_step, _ = calibrate._wide_decode_pair()
    torch.manual_seed(0)
    _, kernel_step = calibrate._wide_decode_pair()
    want = torch_step()
    torch.testing.assert_close(kernel_step(), want, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(torch_step(), want, rtol=1e-4, atol=1e-4)  # a column more
