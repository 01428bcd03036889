// Tessera's dashboard: the admin API read with the user's key, kept live by the gateway's
// server-sent events (/v1/cluster/events). No framework, no CDN: plain DOM and SVG.
"use strict";

const $ = (selector) => document.querySelector(selector);
const state = {
  devices: new Map(), stats: [], key: sessionStorage.getItem("tessera-key") || "",
  feed: null, // the AbortController of the open event stream: signing out closes it
};
const DIMENSIONS = ["total", "compute", "memory", "efficiency", "network", "stability"];
const HISTORY = 150; // stats points kept (5 minutes at one every 2 s)

class Unauthorized extends Error {}

function headers(extra = {}) {
  return state.key ? { authorization: `Bearer ${state.key}`, ...extra } : extra;
}

async function api(path, options = {}) {
  const response = await fetch(path, { ...options, headers: headers(options.headers) });
  if (response.status === 401) throw new Unauthorized();
  const body = response.status === 204 ? null : await response.json();
  if (!response.ok) throw new Error(body?.error?.message || response.statusText);
  return body;
}

function element(tag, props = {}, ...children) {
  const node = Object.assign(document.createElement(tag), props);
  for (const child of children) node.append(child);
  return node;
}

function colour(name) {
  let hash = 0;
  for (const c of name) hash = (hash * 31 + c.charCodeAt(0)) >>> 0;
  return `hsl(${hash % 360} 55% 55%)`;
}

// -- sign in ------------------------------------------------------------------------------------
function showLogin(message = "") {
  $("#app").hidden = true;
  $("#login").hidden = false;
  $("#logout").hidden = true;
  $("#login-error").textContent = message;
  $("#status").textContent = "signed out";
  state.feed?.abort();
  state.feed = null;
  clearInterval(state.jobs);
  $("#jobs").replaceChildren();
  state.devices.clear();
  $("#fleet tbody").replaceChildren();
}

$("#login-form").addEventListener("submit", (event) => {
  event.preventDefault();
  state.key = $("#key").value.trim();
  sessionStorage.setItem("tessera-key", state.key);
  start();
});

$("#logout").addEventListener("click", () => {
  state.key = "";
  sessionStorage.removeItem("tessera-key");
  showLogin();
});

// -- fleet --------------------------------------------------------------------------------------
function ratio(value, limit, unit) {
  if (value == null) return "-";
  const share = limit ? Math.min(1, value / limit) : 0;
  const hot = share > 0.9 ? " hot" : "";
  return element("span", { className: `ratio${hot}`, title: `${share * 100 | 0} % of the limit` },
    `${value.toFixed(0)}${limit ? ` / ${limit.toFixed(0)}` : ""} ${unit}`,
    element("i", { style: `width:${share * 100}%` }));
}

// Where a reading comes from (measured, enforced, estimated, emulated), beside it.
function sourced(content, source) {
  if (!source || source === "measured") return content;
  return element("span", {}, content, " ",
    element("small", { className: `source ${source}`, title: "where this reading comes from" },
      source));
}

function renderDevice(row) {
  const sample = row.sample || {};
  const known = state.devices.get(row.device_id) || {};
  const caps = row.capabilities || known.capabilities || {};
  const sources = row.sources || known.sources || {};
  row.capabilities = caps;
  row.sources = sources;
  state.devices.set(row.device_id, row);
  const cells = [
    element("td", { className: "id" }, row.device_id),
    element("td", {}, row.device_class || "?"),
    element("td", { className: `state ${row.state}` }, row.state),
    ...DIMENSIONS.map((d) => element("td", { className: "num" },
      row[d] == null ? "-" : row[d].toFixed(2))),
    element("td", {}, sourced(ratio(sample.temperature_c, caps.thermal_limit_c, "°C"),
      sources.temperature)),
    element("td", {}, sourced(ratio(sample.power_w, caps.max_power_w, "W"), sources.power)),
    element("td", { className: "num" },
      sample.battery_percent == null ? "-" : `${sample.battery_percent.toFixed(0)} %`),
    element("td", { className: "num" },
      sample.measured_tokens_per_s ? sample.measured_tokens_per_s.toFixed(1) : "-"),
    element("td", { className: "num" }, sourced((row.speed_scale ?? 1).toFixed(2), sources.speed)),
  ];
  let tr = $(`#fleet tbody tr[data-device="${CSS.escape(row.device_id)}"]`);
  if (!tr) {
    tr = element("tr");
    tr.dataset.device = row.device_id;
    $("#fleet tbody").append(tr);
  }
  tr.dataset.state = row.state;
  tr.replaceChildren(...cells);
  $("#fleet-count").textContent = `${state.devices.size} devices`;
}

// -- deployments, mode, policy, previews ------------------------------------------------------
async function loadDeployments() {
  const deployments = await api("/v1/cluster/placements");
  const box = $("#deployments");
  if (!deployments.length) return box.replaceChildren(element("p", { className: "muted" }, "none"));
  box.replaceChildren(...deployments.map((d) => {
    const total = d.assignments.reduce((n, a) => n + (a.layer_end - a.layer_start), 0) || 1;
    const bar = element("div", { className: "layers" }, ...d.assignments.map((a) => {
      const layers = a.layer_end - a.layer_start;
      return element("div", {
        className: "shard",
        style: `flex:${layers};background:${colour(a.device_id)}`,
        title: `${a.device_id}: layers ${a.layer_start}–${a.layer_end - 1}, ${a.memory_gb?.toFixed(2)} GB`,
      }, element("b", {}, a.device_id), element("span", {}, `layers ${a.layer_start}–${a.layer_end - 1}`));
    }));
    const phase = d.phase || "serving";
    const percent = Math.round((d.progress || 0) * 100);
    const said = phase === "loading" ? `loading ${percent} %` : phase;
    return element("div", { className: `deployment ${phase}` },
      element("h3", {}, `${d.deployment_id} `, element("span", { className: `phase ${phase}` }, said), " ",
        element("span", { className: "muted" },
          `${d.model} · epoch ${d.epoch} · ${total} layers on ${d.assignments.length} device(s)`)),
      phase === "loading" || phase === "pending"
        ? element("progress", { max: 100, value: percent, title: `${percent} % loaded` }) : "",
      weightsBars(d, phase !== "serving"),
      d.reason && phase !== "serving" ? element("p", { className: "reason" }, d.reason) : "",
      speedLine(d),
      bar);
  }));
}

// A deployment's speed as predicted when it was placed, and as its requests measured since.
function speedLine(d) {
  const said = (s) => [`${s.tokens_per_s_1.toFixed(1)} tokens/s at 1 stream`,
    s.tokens_per_s_8 != null ? `${s.tokens_per_s_8.toFixed(1)} at 8` : "",
    s.ttft_ms != null ? `first token ${Math.round(s.ttft_ms)} ms` : "",
    s.watts_1 != null ? `${Math.round(s.watts_1)} W` : ""].filter(Boolean).join(", ");
  const parts = [];
  if (d.predicted) parts.push(`predicted ${said(d.predicted)}`);
  if (d.measured) parts.push(`measured ${said(d.measured)}`);
  else if (d.predicted && (d.phase || "serving") === "serving") parts.push("measured: no request yet");
  return parts.length ? element("p", { className: "speed muted" }, parts.join(" · ")) : "";
}

// Weights on their way to each device (the feed's "weights" events), by deployment and device:
// a bar per device while its weights move, kept until the deployment serves.
const weights = new Map();
const megabytes = (n) => (n / 1e6).toFixed(1);
function weightsText(w) {
  return `${w.device_id}: ${megabytes(w.bytes_done)} / ${megabytes(w.bytes_total)} MB of weights`;
}
function weightsBars(d, all) {
  const moving = d.assignments.map((a) => weights.get(`${d.deployment_id}/${a.device_id}`))
    .filter((w) => w && (all || w.bytes_done < w.bytes_total));
  if (!moving.length) return "";
  return element("div", { className: "weights" }, ...moving.map((w) => {
    const row = element("div", { className: "weights-row" },
      element("progress", { max: w.bytes_total || 1, value: w.bytes_done }),
      element("span", {}, weightsText(w)));
    row.dataset.key = `${w.deployment_id}/${w.device_id}`;
    return row;
  }));
}
function weightsMoved(event) {
  const key = `${event.deployment_id}/${event.device_id}`;
  weights.set(key, event);
  const row = [...document.querySelectorAll(".weights-row")].find((r) => r.dataset.key === key);
  if (!row) return redrawSoon();
  row.querySelector("progress").max = event.bytes_total || 1;
  row.querySelector("progress").value = event.bytes_done;
  row.querySelector("span").textContent = weightsText(event);
}

// The registry: each model's file, sizes and the deployments of it.
async function loadModels() {
  const models = await api("/v1/cluster/models");
  const box = $("#models");
  if (!models.length) return box.replaceChildren(element("p", { className: "muted" }, "none"));
  const head = ["name", "architecture", "layers", "GB", "types", "context", "deployed"];
  box.replaceChildren(element("table", {},
    element("thead", {}, element("tr", {}, ...head.map((h) => element("th", {}, h)))),
    element("tbody", {}, ...models.map((m) => element("tr", { title: `${m.source} on ${m.origin_host}` },
      element("td", {}, m.name), element("td", {}, m.architecture), element("td", {}, `${m.layers}`),
      element("td", {}, (m.size_bytes / 1e9).toFixed(2)), element("td", {}, m.tensor_types.join(", ")),
      element("td", {}, `${m.context_train}`), element("td", {}, m.deployments.join(", ") || "–"))))));
}

// Batches with a deadline (OpenAI's Batch API): progress, deadline, planned and actual end;
// read again every 2 s while the page is open.
const ENDED = ["completed", "failed", "expired", "cancelled"];
async function loadJobs() {
  const { data } = await api("/v1/batches?limit=20");
  const box = $("#jobs");
  if (!data.length) return box.replaceChildren(element("p", { className: "muted" }, "none"));
  const at = (ts) => (ts ? new Date(ts * 1000).toLocaleTimeString() : "–");
  const head = ["batch", "model", "status", "answered", "deadline", "planned end", "ended", "devices"];
  const rows = data.map((b) => {
    const counts = b.request_counts, done = counts.completed + counts.failed;
    const row = element("tr", { title: b.decision || "" },
      element("td", {}, b.id), element("td", {}, b.model), element("td", {}, b.status),
      element("td", {}, element("progress", { max: counts.total, value: done }), ` ${done}/${counts.total}`),
      element("td", {}, at(b.expires_at)), element("td", {}, at(b.planned_finish_at)),
      element("td", {}, at(ENDED.includes(b.status) ? b[`${b.status}_at`] : null)),
      element("td", {}, ((b.devices || []).join(", ") || "–") +
        (b.edge_deployment ? ` (edge: ${b.edge_deployment})` : "")));
    row.dataset.batch = b.id;
    row.dataset.status = b.status;
    return row;
  });
  box.replaceChildren(element("table", {},
    element("thead", {}, element("tr", {}, ...head.map((h) => element("th", {}, h)))),
    element("tbody", {}, ...rows)));
}

// A deployment's phase or progress changed: drawn again, at most once a second.
let redraw = null;
const phases = new Map();
function deploymentChanged(status) {
  const changed = phases.get(status.deployment_id) !== status.phase;
  phases.set(status.deployment_id, status.phase);
  if (changed && ["serving", "refused", "failed"].includes(status.phase)) {
    const why = status.reason && status.phase !== "serving" ? `: ${status.reason}` : "";
    note(`${status.deployment_id} ${status.phase}${why}`, status.phase === "serving" ? "" : "failed");
  }
  redrawSoon();
}
function redrawSoon() {
  redraw = redraw || setTimeout(() => {
    redraw = null;
    loadDeployments().catch(() => {});
    loadModels().catch(() => {});
  }, 1000);
}

async function loadMode() {
  const mode = await api("/v1/cluster/mode");
  $("#mode").value = mode.manual ? mode.mode : "auto";
  $("#mode").title = `active: ${mode.mode}${mode.manual ? " (set by hand)" : " (automatic)"}`;
  $("#mode").disabled = false;
}

async function loadPolicy() {
  const policy = await api("/v1/cluster/policy");
  $("#policy").replaceChildren(...policy.available.map((p) => element("option", { value: p }, p)));
  $("#policy").value = policy.policy;
  $("#policy").disabled = false;
}

$("#mode").addEventListener("change", async () => {
  try {
    await api("/v1/cluster/mode", { method: "PUT", body: JSON.stringify({ mode: $("#mode").value }),
      headers: { "content-type": "application/json" } });
    await loadMode();
  } catch (error) { note(`mode not changed: ${error.message}`, "error"); }
});

$("#policy").addEventListener("change", async () => {
  try {
    await api("/v1/cluster/policy", { method: "PUT", body: JSON.stringify({ policy: $("#policy").value }),
      headers: { "content-type": "application/json" } });
    note(`policy set to ${$("#policy").value}`);
  } catch (error) { note(`policy not changed: ${error.message}`, "error"); }
});

$("#preview-form").addEventListener("submit", async (event) => {
  event.preventDefault();
  const model = $("#preview-model").value.trim();
  const box = $("#previews");
  box.replaceChildren(element("p", { className: "muted" }, "asking the scheduler…"));
  try {
    const options = await api(`/v1/cluster/previews?model=${encodeURIComponent(model)}`);
    const considered = new Set(options.flatMap((o) => o.devices));
    const left = [...state.devices.keys()].filter((d) => !considered.has(d));
    box.replaceChildren(...options.map((o) => element("div", { className: `preview ${o.feasible ? "" : "infeasible"}` },
      element("h4", {}, `${o.devices.length} device(s): `, o.feasible
        ? `~${o.step_ms.toFixed(2)} ms per token step` : element("span", { className: "error" }, o.reason),
        o.predicted ? `; predicted ${o.predicted.tokens_per_s_1.toFixed(1)} tokens/s at 1 stream, `
          + `${o.predicted.tokens_per_s_8.toFixed(1)} at 8, first token in ${o.predicted.ttft_ms.toFixed(0)} ms, `
          + `${o.predicted.watts_1.toFixed(0)} W` : ""),
      o.feasible ? element("ul", {}, ...o.shards.map((s) => element("li", {},
        `${s.device_id}: layers ${s.layer_start}–${s.layer_end - 1}, ${s.memory_gb.toFixed(2)} GB`))) : "")),
      left.length ? element("p", { className: "muted" },
        `not considered: ${left.join(", ")} (failed, or no worker engine to run shards)`) : "");
  } catch (error) {
    box.replaceChildren(element("p", { className: "error" }, error.message));
  }
});

// -- events and charts -------------------------------------------------------------------------
function note(text, kind = "") {
  const item = element("li", { className: kind }, element("time", {}, new Date().toLocaleTimeString()), " ", text);
  $("#events").prepend(item);
  while ($("#events").children.length > 200) $("#events").lastChild.remove();
}

function chart(id, values) {
  const points = values.filter((v) => v != null);
  const top = Math.max(...points, 1e-9);
  const step = 300 / Math.max(values.length - 1, 1);
  const path = values.map((v, i) => (v == null ? null : `${(i * step).toFixed(1)},${(78 - (v / top) * 74).toFixed(1)}`))
    .filter(Boolean).join(" ");
  const line = document.createElementNS("http://www.w3.org/2000/svg", "polyline");
  line.setAttribute("points", path);
  $(id).replaceChildren(line);
}

function onEvent(event) {
  switch (event.type) {
    case "device":
      renderDevice(event.device);
      break;
    case "failed":
      note(`${event.device_id} failed: silent since ${new Date(event.last_seen_ts * 1000).toLocaleTimeString()}`, "failed");
      break;
    case "recovered":
      note(`${event.device_id} recovered after ${event.down_for_s.toFixed(1)} s`);
      break;
    case "placement":
      note(event.migration
        ? `migration: ${event.task_id} moved to ${event.assignments.map((a) => a.device_id).join(", ")} (epoch ${event.epoch})`
        : `placed ${event.task_id} on ${event.assignments.map((a) => a.device_id).join(", ")}`,
        event.migration ? "migration" : "");
      loadDeployments().catch(() => {});
      break;
    case "deployment":
      deploymentChanged(event);
      break;
    case "weights":
      weightsMoved(event);
      break;
    case "service":
      note(event.state === "failed"
        ? `${event.service} ${event.how}, kept crashing: given up (${event.restarts} restarts)`
        : `${event.service} ${event.how}: started again (restart ${event.restarts})`,
        event.state === "failed" ? "failed" : "restart");
      break;
    case "mode":
      note(`mode ${event.previous} → ${event.mode}: ${event.reason}`, "mode");
      loadMode().catch(() => {});
      break;
    case "stats": {
      state.stats.push(event);
      if (state.stats.length > HISTORY) state.stats.shift();
      chart("#c-tps", state.stats.map((s) => s.tokens_per_s));
      chart("#c-tpj", state.stats.map((s) => s.tokens_per_j));
      chart("#c-ttft", state.stats.map((s) => s.ttft_p50_s));
      $("#v-tps").textContent = event.tokens_per_s.toFixed(1);
      $("#v-tpj").textContent = event.tokens_per_j.toFixed(4);
      $("#v-ttft").textContent = event.ttft_p50_s == null ? "-" : event.ttft_p50_s.toFixed(2);
      break;
    }
  }
}

async function readEvents(response, onData) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      for (const line of block.split("\n")) {
        if (line.startsWith("data: ")) onData(line.slice(6));
      }
    }
  }
}

async function follow() {
  state.feed?.abort();
  const feed = new AbortController();
  state.feed = feed;
  try {
    const response = await fetch("/v1/cluster/events", { headers: headers(), signal: feed.signal });
    if (response.status === 401) return showLogin("that key was refused");
    if (!response.ok) throw new Error(response.statusText);
    $("#status").textContent = "live";
    $("#status").className = "live";
    // An event already read when the user signs out is dropped, never drawn on the login page.
    await readEvents(response, (data) => feed.signal.aborted || onEvent(JSON.parse(data)));
  } catch (error) {
    if (feed.signal.aborted) return;
    console.warn("event stream", error);
  }
  if (feed.signal.aborted) return;
  $("#status").textContent = "reconnecting…";
  $("#status").className = "muted";
  setTimeout(() => state.feed === feed && follow(), 1000);
}

// -- chat ---------------------------------------------------------------------------------------
$("#chat-form").addEventListener("submit", async (event) => {
  event.preventDefault();
  const text = $("#chat-input").value.trim();
  $("#chat-input").value = "";
  $("#chat-log").append(element("p", { className: "user" }, text));
  const answer = element("p", { className: "assistant" });
  $("#chat-log").append(answer);
  try {
    const models = await api("/v1/models");
    if (!models.data.length) throw new Error("no model is deployed");
    const response = await fetch("/v1/chat/completions", {
      method: "POST",
      headers: headers({ "content-type": "application/json" }),
      body: JSON.stringify({ model: models.data[0].id, stream: true, max_tokens: 128, temperature: 0,
        messages: [{ role: "user", content: text }] }),
    });
    if (!response.ok) throw new Error((await response.json()).error?.message || response.statusText);
    await readEvents(response, (data) => {
      if (data === "[DONE]") return;
      const chunk = JSON.parse(data);
      if (chunk.error) throw new Error(chunk.error.message);
      answer.textContent += chunk.choices?.[0]?.delta?.content || "";
    });
    answer.dataset.done = "true";
  } catch (error) {
    answer.append(element("span", { className: "error" }, ` ${error.message}`));
    answer.dataset.done = "error";
  }
});

// -- start --------------------------------------------------------------------------------------
async function start() {
  try {
    const rows = await api("/v1/cluster/devices?limit=1000");
    $("#login").hidden = true;
    $("#app").hidden = false;
    $("#logout").hidden = !state.key;
    rows.forEach(renderDevice);
    await Promise.all([loadDeployments(), loadModels(), loadMode(), loadPolicy(), loadJobs()]);
    clearInterval(state.jobs);
    state.jobs = setInterval(() => loadJobs().catch(() => {}), 2000);
    follow();
  } catch (error) {
    if (error instanceof Unauthorized) showLogin(state.key ? "that key was refused" : "");
    else $("#status").textContent = `error: ${error.message}`;
  }
}

start();
