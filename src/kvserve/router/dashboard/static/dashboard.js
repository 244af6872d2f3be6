// The kvserve router's dashboard: fetch dashboard/data every second and show it.
// Every number sits in an element with data-fleet, data-worker + data-field or
// data-decision attributes, so tests (and operators' scripts) can read what is shown.
"use strict";

const REFRESH_MS = 1000;
const COLORS = ["#3366cc", "#dc8a00", "#109618", "#990099", "#0099c6", "#dd4477", "#66aa00", "#b82e2e"];
const FLEET_COLOR = "#1d2330";

function int(value) {
  return value === null || value === undefined ? "–" : String(Math.round(value));
}
function fixed(value, digits) {
  return value === null || value === undefined ? "–" : value.toFixed(digits);
}
function ms(seconds) {
  return seconds === null || seconds === undefined ? "–" : (seconds * 1000).toFixed(1);
}
function percent(fraction) {
  return fraction === null || fraction === undefined ? "–" : (fraction * 100).toFixed(1) + "%";
}

function element(tag, text, attributes) {
  const node = document.createElement(tag);
  if (text !== undefined) node.textContent = text;
  for (const [name, value] of Object.entries(attributes || {})) node.setAttribute(name, value);
  return node;
}

function card(label, value, field) {
  const node = element("div", undefined, { class: "card" });
  node.append(element("div", label, { class: "label" }));
  node.append(element("div", value, { class: "value", "data-fleet": field }));
  return node;
}

function renderFleet(data) {
  const fleet = data.fleet;
  const kv = fleet.kv;
  const window = data.history.fleet.window || {};
  document.getElementById("fleet").replaceChildren(
    card("workers healthy", `${fleet.healthy_workers} / ${fleet.workers}`, "workers"),
    card("in flight", int(fleet.in_flight_requests), "in_flight_requests"),
    card("prefill tokens in flight", int(fleet.in_flight_prefill_tokens), "in_flight_prefill_tokens"),
    card("requests", int(fleet.requests), "requests"),
    card("errors", int(fleet.errors), "errors"),
    card("requests / s", fixed(window.requests_per_s, 2), "requests_per_s"),
    card("tokens / s", fixed(window.tokens_per_s, 1), "tokens_per_s"),
    card("TTFT mean ms", ms(window.ttft_mean_s), "ttft_mean_ms"),
    card("TTFT p50 / p99 ms", `${ms(window.ttft_p50_s)} / ${ms(window.ttft_p99_s)}`, "ttft_quantiles_ms"),
    card("KV blocks used", `${int(kv.blocks.used)} / ${int(kv.blocks.total)}`, "blocks_used"),
    card("KV blocks cached", int(kv.blocks.cached), "blocks_cached"),
    card("prefix hit rate", percent(kv.prefix_cache.hit_rate), "hit_rate"),
  );
}

function renderWorkers(data) {
  const rows = data.workers.map((worker) => {
    const kv = worker.kv || { blocks: {}, prefix_cache: {} };
    const window = (data.history.workers[worker.id] || {}).window || {};
    const row = element("tr");
    const name = element("td");
    name.append(element("b", worker.id), " ", element("span", worker.url, { class: "url" }));
    row.append(name);
    const health = worker.healthy ? "up" : "down";
    const cell = (text, field) =>
      row.append(element("td", text, { "data-worker": worker.id, "data-field": field }));
    cell(`${health} · ${worker.circuit}`, "health");
    row.lastChild.className = health;
    cell(int(worker.in_flight_requests), "in_flight_requests");
    cell(int(worker.in_flight_prefill_tokens), "in_flight_prefill_tokens");
    cell(int(worker.requests), "requests");
    cell(int(worker.errors), "errors");
    cell(ms(window.ttft_mean_s), "ttft_mean_ms");
    cell(ms(window.ttft_p99_s), "ttft_p99_ms");
    cell(`${fixed(window.requests_per_s, 2)} · ${fixed(window.tokens_per_s, 1)}`, "throughput");
    cell(int(kv.running), "running");
    cell(int(kv.waiting), "waiting");
    cell(int(kv.blocks.used), "blocks_used");
    cell(int(kv.blocks.cached), "blocks_cached");
    cell(int(kv.blocks.free), "blocks_free");
    cell(int(kv.blocks.total), "blocks_total");
    const host = kv.host_tier;
    cell(host ? `${host.blocks} / ${host.capacity}` : "–", "host_tier");
    cell(percent(kv.prefix_cache.hit_rate), "hit_rate");
    cell(`${int(kv.prefix_cache.hit_tokens)} / ${int(kv.prefix_cache.queried_tokens)}`, "hit_tokens");
    return row;
  });
  document.querySelector("#workers tbody").replaceChildren(...rows);
}

function renderDecisions(data) {
  const reasons = data.decisions.by_reason.map((d) => {
    const row = element("tr");
    row.append(element("td", d.policy), element("td", d.reason));
    row.append(element("td", int(d.count), { "data-decision": `${d.policy}/${d.reason}` }));
    return row;
  });
  document.querySelector("#decision-reasons tbody").replaceChildren(...reasons);
  const recent = data.decisions.recent.map((d) => {
    const row = element("tr", undefined, { "data-recent": "" });
    const time = new Date(d.time * 1000).toLocaleTimeString();
    row.append(element("td", time), element("td", d.worker, { "data-field": "worker" }));
    row.append(element("td", d.policy), element("td", d.reason, { "data-field": "reason" }));
    row.append(element("td", percent(d.matched_fraction)), element("td", d.prefill_worker || ""));
    return row;
  });
  document.querySelector("#recent-decisions tbody").replaceChildren(...recent);
}

// One polyline per series, broken where a point is null (no request in that interval).
function renderChart(id, t, series, scale) {
  const svg = document.getElementById(id);
  const width = 400, height = 120, left = 30, bottom = 12, top = 6;
  const values = series.flatMap((s) => s.points).filter((v) => v !== null);
  const max = Math.max(1e-9, ...values.map((v) => v * scale));
  const span = t.length ? Math.max(1, -t[0]) : 1;
  const x = (ti) => left + (width - left) * (1 + ti / span);
  const y = (v) => height - bottom - (height - bottom - top) * (v * scale / max);
  const ns = "http://www.w3.org/2000/svg";
  const nodes = [];
  const line = (x1, y1, x2, y2) => {
    const node = document.createElementNS(ns, "line");
    Object.entries({ x1, y1, x2, y2, class: "axis" }).forEach(([k, v]) => node.setAttribute(k, v));
    return node;
  };
  nodes.push(line(left, top, left, height - bottom), line(left, height - bottom, width, height - bottom));
  const label = (text, xPos, yPos, anchor) => {
    const node = document.createElementNS(ns, "text");
    node.textContent = text;
    Object.entries({ x: xPos, y: yPos, "text-anchor": anchor }).forEach(([k, v]) => node.setAttribute(k, v));
    return node;
  };
  nodes.push(label(values.length ? max.toPrecision(3) : "", left - 3, top + 8, "end"));
  nodes.push(label("0", left - 3, height - bottom, "end"));
  nodes.push(label(`-${Math.round(span)} s`, left, height - 1, "start"));
  nodes.push(label("now", width, height - 1, "end"));
  for (const s of series) {
    let segment = [];
    const flush = () => {
      if (segment.length === 1) {  // a lone point between gaps: a dot, not an empty line
        const node = document.createElementNS(ns, "circle");
        Object.entries({ cx: segment[0][0], cy: segment[0][1], r: 2, fill: s.color })
          .forEach(([k, v]) => node.setAttribute(k, v));
        nodes.push(node);
      } else if (segment.length > 1) {
        const node = document.createElementNS(ns, "polyline");
        node.setAttribute("points", segment.map((p) => p.join(",")).join(" "));
        node.setAttribute("stroke", s.color);
        nodes.push(node);
      }
      segment = [];
    };
    s.points.forEach((v, i) => {
      if (v === null) flush();
      else segment.push([x(t[i]).toFixed(1), y(v).toFixed(1)]);
    });
    flush();
  }
  svg.replaceChildren(...nodes);
}

function renderCharts(data) {
  const history = data.history;
  const ids = data.workers.map((w) => w.id);
  const color = (i) => COLORS[i % COLORS.length];
  const series = (key) => [
    { color: FLEET_COLOR, points: history.fleet[key] },
    ...ids.map((id, i) => ({ color: color(i), points: (history.workers[id] || {})[key] || [] })),
  ];
  renderChart("chart-requests", history.t, series("requests_per_s"), 1);
  renderChart("chart-ttft", history.t, series("ttft_mean_s"), 1000);
  renderChart("chart-tokens", history.t, series("tokens_per_s"), 1);
  const legend = [["fleet", FLEET_COLOR], ...ids.map((id, i) => [id, color(i)])].map(([name, c]) => {
    const entry = element("span");
    const swatch = element("i");
    swatch.style.background = c;
    entry.append(swatch, name);
    return entry;
  });
  document.getElementById("legend").replaceChildren(...legend);
}

let renders = 0;

async function refresh() {
  const status = document.getElementById("status");
  try {
    const response = await fetch("dashboard/data", { cache: "no-store", credentials: "same-origin" });
    if (!response.ok) throw new Error(`dashboard/data answered ${response.status}`);
    const data = await response.json();
    document.getElementById("policy").textContent = `policy: ${data.policy}`;
    renderFleet(data);
    renderWorkers(data);
    renderDecisions(data);
    renderCharts(data);
    renders += 1;
    document.body.dataset.renders = String(renders);
    status.textContent = `updated ${new Date(data.time * 1000).toLocaleTimeString()}`;
    status.className = "";
  } catch (error) {
    status.textContent = String(error);
    status.className = "error";
  } finally {
    setTimeout(refresh, REFRESH_MS);
  }
}

refresh();
