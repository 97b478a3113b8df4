// The dashboard: reads the public JSON endpoints (no token, as the API allows), follows the selected job's
// server-sent events, and draws its charts with uPlot, served from /static/vendor (no CDN: clusters are often
// offline).  The one write, cancel, sends the token typed in the header, as the API requires.
// `window.dashboard.charts[slot]` holds each slot's uPlot charts, so a test can read what they plot.
"use strict";

const LABELS = { te_default: "TE default", preset: "NVIDIA preset", torch_fused: "PyTorch fused op" };
// The comparison bars, beside the winner and serial: the baselines with these labels (`autotune/tuner/baselines.py`),
// where a trial measured them.  No study measures PyTorch's fused op yet (bench/overlap_bench.py does): its bar
// appears once a baseline carries the label.
const FORMATS = [
  { format: "nemo", title: "YAML", ext: "yaml", type: "application/yaml" },
  { format: "te", title: "TE dict", ext: "json", type: "application/json" },
  { format: "bridge", title: "Bridge module", ext: "py", type: "text/x-python" },
];
// A format the controller does not serve (a 422 for the format) gets no tab.

const state = { selected: null, events: null, charts: {}, presets: {}, format: "nemo", jobShown: null, drawing: Promise.resolve(), finished: {} };
window.dashboard = state;

function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
  for (const c of children) node.append(c instanceof Node ? c : document.createTextNode(String(c ?? "")));
  return node;
}

function shapeText(s) {
  return `h${s.hidden} tp${s.tp} mbs${s.mbs} seq${s.seq} ${s.dtype}`;
}

function ms(value) {
  return value == null ? "∞" : `${value.toFixed(3)} ms`;
}

function percent(fraction) {
  // Floor, never round: 99.5% is not done, and the API never sends more than 1.
  return Math.floor(100 * Math.min(1, Math.max(0, fraction)));
}

function progress(p) {
  const pct = percent(p.fraction);
  return el("span", { class: "progress", "data-fraction": p.fraction, "data-done": p.done, "data-total": p.total },
    el("span", { class: "bar" }, el("span", { style: `width:${pct}%` })), ` ${pct}% · ${p.done}/${p.total} trials`);
}

function say(text) {
  document.getElementById("message").textContent = text;
}

async function getJSON(url) {
  const r = await fetch(url);
  if (!r.ok) throw new Error(`${url}: ${r.status}`);
  return r.json();
}

async function allTrials(id) {
  const items = [];
  for (let offset = 0; offset != null;) {
    const page = await getJSON(`/v1/jobs/${id}/trials?limit=1000&offset=${offset}`);
    items.push(...page.items);
    offset = page.next_offset;
  }
  return items;
}

function token() {
  return document.getElementById("token").value.trim();
}

async function cancel(id) {
  const headers = token() ? { Authorization: `Bearer ${token()}` } : {};
  const r = await fetch(`/v1/jobs/${id}/cancel`, { method: "POST", headers });
  if (r.ok) {
    say("");
  } else {
    const body = await r.json().catch(() => ({}));
    say(`cancel: ${r.status} ${(body.detail || []).map(d => `${d.field}: ${d.rule}`).join("; ")}`);
  }
  refreshJobs();
}

// --- jobs and workers -------------------------------------------------------------------------------------

async function refreshJobs() {
  const page = await getJSON("/v1/jobs?limit=20");
  // A finished job's view no longer changes: fetched once, then kept.
  const jobs = await Promise.all(page.items.map(async job => state.finished[job.id] ?? getJSON(`/v1/jobs/${job.id}`)));
  for (const job of jobs) if (job.status !== "queued" && job.status !== "running") state.finished[job.id] = job;
  const body = document.getElementById("jobs");
  body.replaceChildren(...jobs.map(job => {
    const active = job.status === "queued" || job.status === "running";
    const button = el("button", { type: "button", class: "cancel" }, "cancel");
    button.onclick = event => { event.stopPropagation(); cancel(job.id); };
    const row = el("tr", { class: "job" + (job.id === state.selected ? " selected" : ""), "data-job": job.id },
      el("td", {}, el("code", {}, job.id.slice(0, 8))),
      el("td", { class: job.status }, job.status),
      el("td", {}, progress(job.progress)),
      el("td", {}, shapeText(job.shape)),
      el("td", {}, job.layers.length),
      el("td", {}, job.backend + (job.gpu ? ` (${job.gpu})` : "")),
      el("td", {}, new Date(job.created_at).toLocaleString()),
      el("td", {}, active ? button : ""));
    row.onclick = () => follow(job.id);
    return row;
  }));
  if (!jobs.length) body.replaceChildren(el("tr", {}, el("td", { colspan: 8, class: "muted" }, "no jobs yet")));
}

function gpus(w) {
  if (!w.gpus.length) return "—";
  return w.gpus.map(g => `${g.index}: ${g.name}` + (g.memory_total_mib ? ` ${Math.round(g.memory_total_mib / 1024)} GiB` : "")
    + (g.sm_count ? ` ${g.sm_count} SMs` : "") + (g.nvlink_active ? ` NVLink×${g.nvlink_active}` : "")).join(", ");
}

async function refreshWorkers() {
  const workers = await getJSON("/v1/workers");
  document.getElementById("workers").replaceChildren(...workers.map(w => el("tr", {},
    el("td", {}, w.name), el("td", {}, w.host), el("td", {}, w.backend),
    el("td", {}, gpus(w)),
    el("td", { class: w.status }, w.status),
    el("td", {}, new Date(w.last_heartbeat).toLocaleTimeString()))));
}

// --- one job: slots, charts, preset -------------------------------------------------------------------

function fastest(trial) {
  // The trial's fastest valid measurement (a finalist trial measured several configs), or null.
  const ms = (trial.measurement?.measurements || []).filter(m => m.valid && m.overlap_ms != null);
  return ms.length ? ms.reduce((a, b) => (b.overlap_ms < a.overlap_ms ? b : a)) : null;
}

function historyData(trials) {
  // One point per finished trial, in queue order: its overlap ms (a gap when it failed) and the best so far.
  const done = trials.filter(t => t.state === "complete" || t.state === "failed");
  let best = null;
  const xs = [], ys = [], bests = [];
  done.forEach((t, i) => {
    const m = t.state === "complete" ? fastest(t) : null;
    if (m && (best == null || m.overlap_ms < best)) best = m.overlap_ms;
    xs.push(i + 1);
    ys.push(m ? m.overlap_ms : null);
    bests.push(best);
  });
  return [xs, ys, bests];
}

// The CPU backend (gloo between CPU processes) shows that the service works, not what a GPU gains: its share
// hidden means nothing, as `autotune best` and `tune` say beside their tables.
const CPU_NOTE = "measured on the CPU backend (gloo between CPU processes), whose times show that the service " +
  "works, not what a GPU gains; tune on GPUs for numbers to use";

function onCpu(job) {
  return job.backend === "cpu";
}

function hiddenText(job, m) {
  return onCpu(job) ? "n/a (CPU backend)" : `${Math.round(100 * m.hidden_frac)}%`;
}

function comparison(slot, trials, outcome) {
  // [name, exposed ms, hidden %] for the winner, serial and each labelled baseline that was measured.  TE's
  // default comes from the decision when it was re-measured beside the finalists (the numbers `autotune best`
  // compares the winner with: same rounds); else, as the others, from its trial in the search.
  const won = slot.best?.measurement;
  if (!won) return [];
  const rows = [["winner", won.overlap_ms - won.gemm_ms, 100 * won.hidden_frac],
    ["serial", won.serial_ms - won.gemm_ms, 0]];
  for (const [label, name] of Object.entries(LABELS)) {
    const trial = trials.find(t => (t.config.labels || []).includes(label) && t.state === "complete");
    const m = (label === "te_default" && outcome?.te_default_measurement) || (trial && fastest(trial));
    if (m) rows.push([name, m.overlap_ms - m.gemm_ms, 100 * m.hidden_frac]);
  }
  return rows;
}

async function loadOutcomes(job) {
  // Each decided slot's decision, where this job made it: GET /v1/best for the job's shape.  That answer may be
  // up to AUTOTUNE_BEST_CACHE_S (1 s) old, older than the slot just decided: ask again until it has them all.
  const decided = job.slots.filter(s => s.best?.final).map(s => s.slot);
  let outcomes = {};
  for (let attempt = 0; attempt < 4; attempt++) {
    if (attempt) await new Promise(resolve => setTimeout(resolve, 600));
    const r = await fetch(`/v1/best?${presetQuery(job)}`);
    if (!r.ok) return outcomes;
    outcomes = {};
    for (const group of (await r.json()).results) {
      for (const layer of group.layers) if (layer.job_id === job.id && layer.outcome) outcomes[layer.slot] = layer.outcome;
    }
    if (decided.every(slot => slot in outcomes)) break;
  }
  return outcomes;
}

function fromZero(u, min, max) {
  // Bars and times start at 0, or they exaggerate small differences; a bit of room above the largest.
  const lo = Math.min(0, min ?? 0), hi = Math.max(0, max ?? 1);
  return [lo * 1.05, hi === lo ? lo + 1 : hi * 1.05];
}

function lineChart(target, data, width) {
  return new uPlot({
    width, height: 190, scales: { x: { time: false }, y: { range: fromZero } },
    axes: [{ label: "trial", incrs: [1, 2, 5, 10, 20, 50, 100, 200, 500] }, { label: "overlap ms", size: 60 }],
    series: [{ label: "trial" },
      { label: "overlap ms", stroke: "#89a", width: 0, points: { show: true, size: 6, fill: "#36c" } },
      { label: "best so far", stroke: "#2a7", width: 2, points: { show: false } }],
  }, data, target);
}

function barChart(target, names, values, label, color, width) {
  const xs = names.map((_, i) => i);
  const chart = new uPlot({
    width, height: 190,
    scales: { x: { time: false, range: [-0.5, names.length - 0.5] }, y: { range: fromZero } },
    axes: [{ splits: () => xs, values: (u, splits) => splits.map(i => names[i] ?? ""), gap: 4 },
      { label, size: 60 }],
    series: [{ label: "config", value: (u, i) => names[i] ?? "" },
      { label, fill: color, stroke: color, paths: uPlot.paths.bars({ size: [0.6, 60] }), points: { show: false } }],
    legend: { show: false },
  }, [xs, values], target);
  chart.names = names;  // which bar is which, for whoever reads the chart (the dashboard test)
  return chart;
}

function chartBox(title, kind, points) {
  return el("div", { class: "chart", "data-chart": kind, "data-points": points }, el("div", { class: "chart-title" }, title));
}

function showSlots(job, trials, outcomes) {
  for (const charts of Object.values(state.charts)) for (const c of Object.values(charts)) c.destroy();
  state.charts = {};
  const width = Math.max(280, Math.min(420, (document.body.clientWidth - 80) / 3));
  const cards = job.slots.map(s => {
    const mine = trials.filter(t => t.slot === s.slot);
    const history = historyData(mine);
    const rows = comparison(s, mine, outcomes[s.slot]);
    const best = s.best;
    const m = best?.measurement;
    const head = el("div", { class: "slot-head" }, el("strong", {}, s.slot), el("span", { class: s.status }, s.status),
      `${s.n_complete} ok, ${s.n_failed} failed`,
      best ? el("span", {}, best.final ? "winner " : "best so far ", el("code", {}, JSON.stringify(best.config))) : "",
      m ? `${ms(m.overlap_ms)} · exposed ${ms(m.overlap_ms - m.gemm_ms)} · hidden ${hiddenText(job, m)} (serial ${ms(m.serial_ms)})` : "",
      // The fastest config TE runs exactly as measured: what the NeMo YAML and the TE dict carry.
      el("span", { class: "te-exact" }, "TE-exact ",
        s.te_exact ? el("code", {}, JSON.stringify(s.te_exact.config)) : "none measured",
        s.te_exact ? ` ${ms(s.te_exact.measurement.overlap_ms)}` : ""));
    const boxes = [chartBox("optimization history: overlap ms per trial, best so far", "history", history[0].length)];
    if (rows.length) {
      boxes.push(chartBox("exposed ms (lower is better)", "exposed", rows.length));
      boxes.push(onCpu(job)
        ? el("div", { class: "chart na", "data-chart": "hidden", title: CPU_NOTE }, el("div", { class: "chart-title" },
          "hidden % of the collective"), `n/a: ${CPU_NOTE}`)
        : chartBox("hidden % of the collective", "hidden", rows.length));
    }
    const card = el("div", { class: "slot", "data-slot": s.slot }, head, el("div", { class: "charts" }, ...boxes));
    return { card, slot: s.slot, history, rows, boxes };
  });
  document.getElementById("slots").replaceChildren(...cards.map(c => c.card));
  for (const { slot, history, rows, boxes } of cards) {
    const charts = { history: lineChart(boxes[0], history, width) };
    if (rows.length) {
      const names = rows.map(r => r[0]);
      charts.exposed = barChart(boxes[1], names, rows.map(r => r[1]), "exposed ms", "#c73", width);
      if (!onCpu(job)) charts.hidden = barChart(boxes[2], names, rows.map(r => r[2]), "hidden %", "#3a7", width);
    }
    state.charts[slot] = charts;
  }
}

function presetQuery(job) {
  // The job's shape as given (unset fields left out) and where it ran: the CPU backend's winners are filed under "cpu".
  const q = new URLSearchParams();
  for (const [k, v] of Object.entries(job.shape)) if (v != null) q.set(k, String(v));
  const gpu = job.gpu ?? (job.backend === "cpu" ? "cpu" : null);
  if (gpu) q.set("gpu", gpu);
  if (job.consumer) q.set("consumer", job.consumer);  // the presets made for the job's consumer
  return q;
}

function switchesText(switches) {
  // A consumer's switches as its users write them: Megatron flags and config fields, or arguments.
  if (switches.flags) {
    const config = Object.entries(switches.config).map(([k, v]) => `${k}=${v}`).join(", ");
    return switches.flags.join(" ") + (config ? ` · TransformerConfig: ${config}` : "");
  }
  const one = switches.model_config ?? switches.transformer_layer;
  if (one) return Object.entries(one).map(([k, v]) => `${k}=${v}`).join(", ");
  return Object.entries(switches.modules).map(([m, args]) =>
    `${m}: ${Object.entries(args).filter(([, v]) => v).map(([k]) => k).join(", ") || "no overlap"}`).join(" · ");
}

function showConsumer(job) {
  // The job's consumer: the joint winner's switches and every setting's summed time, the chosen one first.
  const box = document.getElementById("consumer");
  const c = job.consumer_choice;
  if (!c) {
    box.replaceChildren(job.consumer ? el("p", { class: "muted" }, `for ${job.consumer}: once every slot is decided`) : "");
    return;
  }
  const rows = c.alternatives.slice(0, 4).map((a, i) => el("tr", { class: i === 0 ? "chosen" : "" },
    el("td", {}, a.label), el("td", {}, a.total_ms == null ? "not measured" : ms(a.total_ms))));
  box.replaceChildren(
    el("p", {}, el("strong", {}, `for ${c.consumer}: `), el("code", {}, switchesText(c.switches))),
    el("table", { class: "alternatives" }, el("thead", {}, el("tr", {}, el("th", {}, "switches"),
      el("th", {}, `summed ms of ${c.coupled.join(", ")}`))), el("tbody", {}, ...rows)));
}

async function loadPresets(job) {
  const query = presetQuery(job);
  const presets = {};
  for (const f of FORMATS) {
    query.set("format", f.format);
    const r = await fetch(`/v1/presets?${query}`);
    if (!r.ok) continue;
    const disposition = r.headers.get("content-disposition") || "";
    const base = `ub_cfg_${job.shape_key}`;
    const name = /filename="([^"]+)"/.exec(disposition)?.[1]?.replace(/\.yaml$/, `.${f.ext}`) ?? `${base}.${f.ext}`;
    presets[f.format] = { ...f, text: await r.text(), name, measured: r.headers.get("x-autotune-measured") === "true" };
  }
  state.presets = presets;
  if (!presets[state.format]) state.format = "nemo";
  showPreset();
}

function showPreset() {
  const tabs = FORMATS.filter(f => state.presets[f.format]).map(f => {
    const b = el("button", { type: "button", role: "tab", "data-format": f.format, "aria-selected": String(f.format === state.format) }, f.title);
    b.onclick = () => { state.format = f.format; showPreset(); };
    return b;
  });
  document.getElementById("preset-tabs").replaceChildren(...tabs);
  const p = state.presets[state.format];
  document.getElementById("preset").textContent = p ? p.text : "no preset yet";
  document.getElementById("preset-note").textContent = !p ? "" : p.measured
    ? `measured by this service · ${p.name}` : "NOT MEASURED: nothing tuned for this shape yet, this is the nearest known preset";
}

async function copyPreset() {
  const p = state.presets[state.format];
  if (!p) return;
  try {
    await navigator.clipboard.writeText(p.text);
  } catch {
    const range = document.createRange();  // no clipboard API (plain http on another host): select it instead
    range.selectNodeContents(document.getElementById("preset"));
    getSelection().removeAllRanges();
    getSelection().addRange(range);
    document.execCommand("copy");
  }
  document.getElementById("copied").textContent = `copied ${p.title}`;
}

function downloadPreset() {
  const p = state.presets[state.format];
  if (!p) return;
  const a = el("a", { href: URL.createObjectURL(new Blob([p.text], { type: p.type })), download: p.name });
  document.body.append(a);
  a.click();
  a.remove();
  URL.revokeObjectURL(a.href);
}

async function showJob(job) {
  document.getElementById("job").hidden = false;
  document.getElementById("job-title").textContent = `Job ${job.id.slice(0, 8)} · ${shapeText(job.shape)}`;
  document.getElementById("job-head").replaceChildren(el("span", { class: job.status }, job.status), " ",
    progress(job.progress), job.error ? ` · ${job.error}` : "");
  showConsumer(job);
  const trials = await allTrials(job.id);
  const decided = job.slots.some(s => s.best?.final);
  showSlots(job, trials, decided ? await loadOutcomes(job) : {});
  if (decided) await loadPresets(job);
  state.jobShown = job;
}

function follow(id) {
  state.selected = id;
  state.presets = {};
  showPreset();
  if (state.events) state.events.close();
  state.events = new EventSource(`/v1/jobs/${id}/events`);
  // One redraw at a time, in the order the events came: a slow trial fetch must not draw over a newer view.
  state.events.addEventListener("progress", e => {
    const job = JSON.parse(e.data);
    state.drawing = state.drawing.then(() => showJob(job)).catch(err => say(String(err)));
  });
  state.events.addEventListener("done", () => { state.events.close(); refreshJobs(); });
  refreshJobs();
}

function tick() {
  refreshJobs().catch(err => say(String(err)));
  refreshWorkers().catch(err => say(String(err)));
}

const saved = sessionStorage.getItem("autotune-token");
if (saved) document.getElementById("token").value = saved;
document.getElementById("token").onchange = () => sessionStorage.setItem("autotune-token", token());
document.getElementById("copy-preset").onclick = () => copyPreset();
document.getElementById("download-preset").onclick = () => downloadPreset();
tick();
setInterval(tick, 5000);
