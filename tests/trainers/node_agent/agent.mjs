// A Node.js agent for `agentrl train --agent_cmd "node agent.mjs"`: the `openai` npm package,
// unmodified, reading its session from OPENAI_BASE_URL and OPENAI_API_KEY; its task is one
// JSON object on stdin; its last stdout line is its answer.
import OpenAI from "openai";

let input = "";
for await (const chunk of process.stdin) input += chunk;
const task = JSON.parse(input.split("\n")[0]);
const client = new OpenAI({ maxRetries: 0 });
const out = await client.chat.completions.create({
  model: "agentrl",
  messages: [{ role: "user", content: task.prompt }],
  max_tokens: task.max_tokens ?? 8,
  temperature: 1.0,
});
console.log((out.choices[0].message.content ?? "").replace(/\n/g, " "));
