// The fleet dashboard: polls /dashboard/api/state (preheat.dashboard/1, docs/dashboard.md) and redraws.
// Plain DOM and SVG, no framework and no build step: the file the package ships is the file that runs.
// Text from replicas (URLs, stage names, findings) only ever goes into textContent/attributes, never innerHTML.
"use strict";

const STATE_URL = "/dashboard/api/state";
const POLL_MS = 1000;
const SVG = "http://www.w3.org/2000/svg";
// Stage colours: fixed for the stages every start has, so two replicas' waterfalls read alike.
const STAGE_COLORS = {
  platform: "#94a3b8", imports: "#a78bfa", config: "#c4b5fd", fetch: "#38bdf8", plan: "#7dd3fc",
  load: "#f97316", weights: "#fb923c", engine: "#fbbf24", warmup: "#facc15", compile: "#e879f9",
  kv_warm: "#34d399", ready: "#22c55e", first_request_ttft: "#16a34a",
};
const PALETTE = ["#60a5fa", "#f472b6", "#2dd4bf", "#a3e635", "#fb7185", "#c084fc", "#fcd34d", "#4ade80"];

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs || {})) {
    if (value === null || value === undefined) continue;
    if (name === "class") node.className = value;
    else node.setAttribute(name, String(value));
  }
  for (const child of children) {
    if (child === null || child === undefined) continue;
    node.append(typeof child === "string" || typeof child === "number" ? String(child) : child);
  }
  return node;
}

function svg(tag, attrs, text) {
  const node = document.createElementNS(SVG, tag);
  for (const [name, value] of Object.entries(attrs || {})) node.setAttribute(name, String(value));
  if (text !== undefined) node.textContent = text;
  return node;
}

const dash = "—";
function pct(x) { return x === null || x === undefined ? dash : `${(100 * x).toFixed(0)}%`; }
function num(x, digits) { return x === null || x === undefined ? dash : Number(x).toFixed(digits || 0); }
function secs(x) { return x < 1 ? `${(x * 1000).toFixed(0)} ms` : `${x.toFixed(x < 10 ? 2 : 1)} s`; }

function stageColor(name) {
  if (STAGE_COLORS[name]) return STAGE_COLORS[name];
  let h = 0;
  for (const c of name) h = (h * 31 + c.charCodeAt(0)) >>> 0;
  return PALETTE[h % PALETTE.length];
}

function bar(fraction, label) {
  const outer = el("span", { class: "bar", title: label });
  const inner = el("span", { class: "fill" });
  inner.style.width = `${Math.max(0, Math.min(1, fraction || 0)) * 100}%`;
  outer.append(inner);
  return outer;
}

function replicaRow(r) {
  const health = r.healthy ? "healthy" : "unhealthy";
  const phase = r.phase && r.phase !== "ok" ? r.phase : "";
  const tiers = Object.entries(r.kv || {});
  const kv = tiers.length
    ? tiers.map(([tier, t]) => el("div", { class: "tier", "data-tier": tier, "data-hit-rate": t.hit_rate ?? "" },
        el("span", { class: "tier-name" }, tier.toUpperCase()), bar(t.hit_rate, `${t.hits} hits, ${t.misses} misses`),
        el("span", { class: "tier-value" }, pct(t.hit_rate)), t.up === 0 ? el("span", { class: "pill bad" }, "down") : null))
    : [el("span", { class: "muted" }, "no KV tiers")];
  const cached = r.cached_share === null ? dash : `${pct(r.cached_share)} of ${r.prompt_tokens}`;
  // Replicas of other engines (vLLM, SGLang) are read from their own metrics: say which, and how full their KV is.
  const engine = r.engine && r.engine !== "preheat" && r.engine !== "unknown" ? r.engine : null;
  const usage = r.kv_usage === null || r.kv_usage === undefined ? null
    : el("div", { class: "tier", "data-testid": "kv-usage" }, el("span", { class: "tier-name" }, "used"),
      bar(r.kv_usage, "share of the KV cache in use"), el("span", { class: "tier-value" }, pct(r.kv_usage)));
  const ttft = r.ttft && r.ttft.p50 !== null ? secs(r.ttft.p50) : dash;
  return el("tr", { "data-replica": r.url, "data-health": health, "data-engine": r.engine || "",
    class: r.healthy ? "" : "down" },
    el("td", { class: "url" }, r.url, r.standby ? el("span", { class: "pill muted-pill" }, "standby") : null,
      engine ? el("span", { class: "pill muted-pill", "data-testid": "engine" }, engine) : null),
    el("td", { class: "health" }, el("span", { class: `pill ${r.healthy ? "good" : "bad"}` }, health),
      phase ? el("span", { class: "phase" }, phase) : null,
      r.error ? el("div", { class: "error", title: r.error }, r.error.replace(/^\S+?: /, "")) : null),
    el("td", { class: "num" }, num(r.in_flight)),
    el("td", { class: "num" }, `${num(r.queue)} · ${num(r.running)}`),
    el("td", { class: "num", "data-testid": "tokens-per-s" }, num(r.tokens_per_s, 1)),
    el("td", { class: "kv" }, ...kv, usage),
    el("td", { class: "num", "data-testid": "cached-share" }, cached),
    el("td", { class: "num", "data-testid": "ttft", title: r.ttft ? `${r.ttft.count} requests` : "" }, ttft),
    el("td", { class: "num" }, num(r.finished)));
}

// The cold start's end: "ready" when the start got there; what came after (the first request's token) is off the axis.
function horizon(w) {
  const ready = w.stages.find((s) => s.name === "ready");
  return ready ? ready.start : Math.max(w.total, ...w.stages.map((s) => s.end ?? s.start));
}

function waterfall(r, scale) {
  const w = r.waterfall;
  const box = el("figure", { class: "waterfall", "data-replica": r.url });
  const ready = w && w.stages.some((s) => s.name === "ready");
  const total = w ? horizon(w) : 0;
  box.append(el("figcaption", {}, el("strong", {}, r.url),
    w ? ` · ${ready ? "ready after" : "starting, so far"} ${secs(total)}` : " · no timeline yet",
    r.healthy ? null : el("span", { class: "pill bad" }, "unhealthy")));
  if (!w || !w.stages.length) return box;
  const left = 150, right = 80, width = 960, row = 18, top = 22;
  const span = width - left - right;
  const x = (t) => left + (t / scale) * span;
  const height = top + w.stages.length * row + 4;
  const chart = svg("svg", { viewBox: `0 0 ${width} ${height}`, width: "100%", role: "img",
    "aria-label": `cold start of ${r.url}` });
  for (const tick of ticks(scale)) {
    chart.append(svg("line", { x1: x(tick), x2: x(tick), y1: top - 4, y2: height, class: "grid" }));
    chart.append(svg("text", { x: x(tick), y: 12, class: "axis", "text-anchor": "middle" }, secs(tick)));
  }
  w.stages.forEach((s, i) => {
    const y = top + i * row;
    const end = s.end ?? total;
    const g = svg("g", { class: s.end === null ? "stage running" : "stage", "data-stage": s.name });
    g.append(svg("title", {}, `${s.name}: ${secs(s.start)} → ${s.end === null ? "running" : secs(s.end)}`));
    g.append(svg("text", { x: left - 8, y: y + 12, class: "label", "text-anchor": "end" }, s.name));
    if (s.start > scale) {  // after the cold start (the first request's token): its time, off the axis
      g.append(svg("path", { d: `M${x(scale)},${y + 2} l7,6.5 l-7,6.5 z`, fill: stageColor(s.name) }));
      g.append(svg("text", { x: x(scale) + 10, y: y + 12, class: "duration" }, `at ${secs(s.start)} →`));
    } else if (end > s.start) {
      g.append(svg("rect", { x: x(s.start), y: y + 2, width: Math.max(1.5, x(Math.min(end, scale)) - x(s.start)),
        height: row - 5,
        rx: 2, fill: stageColor(s.name) }));
      g.append(svg("text", { x: Math.min(x(end), x(scale)) + 5, y: y + 12, class: "duration" },
        secs(end - s.start)));
    } else {  // a mark (ready, first token): a point in time, not a span
      g.append(svg("path", { d: `M${x(s.start)},${y + 2} l5,6.5 l-5,6.5 l-5,-6.5 z`, fill: stageColor(s.name) }));
      g.append(svg("text", { x: x(s.start) + 9, y: y + 12, class: "duration" }, `at ${secs(s.start)}`));
    }
    chart.append(g);
  });
  box.append(chart);
  return box;
}

function ticks(scale) {
  const raw = scale / 6;
  const step = [0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300, 600].find((s) => s >= raw) || raw;
  const out = [];
  for (let t = 0; t <= scale + 1e-9; t += step) out.push(t);
  return out;
}

function decisionRows(rows) {
  const most = Math.max(1, ...rows.map((r) => r.count));
  if (!rows.length) return [el("tr", {}, el("td", { colspan: 4, class: "muted" }, "no request routed yet"))];
  return rows.map((d) => el("tr", { "data-policy": d.policy, "data-reason": d.reason },
    el("td", {}, d.policy), el("td", {}, d.reason), el("td", { class: "num" }, num(d.count)),
    el("td", { class: "wide" }, bar(d.count / most, `${d.count} requests`))));
}

function percent(share) {
  return share === null ? dash : `${Math.round(share * 100)}%`;
}

function fleetRows(shared) {
  return shared.routers.map((r) => el("tr", { "data-router": r.router },
    el("td", {}, r.router === shared.router ? `${r.router} (this one)` : r.router),
    el("td", { class: "num" }, r.age_seconds === null ? dash : `${r.age_seconds.toFixed(1)} s ago`),
    el("td", { class: "num" }, num(r.decisions)),
    el("td", { class: "num" }, percent(r.hit_ratio))));
}

function renderFleet(shared) {
  document.getElementById("fleet-section").hidden = !shared;
  if (!shared) return;
  const age = shared.staleness_seconds === null ? "not read yet" : `view ${shared.staleness_seconds.toFixed(1)} s old`;
  const hits = shared.hit_ratio === null ? "" : ` · fleet cache hits ${percent(shared.hit_ratio)}`;
  const pill = document.getElementById("fleet-status");
  pill.textContent = `${shared.fleet} · ${shared.up ? age : "shared state unreachable: own view only"}${hits}`;
  pill.className = `pill ${shared.up ? "good" : "bad"}`;
  document.querySelector("#fleet tbody").replaceChildren(...fleetRows(shared));
}

function findingItems(state) {
  const doc = state.findings;
  if (!doc) {
    const why = state.findings_error ? `the doctor failed: ${state.findings_error}` :
      state.doctor ? "no findings yet: the doctor is running" :
      "no doctor attached here: run `preheat doctor` on the node (the router's dashboard shows its findings)";
    return [el("li", { class: "muted" }, why)];
  }
  const shown = doc.findings.filter((f) => f.severity !== "ok");
  const quiet = doc.findings.length - shown.length;
  const items = shown.map((f) => el("li", { class: `finding ${f.severity}`, "data-finding": f.id },
    el("div", { class: "finding-head" }, el("span", { class: `pill ${f.severity}` }, f.severity),
      el("strong", {}, f.title), f.seconds !== null ? el("span", { class: "cost" }, `costs ${secs(f.seconds)}`) : null),
    f.fix ? el("p", { class: "fix" }, f.fix) : null,
    Object.keys(f.evidence || {}).length ? el("details", {}, el("summary", {}, "evidence"),
      el("pre", {}, JSON.stringify(f.evidence, null, 1))) : null));
  if (quiet) items.push(el("li", { class: "muted" }, `${quiet} more checks passed`));
  return items;
}

function render(state) {
  document.getElementById("kind").textContent = state.kind === "replica" ? "replica" : "fleet";
  document.getElementById("waterfalls-title").textContent =
    state.kind === "replica" ? "Last cold start" : "Last cold start of each replica";
  document.getElementById("waterfalls-note").textContent = state.kind === "replica"
    ? "Stages of this replica's last start (seconds from its process start, up to ready); a pale bar is a stage under way."
    : "Stages of each replica's last start on one time axis (seconds from its process start, up to ready); a pale bar is a stage under way.";
  const status = document.getElementById("status");
  const healthy = state.replicas.filter((r) => r.healthy).length;
  // Every KV tier's state is in the header ("L2 down on 2/2 replicas"): "ok" alone means all of them are up.
  const tiers = (state.tiers || []).map((t) => t.text);
  status.textContent = [state.status, ...tiers, `${healthy}/${state.replicas.length} healthy`].join(" · ");
  status.className = `pill ${state.status === "ok" ? "good" : state.status === "degraded" ? "warn" : "bad"}`;
  document.getElementById("policy").textContent = state.policy ? `policy ${state.policy}` : "";
  document.getElementById("updated").textContent = `updated ${new Date(state.time * 1000).toLocaleTimeString()}`;
  document.querySelector("#replicas tbody").replaceChildren(...state.replicas.map(replicaRow));
  const scale = Math.max(0.001, ...state.replicas.filter((r) => r.waterfall).map((r) => horizon(r.waterfall)));
  document.getElementById("waterfalls").replaceChildren(...state.replicas.map((r) => waterfall(r, scale)));
  document.getElementById("decisions-section").hidden = state.kind !== "router";
  document.querySelector("#decisions tbody").replaceChildren(...decisionRows(state.decisions));
  renderFleet(state.shared);
  const doctor = document.getElementById("doctor-status");
  doctor.textContent = state.findings ? state.findings.status : "";
  doctor.className = state.findings ? `pill ${state.findings.status}` : "";
  document.getElementById("findings").replaceChildren(...findingItems(state));
}

function problem(text) {
  const node = document.getElementById("problem");
  node.hidden = !text;
  node.textContent = text || "";
}

async function poll() {
  try {
    const answer = await fetch(STATE_URL, { cache: "no-store", credentials: "same-origin" });
    if (answer.status === 401) {
      window.location.assign("/dashboard");  // the key changed or the cookie went: log in again
      return;
    }
    if (!answer.ok) throw new Error(`${STATE_URL} answered ${answer.status}`);
    render(await answer.json());
    problem(null);
    document.body.dataset.loaded = "true";
  } catch (error) {
    problem(`lost contact with the server (${error.message}); retrying`);
  }
  window.setTimeout(poll, POLL_MS);
}

poll();
