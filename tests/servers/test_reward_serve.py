"""Remote rewards (#16 item 6): `agentrl reward-serve` serves a reward function over HTTP, and
`agentrl train --reward.url` scores episodes through it: batched, with timeouts and retries, and
a failure discards the episodes concerned (counted) instead of crashing the run."""

from __future__ import annotations

import json
import threading
import time

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from agentrl.rewards import RemoteReward, RewardServiceError
from servers.reward_serve import create_reward_app
from servers.serving import serve_in_thread


def contains(prompt, response, label):
    if label == "boom":
        raise ValueError("cannot score this one")
    if label == "slow":
        time.sleep(1.0)  # past both of the client's tries (2 x 0.3 s); stopping waits it out
    return {"reward": float(label in response), "length": len(response)}


@pytest.fixture
def service():
    with serve_in_thread(create_reward_app(contains)) as url:
        yield f"{url}/score"


def test_concurrent_episodes_are_scored_in_batches(service):
    client = RemoteReward(service, window_s=0.05)
    out: dict[int, dict] = {}

    def one(i: int) -> None:
        out[i] = client("q", f"answer {i}", str(i % 3))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [out[i]["reward"] for i in range(16)] == [
        float(str(i % 3) in f"answer {i}") for i in range(16)]
    assert out[3]["length"] == len("answer 3")  # the function's extra keys come back as info
    assert client.requests < 16  # gathered: one request carries many episodes


def test_batches_share_one_connection():
    """One kept-alive connection for every batch (and retry), not one per batch."""
    app, ports = FastAPI(), []

    @app.post("/score")
    async def score(request: Request) -> JSONResponse:
        assert request.client is not None
        ports.append(request.client.port)
        items = (await request.json())["items"]
        return JSONResponse({"rewards": [float(len(i["response"])) for i in items]})

    with serve_in_thread(app) as url:
        client = RemoteReward(f"{url}/score", window_s=0.0)
        assert [client("q", "r" * n, None)["reward"] for n in (1, 2, 3)] == [1.0, 2.0, 3.0]
    assert len(ports) == 3 and len(set(ports)) == 1, ports


def test_an_item_the_function_cannot_score_fails_alone_without_retries(service):
    client = RemoteReward(service, retries=3, window_s=0.2)
    out: dict[str, object] = {}

    def one(label: str) -> None:
        try:
            out[label] = client("q", "r 1", label)
        except RewardServiceError as e:
            out[label] = e

    threads = [threading.Thread(target=one, args=(x,)) for x in ("1", "boom", "2")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert isinstance(out["boom"], RewardServiceError) and "cannot score this one" in str(
        out["boom"])
    assert out["1"]["reward"] == 1.0 and out["2"]["reward"] == 0.0  # its batch-mates scored
    assert client.requests == 1


def test_a_slow_service_times_out_after_its_retries(service):
    client = RemoteReward(service, timeout_s=0.3, retries=1)
    start = time.monotonic()
    with pytest.raises(RewardServiceError, match=r"did not answer \(ReadTimeout.*2 tries of 0.3 s"):
        client("q", "r", "slow")
    assert time.monotonic() - start < 1.5 and client.requests == 2


def test_malformed_answers_and_unreachable_services_are_errors():
    bad = FastAPI()

    @bad.post("/score")
    async def score() -> JSONResponse:
        return JSONResponse({"oops": [1]})

    with serve_in_thread(bad) as url, pytest.raises(RewardServiceError, match="malformed JSON"):
        RemoteReward(f"{url}/score", retries=0)("q", "r", None)
    with pytest.raises(RewardServiceError, match="did not answer"):
        RemoteReward("http://127.0.0.1:9/score", retries=1, timeout_s=1)("q", "r", None)


def test_training_through_the_service_discards_what_it_cannot_score(service, tmp_path, capsys):
    from trainers.cli import main

    rows = [{"prompt": "Say 1.", "label": "1"}, {"prompt": "Say 2.", "label": "boom"}]
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    run = tmp_path / "run"
    argv = ["--dataset", str(data), "--reward.url", service, "--steps", "2",
            "--run_dir", str(run), "--actor.model", "tiny", "--use_ray", "false",
            "--progress", "false", "--tensorboard", "false", "--rollout.prompts_per_step", "4",
            "--rollout.n_samples_per_prompt", "2", "--rollout.max_new_tokens", "4",
            "--seed", "3"]
    assert main(argv) == 0, capsys.readouterr().err
    metrics = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in metrics if "reward" in m]
    assert [m["step"] for m in steps] == [1, 2]
    assert sum(m["discarded"] for m in steps) > 0  # the "boom" rows: counted, not trained on
    from agentrl.trajectory_files import load_jsonl

    trajs = load_jsonl(run / "rollouts" / "step_000001.jsonl")
    assert trajs and all(t.discard == ("cannot score this one" in t.info.get("error", ""))
                         for t in trajs)
    assert any(not t.discard for t in trajs)  # the scorable rows trained


def test_reward_flags_are_checked_before_loading(tmp_path):
    from trainers.cli import build_config

    data = tmp_path / "data.jsonl"
    data.write_text('{"prompt": "x"}\n')
    with pytest.raises(ValueError, match="pass one of --reward_fn .* not several"):
        build_config(["--dataset", str(data), "--reward_fn", "a.py:f", "--reward.url",
                      "http://x/score"])
    with pytest.raises(ValueError, match=r"--reward.url \(a reward service\) or "
                                         r"--reward.model \(a reward model\), not both"):
        build_config(["--dataset", str(data), "--reward.url", "http://x/score",
                      "--reward.model", str(tmp_path)])
    with pytest.raises(ValueError, match="must be an http"):
        build_config(["--dataset", str(data), "--reward.url", "x:8001"])


def test_reward_serve_cli_refuses_a_bad_function(tmp_path, capsys):
    from agentrl.cli import main

    (tmp_path / "r.py").write_text("x = 1\n")
    assert main(["reward-serve", f"{tmp_path / 'r.py'}:score"]) == 2
    assert "r.py defines no 'score'" in capsys.readouterr().err
    assert main(["reward-serve", f"{tmp_path / 'r.py'}:x"]) == 2
    assert "is not a callable but a int" in capsys.readouterr().err


def test_a_url_httpx_cannot_even_parse_is_an_error_not_a_hang():
    with pytest.raises(RewardServiceError, match="reward service"):
        RemoteReward("http://[::1/score", retries=0, timeout_s=1)("q", "r", None)


def test_agent_sessions_scored_by_the_service(service, tok):
    """#16 item 6 from the proxy side: each agent session is one item of the reward service
    (the task as prompt, its label; the agent's answer as response), batched with the others;
    one the service cannot score keeps its trajectory, discarded and saying why."""
    import asyncio

    from agentrl.engine.fakes import FakeEngine
    from servers.agents import remote_agent_reward, run_agents
    from servers.app import create_app

    async def agent(task, base_url, api_key):
        import openai

        client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
        r = await client.chat.completions.create(
            model="agentrl", messages=[{"role": "user", "content": task["prompt"]}])
        await client.close()
        return r.choices[0].message.content

    tasks = [{"prompt": "p", "label": "42"}, {"prompt": "p", "label": "7"},
             {"prompt": "p", "label": "boom"}]
    scorer = remote_agent_reward(service, retries=0)
    trajs = asyncio.run(run_agents(agent, tasks, app=create_app(FakeEngine(tok), tok),
                                   reward_fn=scorer))
    assert [t.info["task_index"] for t in trajs] == [0, 1, 2]
    assert [t.total_reward for t in trajs[:2]] == [1.0, 0.0]  # FakeEngine answers "... 42"
    assert [t.discard for t in trajs] == [False, False, True]
    assert "cannot score this one" in trajs[2].info["error"] and trajs[2].token_ids


def test_an_agent_run_takes_a_reward_service_instead_of_a_function(tmp_path):
    from trainers.cli import build_config

    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text('{"prompt": "x", "label": "1"}\n')
    cfg = build_config(["--agent", "examples.proxy_openai_agents:agent", "--agent_tasks",
                        str(tasks), "--reward.url", "http://127.0.0.1:9/score"])
    assert cfg.reward.url and cfg.agent_reward is None
    with pytest.raises(ValueError, match="--agent_reward module:fn \\(or --reward.url"):
        build_config(["--agent", "m:f", "--agent_tasks", str(tasks)])
    with pytest.raises(ValueError, match="not both"):
        build_config(["--agent", "m:f", "--agent_tasks", str(tasks), "--agent_reward", "m:g",
                      "--reward.url", "http://127.0.0.1:9/score"])
