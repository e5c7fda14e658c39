// The dashboard page: one server-sent event stream (/dashboard/events) read with fetch, so that an admin
// key can travel as a bearer token; points are drawn with uPlot (vendored). No build step, no CDN.
"use strict";
(function () {
  const MAX_POINTS = 3600;
  const GiB = 2 ** 30;
  const state = { points: [], replica: "", admin: false, numPointMessages: 0, numHistory: 0, tenants: null,
                  connected: false, lastError: null };
  window.tfDashboard = state; // read by the browser tests

  // field(p): the value plotted; replica-level fields follow the selected replica, the meter's are totals
  const R = (name) => (p) => {
    if (!state.replica) return p[name];
    const r = (p.replicas || []).find((x) => x.name === state.replica);
    return r ? r[name] : null;
  };
  const T = (name) => (p) => p[name];
  const scaled = (f, k) => (p) => { const v = f(p); return v == null ? null : v * k; };
  const CHARTS = [
    { id: "tokens", title: "Tokens/s (trailing 10 s)", series: [["in (prompt)", R("tokens_in_s"), "#2563eb"],
                                             ["out (generated)", R("tokens_out_s"), "#16a34a"]] },
    { id: "power", title: "Power (W) and joules per output token", series: [
        ["watts", T("watts"), "#dc2626", "W"], ["J/token", T("joules_per_token"), "#9333ea", "J"]] },
    { id: "cost", title: "$ per million output tokens (device time + energy)", series: [
        ["$/Mtok", T("usd_per_mtok"), "#b45309"]] },
    { id: "busy", title: "Device busy vs idle (share of device time)", series: [
        ["busy", T("busy"), "#0891b2"], ["idle", T("idle"), "#9ca3af"]], range: [0, 1] },
    { id: "memory", title: "Memory (GiB): weights, KV cache used, KV cache free", series: [
        ["weights", scaled(R("weight_bytes"), 1 / GiB), "#4b5563"],
        ["KV used", scaled(R("kv_used_bytes"), 1 / GiB), "#ea580c"],
        ["KV free", scaled(R("kv_free_bytes"), 1 / GiB), "#fdba74"]] },
    { id: "kv", title: "KV usage, queue depth and preemptions", series: [
        ["KV usage", R("kv_usage"), "#ea580c", "share"], ["waiting", R("waiting"), "#2563eb", "n"],
        ["running", R("running"), "#16a34a", "n"], ["preemptions", R("preemptions"), "#dc2626", "n"]] },
    { id: "cache", title: "Prefix-cache hit rate and speculative acceptance", series: [
        ["prefix hits", R("prefix_hit_rate"), "#7c3aed"], ["spec acceptance", R("spec_acceptance"), "#db2777"]],
      range: [0, 1] },
    { id: "latency", title: "TTFT and TPOT, p50 / p99 (s)", series: [
        ["TTFT p50", T("ttft_p50"), "#2563eb"], ["TTFT p99", T("ttft_p99"), "#93c5fd"],
        ["TPOT p50", T("tpot_p50"), "#16a34a"], ["TPOT p99", T("tpot_p99"), "#86efac"]] },
  ];
  const TILES = [
    ["tokens out/s", R("tokens_out_s"), 1], ["tokens in/s", R("tokens_in_s"), 1], ["watts", T("watts"), 1],
    ["J/token", T("joules_per_token"), 3], ["$/Mtok", T("usd_per_mtok"), 3], ["busy", T("busy"), "%"],
    ["KV usage", R("kv_usage"), "%"], ["waiting", R("waiting"), 0], ["running", R("running"), 0],
    ["prefix hits", R("prefix_hit_rate"), "%"], ["TTFT p50 s", T("ttft_p50"), 3], ["TPOT p50 s", T("tpot_p50"), 3],
  ];
  const plots = {};

  function fmt(v, digits) {
    if (v == null || Number.isNaN(v)) return "–";
    if (digits === "%") return (100 * v).toFixed(0) + " %";
    return Number(v).toLocaleString(undefined, { maximumFractionDigits: digits, minimumFractionDigits: 0 });
  }

  function build() {
    const charts = document.getElementById("charts");
    for (const c of CHARTS) {
      const box = document.createElement("div");
      box.className = "chart";
      box.id = "chart-" + c.id;
      box.dataset.points = "0";
      box.innerHTML = `<h3>${c.title}</h3>`;
      charts.appendChild(box);
      const opts = {
        width: Math.max(box.clientWidth - 8, 300), height: 170,
        scales: { x: { time: true }, y: c.range ? { range: c.range } : { auto: true } },
        series: [{}, ...c.series.map(([label, , stroke]) => ({ label, stroke, width: 1.5, spanGaps: false }))],
        axes: [{}, { size: 50 }], legend: { live: false },
      };
      plots[c.id] = { chart: c, plot: new uPlot(opts, [[], ...c.series.map(() => [])], box), box };
    }
    const tiles = document.getElementById("tiles");
    for (const [label] of TILES) {
      const t = document.createElement("div");
      t.className = "tile";
      t.innerHTML = `<div class="v">–</div><div class="k">${label}</div>`;
      tiles.appendChild(t);
    }
  }

  function render() {
    const pts = state.points;
    const xs = pts.map((p) => p.t);
    for (const { chart, plot, box } of Object.values(plots)) {
      const ys = chart.series.map(([, f]) => pts.map((p) => { const v = f(p); return v == null ? null : v; }));
      plot.setData([xs, ...ys]);
      box.dataset.points = String(ys.reduce((n, s) => Math.max(n, s.filter((v) => v != null).length), 0));
    }
    const last = pts[pts.length - 1];
    const tiles = document.querySelectorAll("#tiles .tile .v");
    TILES.forEach(([, f, digits], i) => { tiles[i].textContent = last ? fmt(f(last), digits) : "–"; });
  }

  function updateReplicas(point) {
    const select = document.getElementById("replica");
    const names = (point.replicas || []).map((r) => r.name);
    const have = Array.from(select.options).map((o) => o.value).filter((v) => v);
    for (const name of names) {
      if (!have.includes(name)) select.add(new Option(`replica ${name}`, name));
    }
  }

  function cell(v, digits) { return `<td>${fmt(v, digits)}</td>`; }
  function esc(s) { return String(s).replace(/[&<>"']/g, (c) => `&#${c.charCodeAt(0)};`); }

  function renderTenants(msg) {
    state.tenants = msg;
    document.getElementById("tenant-section").hidden = false;
    document.getElementById("month").textContent = msg.month || "";
    document.querySelector("#tenants tbody").innerHTML = msg.tenants.map((t) =>
      `<tr><td>${esc(t.name)}</td>${cell(t.requests, 0)}${cell(t.tokens, 0)}${cell(t.joules, 1)}` +
      `${cell(t.usd, 6)}<td>${t.budget ? esc(t.budget) : "–"}</td>${cell(t.budget_left, 4)}</tr>`).join("");
    document.querySelector("#recent tbody").innerHTML = msg.recent.map((r) =>
      `<tr><td>${esc(r.created_at.slice(0, 19))}</td><td>${esc(r.tenant)}</td><td>${esc(r.status)}</td>` +
      `${cell(r.prompt_tokens, 0)}${cell(r.cached_tokens, 0)}${cell(r.completion_tokens, 0)}` +
      `${cell(r.energy_joules, 2)}${cell(r.cost_usd, 6)}${cell(r.ttft_s, 3)}${cell(r.latency_s, 3)}</tr>`).join("");
  }

  function onMessage(msg) {
    if (msg.type === "history") {
      state.admin = msg.admin;
      state.numHistory = msg.points.length;
      state.points = msg.points.slice(-MAX_POINTS);
      if (state.points.length) updateReplicas(state.points[state.points.length - 1]);
      render();
    } else if (msg.type === "point") {
      state.numPointMessages += 1;
      state.points.push(msg.point);
      if (state.points.length > MAX_POINTS) state.points.shift();
      updateReplicas(msg.point);
      render();
    } else if (msg.type === "tenants") {
      renderTenants(msg);
    }
  }

  function setStatus(text, cls) {
    const s = document.getElementById("status");
    s.textContent = text;
    s.className = "status " + (cls || "");
  }

  async function connect() {
    const key = sessionStorage.getItem("tf-dashboard-key");
    const headers = key ? { Authorization: "Bearer " + key } : {};
    let response;
    try {
      response = await fetch("/dashboard/events", { headers, cache: "no-store" });
    } catch (e) {
      return retry("cannot reach the server");
    }
    if (response.status === 401 || response.status === 403) {
      const body = await response.json().catch(() => ({}));
      state.lastError = { status: response.status, message: (body.error || {}).message || "" };
      document.getElementById("login").hidden = false;
      document.getElementById("login-reason").textContent = state.lastError.message;
      setStatus(`refused (${response.status})`, "error");
      return;
    }
    if (!response.ok || !response.body) return retry(`HTTP ${response.status}`);
    document.getElementById("login").hidden = true;
    state.connected = true;
    setStatus("live", "live");
    const reader = response.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      let chunk;
      try { chunk = await reader.read(); } catch (e) { break; }
      if (chunk.done) break;
      buffer += decoder.decode(chunk.value, { stream: true });
      let end;
      while ((end = buffer.indexOf("\n\n")) >= 0) {
        const event = buffer.slice(0, end);
        buffer = buffer.slice(end + 2);
        for (const line of event.split("\n")) {
          if (line.startsWith("data: ")) onMessage(JSON.parse(line.slice(6)));
        }
      }
    }
    state.connected = false;
    retry("disconnected");
  }

  function retry(why) {
    setStatus(`${why}: reconnecting…`, "error");
    setTimeout(connect, 2000);
  }

  document.getElementById("login").addEventListener("submit", (e) => {
    e.preventDefault();
    sessionStorage.setItem("tf-dashboard-key", document.getElementById("key").value.trim());
    connect();
  });
  document.getElementById("replica").addEventListener("change", (e) => { state.replica = e.target.value; render(); });
  build();
  connect();
})();
