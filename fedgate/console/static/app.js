// The fleet console: /api/fleet every 2 s, drawn with the DOM (text only: device ids and
// topics come from devices, never as HTML).
"use strict";

const REFRESH_MS = 2000;

function el(tag, attrs, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === "class") e.className = v; else e.setAttribute(k, v);
  }
  for (const c of children) e.append(c instanceof Node ? c : document.createTextNode(String(c)));
  return e;
}

function num(v, digits = 1) {
  return v === null || v === undefined || Number.isNaN(v) ? "-" : Number(v).toFixed(digits);
}

function fill(tableId, rows) {
  const body = document.querySelector(`#${tableId} tbody`);
  body.replaceChildren(...rows);
}

function drawRegions(regions) {
  const cards = regions.map((r) =>
    el("div", { class: `card ${r.state}`, "data-region": r.name, "data-state": r.state },
      el("h3", {}, r.name, " ", el("span", { class: "state" }, r.state)),
      el("div", {}, "devices: ", el("b", { class: "devices" }, r.devices)),
      el("div", {}, "readings/s: ", num(r.readings_per_s)),
      el("div", {}, ...r.gateways.map((g) =>
        el("span", { class: g.up === null ? "" : (g.up ? "node-up" : "node-down"), "data-node": g.node },
          g.node, " "))),
      el("div", { class: "quiet" }, `DNS for ${r.dns_network || "-"}: `,
        r.dns_answer.length ? r.dns_answer.join(", ") : "no answer")));
  document.getElementById("regions").replaceChildren(...cards);
}

function draw(v) {
  drawRegions(v.regions || []);
  fill("hops", (v.hops || []).map((h) =>
    el("tr", {}, el("td", {}, h.hop), el("td", { class: "num" }, `${num(h.per_s)} /s`))));
  const p99 = Object.entries(v.latency_p99_s || {}).map(([r, s]) =>
    el("tr", {}, el("td", {}, `gateway -> Kafka p99, ${r}`), el("td", { class: "num" }, `${num(s * 1000, 0)} ms`)));
  document.querySelector("#hops tbody").append(...p99);
  const waiting = v.waiting || [];
  fill("waiting", waiting.map((w) =>
    el("tr", {}, el("td", {}, w.node), el("td", {}, w.queue), el("td", { class: "num" }, num(w.messages, 0)))));
  document.getElementById("nothing-waits").hidden = waiting.length > 0;
  fill("routers", [
    ...(v.routers || []).map((r) => el("tr", { "data-router": r.node },
      el("td", { class: r.up ? "node-up" : "node-down" }, r.node),
      el("td", {}, r.up ? (r.leading ? "routes commands" : "stands by for commands") : "down"),
      el("td", { class: "shards" }, r.shards && r.shards.length ? `reads shards ${r.shards.join(", ")}` : ""))),
    ...(v.engines || []).map((e) => el("tr", {},
      el("td", { class: e.up ? "node-up" : "node-down" }, e.node), el("td", {}, e.job), el("td", {}))),
  ]);
  const t = v.tables || {};
  fill("tables", [
    el("tr", {}, el("td", {}, "last rows landed"), el("td", { class: "num" }, `${num(t.last_commit_age_s)} s ago`)),
    el("tr", {}, el("td", {}, "freshness p95 (5 min)"), el("td", { class: "num" }, `${num(t.freshness_p95_s)} s`)),
    el("tr", {}, el("td", {}, "records not read yet"), el("td", { class: "num" }, num(t.records_behind, 0))),
  ]);
  const alerts = v.alerts || [];
  fill("alerts", alerts.map((a) =>
    el("tr", { class: `${a.state} ${a.severity}`, "data-alert": a.name },
      el("td", {}, a.name), el("td", {}, a.severity), el("td", {}, a.state), el("td", {}, a.summary))));
  document.getElementById("no-alerts").hidden = alerts.length > 0;
  fill("commands", (v.commands || []).map((c) =>
    el("tr", { class: `outcome-${c.outcome}`, "data-command": c.command_id },
      el("td", {}, c.at ? new Date(c.at).toLocaleTimeString() : "-"),
      el("td", {}, c.device), el("td", {}, c.topic), el("td", { class: "outcome" }, c.outcome),
      el("td", {}, c.region), el("td", { class: "quiet" }, (c.steps || []).join(" > ")),
      el("td", { class: "quiet" }, c.command_id))));
  const problems = document.getElementById("problems");
  problems.replaceChildren(...(v.errors || []).map((e) => el("div", {}, e)));
  problems.hidden = !(v.errors || []).length;
  document.getElementById("updated").textContent =
    `updated ${new Date(v.at_ms).toLocaleTimeString()}`;
}

async function refresh() {
  try {
    const r = await fetch("/api/fleet", { cache: "no-store" });
    if (!r.ok) throw new Error(`HTTP ${r.status}`);
    draw(await r.json());
  } catch (e) {
    document.getElementById("updated").textContent = `no answer from the console: ${e.message}`;
  } finally {
    setTimeout(refresh, REFRESH_MS);
  }
}

refresh();
