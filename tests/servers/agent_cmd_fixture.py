"""A command agent for the --agent_cmd tests, run by a plain `python3 -S` (another interpreter,
no agentrl, no site-packages): stdlib urllib against its session's OPENAI_BASE_URL.

Its task (one JSON object on stdin) says what to do: `prompt`, the chat call's message;
`calls`, how many calls (default 1); `max_tokens`; then `then`: "answer" (print the reply last),
"exit" (exit 3 after the calls, with a line on stderr), "hang" (sleep after the calls), or
"spawn_and_hang" (start a child that sleeps, then sleep). `pid_file`: where to write its pid
(and the child's) for the tests that check nothing outlives the run.
"""

import json
import os
import subprocess
import sys
import time
import urllib.request


def chat(messages, max_tokens):
    body = {"model": "agentrl", "messages": messages, "temperature": 1.0}
    if max_tokens:
        body["max_tokens"] = max_tokens
    req = urllib.request.Request(
        os.environ["OPENAI_BASE_URL"] + "/chat/completions", data=json.dumps(body).encode(),
        headers={"content-type": "application/json",
                 "authorization": "Bearer " + os.environ["OPENAI_API_KEY"]})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())["choices"][0]["message"]["content"] or ""


def main():
    task = json.loads(sys.stdin.readline())
    pids = [os.getpid()]
    messages, reply = [{"role": "user", "content": task.get("prompt", "hi")}], ""
    for _ in range(task.get("calls", 1)):
        reply = chat(messages, task.get("max_tokens"))
        messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": "more"}]
    then = task.get("then", "answer")
    if then == "spawn_and_hang":
        pids.append(subprocess.Popen([sys.executable, "-S", "-c",
                                      "import time; time.sleep(600)"]).pid)
    if task.get("pid_file"):
        with open(task["pid_file"] + ".tmp", "w") as f:
            f.write(" ".join(map(str, pids)))
        os.replace(task["pid_file"] + ".tmp", task["pid_file"])
    print("session", os.environ["AGENTRL_SESSION_ID"], file=sys.stderr)
    if then == "exit":
        print("the agent gave up", file=sys.stderr)
        sys.exit(3)
    if then in ("hang", "spawn_and_hang"):
        time.sleep(600)
    print("thinking...")
    print(reply.replace("\n", " "))


if __name__ == "__main__":
    main()
