// agentrl view: the page. Every string from the server goes in as text (textContent, text
// nodes, attribute values), never as markup; the server's Content-Security-Policy runs no
// script but this file.
"use strict";

const state = {step: null, offset: 0, limit: 50, total: 0, record: null, colour: "logprob"};

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === null || v === undefined || v === false) continue;
    if (k === "on") for (const [ev, fn] of Object.entries(v)) node.addEventListener(ev, fn);
    else if (k === "style") Object.assign(node.style, v);
    else node.setAttribute(k, String(v));
  }
  for (const c of children) {
    if (c === null || c === undefined) continue;
    node.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
  return node;
}

// replaceChildren and append write a null as the text "null": leave the absent out.
function present(...nodes) { return nodes.filter(n => n !== null && n !== undefined); }

function fmt(x, digits) {
  if (x === null || x === undefined) return "";
  if (typeof x !== "number") return String(x);
  return Number.isInteger(x) ? String(x) : x.toFixed(digits === undefined ? 3 : digits);
}

async function api(path, params) {
  const url = path + "?" + new URLSearchParams(params || {}).toString();
  const response = await fetch(url);
  const body = await response.json();
  if (!response.ok) throw new Error(body.error || response.statusText);
  return body;
}

function showError(e) {
  const box = document.getElementById("error");
  box.textContent = e ? String(e.message || e) : "";
  box.hidden = !e;
}

// ------------------------------------------------------------------------------- steps
async function loadRun() {
  const run = await api("/api/run");
  document.getElementById("target").textContent = run.target + " (" + run.kind + ")";
  const meta = [];
  meta.push("tokenizer: " + (run.tokenizer || "none"));
  if (run.tokenizer_error) meta.push("(" + run.tokenizer_error + ")");
  meta.push("advantage: " + (run.estimator || "not recorded") +
            (run.steps.some(s => s.trained) ? " (the trainer's, from trained/)" : ""));
  if (run.env) meta.push("env: " + run.env);
  document.getElementById("run-meta").textContent = meta.join(" · ");
  state.run = run;
  const body = document.querySelector("#steps tbody");
  body.replaceChildren(...run.steps.map(s => el("tr", {
    class: "step-row", "data-step": s.key,
    on: {click: () => selectStep(s.key)},
  }, el("td", {}, s.key), el("td", {}, s.episodes), el("td", {}, fmt(s.mean_reward)),
     el("td", {}, s.discarded || ""), el("td", {}, s.drift || ""),
     el("td", {class: s.corrupt ? "bad" : ""}, s.corrupt || ""))));
  if (state.step === null && run.steps.length) await selectStep(run.steps[0].key);
  else if (state.step !== null) await selectStep(state.step, true);
}

async function selectStep(key, keepOffset) {
  state.step = key;
  if (!keepOffset) state.offset = 0;
  for (const row of document.querySelectorAll(".step-row"))
    row.classList.toggle("selected", row.dataset.step === key);
  const step = state.run.steps.find(s => s.key === key);
  const metrics = document.getElementById("metrics");
  metrics.replaceChildren();
  if (step && step.metrics) {
    metrics.append(el("h3", {}, "step " + key + " metrics"));
    const dl = el("dl", {id: "step-metrics"});
    for (const [k, v] of Object.entries(step.metrics)) {
      if (k === "step") continue;
      dl.append(el("dt", {}, k), el("dd", {}, fmt(v)));
    }
    metrics.append(dl);
  }
  await loadEpisodes();
}

// ----------------------------------------------------------------------------- episodes
function filters() {
  const v = id => document.getElementById(id).value;
  return {rmin: v("f-rmin"), rmax: v("f-rmax"), discarded: v("f-discarded"),
          drift: v("f-drift"), corrupt: v("f-corrupt"), task: v("f-task")};
}

async function loadEpisodes() {
  const all = document.getElementById("f-all").checked;
  const page = await api("/api/episodes", {
    step: all ? "all" : state.step, offset: state.offset, limit: state.limit, ...filters()});
  state.total = page.total;
  document.getElementById("episodes-title").textContent =
    all ? "Episodes of every step" : "Episodes of step " + state.step;
  const last = Math.min(page.offset + page.rows.length, page.total);
  document.getElementById("page-info").textContent =
    page.total ? (page.offset + 1) + "–" + last + " of " + page.total : "none";
  const body = document.querySelector("#episodes tbody");
  body.replaceChildren(...page.rows.map(episodeRow));
}

function badges(s) {
  const out = [];
  if (s.corrupt) out.push(el("span", {class: "badge bad corrupt"}, "corrupt: " + s.corrupt));
  if (s.discard) out.push(el("span", {class: "badge discard", title: s.reason}, "discarded: " + s.reason));
  if (s.drift) out.push(el("span", {class: "badge drift"}, "drift"));
  if (s.segment_cause && s.segment_cause !== "start")
    out.push(el("span", {class: "badge segment"}, "segment " + s.segment + " (" + s.segment_cause + ")"));
  if (s.truncated) out.push(el("span", {class: "badge"}, "truncated"));
  return out;
}

function episodeRow(s) {
  const open = () => openEpisode(s.step, s.line);
  return el("tr", {class: "episode-row" + (s.corrupt ? " corrupt-row" : ""),
                   "data-step": s.step, "data-line": s.line, on: {click: open}},
    el("td", {}, s.step), el("td", {}, s.line),
    el("td", {}, s.group === null ? "" : el("a", {href: "#", class: "group-link", on: {click: e => {
      e.preventDefault(); e.stopPropagation(); openGroup(s.step, s.group); }}}, s.group)),
    el("td", {}, fmt(s.reward)), el("td", {}, fmt(s.advantage)), el("td", {}, s.turns),
    el("td", {}, s.tokens), el("td", {}, s.versions ? s.versions.join("–") : ""),
    el("td", {}, s.task), el("td", {}, ...badges(s)));
}

// ------------------------------------------------------------------------------ episode
// A click's answer that arrives after a later click's is dropped (it would show the older one).
const latest = {episode: 0, turn: 0};

async function openEpisode(step, line) {
  showError(null);
  const mine = ++latest.episode;
  latest.turn++;  // a turn still loading belongs to the episode left
  const pane = document.getElementById("episode");
  document.getElementById("turn").replaceChildren();
  document.getElementById("group").replaceChildren();
  let ep;
  try {
    ep = await api("/api/episode", {step, line});
  } catch (e) {
    if (mine !== latest.episode) return;
    pane.replaceChildren(el("h2", {}, "step " + step + ", line " + line),
                         el("p", {class: "bad corrupt"}, String(e.message)));
    return;
  }
  if (mine !== latest.episode) return;
  state.record = {step, line, ep};
  const s = ep.summary;
  const parts = Object.entries(ep.reward_parts);
  pane.replaceChildren(...present(
    el("h2", {}, "Episode " + s.uid + " (step " + step + ", line " + line + ")"),
    el("p", {}, "reward " + fmt(s.reward) + " · advantage " + advantageText(ep) +
       " · " + s.turns + " turns · " + s.tokens + " tokens · " +
       (s.terminated ? "terminated" : s.truncated ? "truncated" : "unfinished"), " ", ...badges(s)),
    parts.length ? el("p", {class: "parts"}, "reward parts: " +
      parts.map(([k, v]) => k + " = " + fmt(v)).join(", ")) : null,
    ep.segments.length > 1 ? el("p", {class: "segments"}, "segments: ",
      ...ep.segments.map(g => el("a", {href: "#", class: "segment-link", on: {click: e => {
        e.preventDefault(); openEpisode(step, g.line); }}},
        "#" + g.segment + " " + (g.segment_cause || "") + (g.drift ? " (drift)" : "") + " "))) : null,
    ep.group.length > 1 ? el("button", {type: "button", id: "open-group", on: {click: () =>
      openGroup(step, s.group)}}, "group " + s.group + ": " + ep.group.length + " samples side by side") : null,
    el("div", {class: "turn-list"}, ...ep.turns.map(t => el("button", {
      type: "button", class: "turn-button", "data-turn": t.index,
      on: {click: () => openTurn(step, line, t.index)}},
      "turn " + t.index + ": r " + fmt(t.reward) + ", v" + t.versions.join("→") +
      ", " + t.action_tokens + " tok, " + t.finish_reason))),
    el("details", {}, el("summary", {}, "info"), el("pre", {class: "info"}, ep.info)),
  ));
  if (ep.turns.length) await openTurn(step, line, 0);
}

// The trainer's (its trained/ file: the mean over the episode's trained tokens), or recomputed.
function advantageText(ep) {
  if (ep.advantage_source === "trainer")
    return ep.advantage === null ? "none (not trained on)" : fmt(ep.advantage) + " (the trainer's)";
  return ep.advantage === null ? "not recomputed" : fmt(ep.advantage) + " (recomputed)";
}

// --------------------------------------------------------------------------------- turn
const COLOURS = {
  logprob: t => t[2] === null ? null : `hsl(${Math.round(120 * Math.exp(t[2]))}, 75%, 82%)`,
  advantage: t => t[4] === null ? null : (t[4] >= 0
    ? `hsl(120, 70%, ${Math.round(95 - 25 * Math.min(1, t[4] / 2))}%)`
    : `hsl(0, 70%, ${Math.round(95 - 25 * Math.min(1, -t[4] / 2))}%)`),
  version: t => `hsl(${(t[3] * 67) % 360}, 60%, 84%)`,
  mismatch: t => t[5] === null ? null : `hsl(0, 75%, ${Math.round(95 - 30 * Math.min(1, Math.abs(t[5])))}%)`,
};

function tokenSpan(t) {
  const colour = COLOURS[state.colour](t);
  const title = "id " + t[0] + " · logprob " + fmt(t[2]) + " · version " + t[3] +
    " · advantage " + (t[4] === null ? "n/a" : fmt(t[4])) +
    (t[5] === null ? "" : " · mismatch " + fmt(t[5]));
  return el("span", {class: "tok", "data-id": t[0], "data-logprob": t[2], "data-version": t[3],
                     "data-mismatch": t[5], title, style: colour ? {background: colour} : null}, t[1]);
}

async function openTurn(step, line, turn) {
  const mine = ++latest.turn;
  const data = await api("/api/turn", {step, line, turn});
  if (mine !== latest.turn) return;
  state.turn = data;
  for (const b of document.querySelectorAll(".turn-button"))
    b.classList.toggle("selected", Number(b.dataset.turn) === turn);
  renderTurn();
}

function renderTurn() {
  const d = state.turn, r = state.record;
  const select = el("select", {id: "colour", on: {change: e => { state.colour = e.target.value; renderTurn(); }}},
    ...Object.keys(COLOURS).map(k => el("option", {value: k, selected: k === state.colour}, k)));
  const images = d.images.map(im => el("img", {class: "shot", alt: "image " + im.index,
    src: "/api/image?" + new URLSearchParams({step: r.step, line: r.line, index: im.index})}));
  document.getElementById("turn").replaceChildren(...present(
    el("h3", {}, "Turn " + d.turn + " of " + d.turns + " · reward " + fmt(d.reward) +
       " · " + d.finish_reason),
    el("label", {}, "colour by ", select),
    d.mismatch_recorded ? el("span", {class: "note", id: "mismatch-note"},
      " (mismatch: sampler minus trainer log-prob, the trainer's before its update)")
      : el("span", {class: "note", id: "mismatch-note"},
      " (no mismatch: " + d.trained_note + "; the step's mismatch metric is beside the episodes)"),
    d.decoded ? null : el("span", {class: "note"}, " (no tokenizer: tokens shown as ids)"),
    el("h4", {}, "observation (" + d.observation.length + " tokens)"),
    ...images,
    el("pre", {class: "observation", id: "observation"},
       ...d.observation.map(t => el("span", {class: "otok", "data-id": t[0]}, t[1]))),
    el("h4", {}, "sampled (" + d.action.length + " tokens)"),
    el("pre", {class: "action", id: "action"}, ...d.action.map(tokenSpan)),
    d.tool_calls.length ? el("h4", {}, "tool calls") : null,
    ...d.tool_calls.map(c => el("pre", {class: "tool-call"},
      c.error ? "invalid: " + c.error : c.name + "(" + c.arguments + ")")),
  ));
}

// -------------------------------------------------------------------------------- group
async function openGroup(step, group) {
  const g = await api("/api/group", {step, group});
  document.getElementById("group").replaceChildren(
    el("h3", {}, "Group " + g.group + " of step " + g.step + " (advantage: " +
       (g.advantage_source === "trainer" ? "the trainer's" : g.advantage_source
        ? "recomputed, " + g.advantage_source : "not recorded") + ")"),
    el("div", {class: "side-by-side", id: "side-by-side"}, ...g.members.map(m =>
      el("div", {class: "sample" + (m.discard ? " discarded" : "")},
        el("div", {class: "sample-head"}, "line " + m.line + " · reward " + fmt(m.reward) +
           " · advantage " + (m.advantage === null ? "n/a" : fmt(m.advantage)), " ", ...badges(m)),
        el("pre", {}, m.text + (m.cut ? " …" : ""))))));
}

// -------------------------------------------------------------------------------- start
function start() {
  document.getElementById("reload").addEventListener("click", () => loadRun().catch(showError));
  document.getElementById("filters").addEventListener("submit", e => {
    e.preventDefault(); state.offset = 0; loadEpisodes().catch(showError); });
  document.getElementById("prev").addEventListener("click", () => {
    if (state.offset === 0) return;
    state.offset = Math.max(0, state.offset - state.limit); loadEpisodes().catch(showError); });
  document.getElementById("next").addEventListener("click", () => {
    if (state.offset + state.limit >= state.total) return;
    state.offset += state.limit; loadEpisodes().catch(showError); });
  loadRun().then(() => document.body.setAttribute("data-ready", "1")).catch(showError);
}

document.addEventListener("DOMContentLoaded", start);
