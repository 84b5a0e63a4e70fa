"""`agentrl view`: a local, offline web page over a run's trajectories (#35 item 2).

- `index`: one streaming pass over each trajectories JSONL file keeps the byte offset of every
  line and a small summary of its episode (reward, discard, drift, segment, task); a record is
  read from disk by its offset when a page asks for it, so a 10,000-episode run is never held
  in memory. A corrupt line is a summary saying so, with its file and line.
- `source`: what is viewed: a run directory (rollouts/step_N.jsonl, metrics.jsonl), one
  trajectories file (`agentrl rollout` output, a proxy's /export), a proxy's SQLite sessions
  file, or a live `agentrl serve` (its /export, fetched again on reload).
- `trained`: a step's trained/ file (the trainer's log-probs and advantages,
  `agentrl.trained_files`), indexed by the rollouts line each of its lines names; a line that
  is not a trained record is named, file:line, on the turns it would have covered.
- `render`: what a page shows of a record: tokens decoded one by one with their log-prob,
  policy version, advantage and trainer-vs-sampler mismatch; tool calls; images; the group of
  a prompt.
- `app`: a stdlib HTTP server: the static page (`static/`, no build step, no CDN) and its JSON.
"""
