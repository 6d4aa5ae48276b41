// The queued web console: reads /stats.json (and, on a queue's page, the queue's head view
// /api/queues/<name>) every POLL_MS and redraws. Everything from the server, queue names
// and item bytes above all, goes into the page through textContent, never innerHTML.
// No inline script or style: the Content-Security-Policy allows only this file.
"use strict";

const POLL_MS = 1500;
// Requests go to location.origin: a page opened as http://user:pw@host/ has a base URL
// that fetch() refuses to resolve against.
const url = (path) => new URL(path, location.origin).href;
const $ = (id) => document.getElementById(id);

// -- formatting ------------------------------------------------------------------------

function fmtInt(n) { return n === undefined || n === null ? "–" : Number(n).toLocaleString("en"); }

function fmtBytes(n) {
  if (n === undefined || n === null) return "–";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let v = Number(n), u = 0;
  while (v >= 1024 && u < units.length - 1) { v /= 1024; u += 1; }
  return u === 0 ? `${v} B` : `${v.toFixed(1)} ${units[u]}`;
}

function fmtAge(ms) {
  if (ms === undefined || ms === null) return "–";
  if (ms <= 0) return "0";
  const s = ms / 1000;
  if (s < 1) return `${Math.round(ms)} ms`;
  if (s < 120) return `${s.toFixed(1)} s`;
  if (s < 7200) return `${(s / 60).toFixed(1)} min`;
  if (s < 172800) return `${(s / 3600).toFixed(1)} h`;
  return `${(s / 86400).toFixed(1)} d`;
}

function fmtRate(r) { return r === null ? "–" : r < 10 ? r.toFixed(1) : Math.round(r).toLocaleString("en"); }

// -- rates from counters ---------------------------------------------------------------

// name -> {t, puts, gets} of the last poll; rates are the counters' change per second.
const previous = new Map();

function rates(name, fields, now) {
  const puts = fields.total_items, gets = fields.gets;
  const before = previous.get(name);
  previous.set(name, { t: now, puts, gets });
  if (!before || now <= before.t) return { put: null, get: null };
  const dt = (now - before.t) / 1000;
  // A counter that went down (the queue was deleted and made again) restarts the rate.
  const per = (a, b) => (a >= b ? (a - b) / dt : null);
  return { put: per(puts, before.puts), get: per(gets, before.gets) };
}

// -- tables ----------------------------------------------------------------------------

function cell(row, text, cls) {
  const td = document.createElement("td");
  td.textContent = text;
  if (cls) td.className = cls;
  row.appendChild(td);
  return td;
}

function link(name) {
  const a = document.createElement("a");
  a.href = "/queues/" + encodeURIComponent(name);
  a.textContent = name;
  return a;
}

// Rows keyed by name, updated in place (no flicker, selections survive).
function render(tbody, entries, columns) {
  const seen = new Set();
  for (const [name, values] of entries) {
    seen.add(name);
    let row = tbody.querySelector(`tr[data-name="${CSS.escape(name)}"]`);
    if (!row) {
      row = document.createElement("tr");
      row.dataset.name = name;
      const first = cell(row, "", "name");
      first.appendChild(link(name));
      for (const col of columns) cell(row, "").dataset.col = col;
      tbody.appendChild(row);
    }
    for (const col of columns) {
      row.querySelector(`td[data-col="${col}"]`).textContent = values[col];
    }
  }
  for (const row of Array.from(tbody.rows)) {
    if (!seen.has(row.dataset.name)) row.remove();
  }
}

const COLUMNS = ["state", "items", "bytes", "delayed", "open", "readers", "oldest", "puts",
                 "gets"];
const READER_COLUMNS = ["state", "items", "bytes", "delayed", "open", "waiters", "oldest",
                        "puts", "gets"];

function figures(name, f, readers, now) {
  const r = rates(name, f, now);
  return {
    state: f.paused ? "paused" : "",  // (pause/resume: its gets wait)
    items: fmtInt(f.items),
    bytes: fmtBytes(f.bytes),
    delayed: fmtInt(f.delayed ?? 0),  // reported by servers with delayed delivery
    open: fmtInt(f.open_transactions),
    readers: fmtInt(readers),
    waiters: fmtInt(f.waiters),
    oldest: fmtAge(f.oldest_item_age_msec),
    puts: fmtRate(r.put),
    gets: fmtRate(r.get),
  };
}

const queueOf = (name) => name.split("+")[0];

// -- charts: the last 15 minutes, from /api/history (inline SVG, no library) -----------

const SVG_NS = "http://www.w3.org/2000/svg";
const HISTORY_MS = 10000;  // the server samples every 10 s
let history = { queues: {} };

// One small chart: each series a polyline, all scaled to the largest value among them.
function chart(series, w, h, label) {
  const svg = document.createElementNS(SVG_NS, "svg");
  svg.setAttribute("width", w);
  svg.setAttribute("height", h);
  svg.setAttribute("viewBox", `0 0 ${w} ${h}`);
  svg.setAttribute("class", "chart");
  let max = 0;
  for (const s of series) for (const v of s.values) max = Math.max(max, v);
  svg.dataset.max = String(max);
  const title = document.createElementNS(SVG_NS, "title");
  title.textContent = `${label}, last 15 min (max ${fmtRate(max)})`;
  svg.appendChild(title);
  for (const s of series) {
    // One point so far (a page opened soon after the start): a flat line at its value.
    const values = s.values.length === 1 ? [s.values[0], s.values[0]] : s.values;
    const n = values.length;
    if (n === 0) continue;
    const x = (i) => ((i * w) / (n - 1)).toFixed(1);
    const y = (v) => (h - 1 - (max > 0 ? (v / max) * (h - 2) : 0)).toFixed(1);
    const line = document.createElementNS(SVG_NS, "polyline");
    line.setAttribute("points", values.map((v, i) => `${x(i)},${y(v)}`).join(" "));
    line.setAttribute("class", s.cls);
    svg.appendChild(line);
  }
  return svg;
}

function charts(name, w, h) {
  const q = history.queues[name];
  if (!q) return [];
  return [
    chart([{ values: q.items, cls: "depth" }], w, h, `${name}: items waiting`),
    chart([{ values: q.puts, cls: "puts" }, { values: q.gets, cls: "gets" }], w, h,
          `${name}: puts/s (green) and gets/s (orange)`),
  ];
}

// The chart cells of every row of `tbody` (made once per row, redrawn from `history`).
function drawRowCharts(tbody) {
  for (const row of Array.from(tbody.rows)) {
    let cells = row.querySelectorAll("td[data-chart]");
    if (cells.length === 0) {
      for (const kind of ["depth", "rates"]) cell(row, "", "chart").dataset.chart = kind;
      cells = row.querySelectorAll("td[data-chart]");
    }
    const drawn = charts(row.dataset.name, 120, 24);
    cells.forEach((td, i) => td.replaceChildren(...(drawn[i] ? [drawn[i]] : [])));
  }
}

async function pollHistory(draw) {
  try {
    const { status, body } = await getJson("/api/history");
    if (status === 200 && body) {
      history = body;
      draw();
    }
  } catch (e) {
    // the stats poll reports the server unreachable
  }
}

// -- polling ---------------------------------------------------------------------------

async function getJson(path) {
  const resp = await fetch(url(path), { cache: "no-store", credentials: "same-origin" });
  let body = null;
  try { body = await resp.json(); } catch (e) { body = null; }
  return { status: resp.status, body };
}

function setStatus(text, stale) {
  const el = $("status");
  el.textContent = text;
  el.classList.toggle("stale", Boolean(stale));
}

async function pollStats(draw) {
  try {
    const { status, body } = await getJson("/stats.json");
    if (status !== 200 || !body) {
      setStatus(`/stats.json: HTTP ${status}`, true);
      return;
    }
    $("server").textContent = `version ${body.server.version}, up ${fmtAge(body.server.uptime * 1000)}`;
    draw(body.queues, performance.now());
    setStatus(`updated ${new Date().toLocaleTimeString("en-GB")}`, false);
  } catch (e) {
    setStatus(`cannot reach the server (${e.message})`, true);
  }
}

function every(fn) {
  fn();
  setInterval(fn, POLL_MS);
}

// -- the queues page -------------------------------------------------------------------

function drawIndex(queues, now) {
  const names = Object.keys(queues).sort();
  const readers = new Map();
  for (const name of names) readers.set(queueOf(name), (readers.get(queueOf(name)) || 0) + 1);
  render($("queues").tBodies[0],
         names.map((n) => [n, figures(n, queues[n], readers.get(queueOf(n)), now)]), COLUMNS);
  drawRowCharts($("queues").tBodies[0]);
  $("empty").hidden = names.length > 0;
}

// -- a queue's page --------------------------------------------------------------------

function pageName() {
  return decodeURIComponent(location.pathname.slice("/queues/".length));
}

function drawQueue(queues, now) {
  const name = pageName();
  const queue = queueOf(name);
  const mine = Object.keys(queues).filter((n) => queueOf(n) === queue).sort();
  render($("readers").tBodies[0],
         mine.map((n) => [n, figures(n, queues[n], mine.length, now)]), READER_COLUMNS);
  $("gone").hidden = mine.length > 0;
}

function drawItem(tbody, item) {
  const row = document.createElement("tr");
  cell(row, fmtInt(item.id));
  cell(row, fmtBytes(item.size));
  cell(row, fmtAge(item.age_ms));
  cell(row, fmtInt(item.error_count)).dataset.col = "deliveries";  // so far: its error count
  const data = cell(row, "", "data");
  if (item.binary) {
    const kind = document.createElement("span");
    kind.className = "kind";
    kind.textContent = "binary";
    data.appendChild(kind);
  }
  data.appendChild(document.createTextNode(item.text + (item.truncated ? " …" : "")));
  if (item.binary) {
    const hex = document.createElement("span");
    hex.className = "hex";
    hex.textContent = item.hex + (item.truncated ? " …" : "");
    data.appendChild(hex);
  }
  for (const h of item.headers || []) {  // its headers, one line each: key: value
    const line = document.createElement("span");
    line.className = "header";
    line.textContent = `${h.key}: ${h.text}${h.truncated ? " …" : ""}`;
    data.appendChild(line);
  }
  tbody.appendChild(row);
}

let admin = false;

async function pollHead() {
  const name = pageName();
  let status, body;
  try {
    ({ status, body } = await getJson("/api/queues/" + encodeURIComponent(name)));
  } catch (e) {
    return;  // the stats poll reports the server unreachable
  }
  const tbody = $("peek").tBodies[0];
  if (status === 404) {
    $("gone").hidden = false;
    $("admin").hidden = true;
    tbody.replaceChildren();
    return;
  }
  if (!body) return;
  admin = Boolean(body.admin);
  $("admin").hidden = !admin;
  if (status === 403) {
    $("peek-denied").textContent = `Cannot show the items: ${body.error}.`;
    $("peek-denied").hidden = false;
    tbody.replaceChildren();
    return;
  }
  $("peek-denied").hidden = true;
  tbody.replaceChildren();
  for (const item of body.items) drawItem(tbody, item);
  $("peek-empty").textContent = body.reader
    ? "No items waiting in memory."
    : `${name} has no default reader (a fanout reader took it over): pick one of its readers above.`;
  $("peek-empty").hidden = body.items.length > 0;
  $("peek-note").textContent =
    `(the first ${body.limit} in delivery order, ${body.preview_bytes} bytes each; ` +
    "looking removes nothing)";
}

// Admin actions: a button asks, a second click confirms; the POST carries the header a
// cross-site form cannot send (the server refuses actions without it).
let pending = null;

const QUEUE_NAME = /^[A-Za-z0-9_:-]{1,250}$/;

function ask(action) {
  const name = pageName();
  const queue = queueOf(name);
  const to = $("move-to").value.trim();
  if (action === "move" && !QUEUE_NAME.test(to)) {
    $("action-result").textContent = "Redrive: type the queue to move the items to first.";
    return;
  }
  const what = {
    flush: `Flush ${name}? Every waiting item of ${name.includes("+") ? "this reader" : "its default reader"} is discarded.`,
    delete: `Delete ${name}? ${name.includes("+") ? "The reader" : "The queue, every reader and its journal files"} will be removed.`,
    pause: `Pause ${queue}? Puts go on; its consumers get nothing until it is resumed.`,
    resume: `Resume ${queue}? Its consumers get items again.`,
    move: `Redrive ${name} to ${to}? Up to 10,000 of its items move there, each kept with its error count.`,
  }[action];
  pending = action === "move" ? `move/${encodeURIComponent(to)}` : action;
  $("confirm-text").textContent = what;
  $("confirm-yes").textContent = `Yes, ${action === "move" ? "redrive" : action}`;
  $("confirm").hidden = false;
}

async function confirmAction() {
  const action = pending;
  pending = null;
  $("confirm").hidden = true;
  if (!action || !admin) return;
  const name = pageName();
  const resp = await fetch(url(`/api/queues/${encodeURIComponent(name)}/${action}`), {
    method: "POST", cache: "no-store", credentials: "same-origin",
    headers: { "X-Queued-Console": "1" },
  });
  let body = null;
  try { body = await resp.json(); } catch (e) { body = null; }
  const result = $("action-result");
  if (resp.status !== 200 || !body) {
    result.textContent = `${action} failed: HTTP ${resp.status} ${body && body.error ? body.error : ""}`;
    return;
  }
  if (action === "delete") {
    location.assign("/");
    return;
  }
  if (action === "flush") result.textContent = `Flushed ${body.flushed} items.`;
  else if (action.startsWith("move/")) result.textContent = `Moved ${body.moved} items.`;
  else result.textContent = body.paused ? "Paused." : "Resumed.";
  pollHead();
}

function startQueue() {
  const name = pageName();
  $("name").textContent = name;
  document.title = `queued console: ${name}`;
  $("flush").addEventListener("click", () => ask("flush"));
  $("delete").addEventListener("click", () => ask("delete"));
  $("pause").addEventListener("click", () => ask("pause"));
  $("resume").addEventListener("click", () => ask("resume"));
  $("move").addEventListener("click", () => ask("move"));
  $("confirm-yes").addEventListener("click", confirmAction);
  $("confirm-no").addEventListener("click", () => { pending = null; $("confirm").hidden = true; });
  every(() => { pollStats(drawQueue); pollHead(); });
  const drawBig = () => $("charts").replaceChildren(...charts(name, 360, 80));
  pollHistory(drawBig);
  setInterval(() => pollHistory(drawBig), HISTORY_MS);
}

if (document.body.dataset.page === "queue") {
  startQueue();
} else {
  every(() => pollStats(drawIndex));
  const drawCharts = () => drawRowCharts($("queues").tBodies[0]);
  pollHistory(drawCharts);
  setInterval(() => pollHistory(drawCharts), HISTORY_MS);
}
