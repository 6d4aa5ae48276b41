// The queued web console: reads /stats.json (and, on a queue's page, a page of the queue's
// items, /api/queues/<name>?after=<id>) every POLL_MS and redraws. Everything from the server, queue names
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
let history = { queues: {}, interval_s: HISTORY_MS / 1000, window_s: 900 };

// One small chart: each series {values, times (unix s), cls} a polyline placed by time, from
// its first sample (at most 15 minutes back) to its last, all scaled to the largest value
// among them. A gap (the server was down: the samples of a clean restart come back) breaks
// the line. One point alone (a page opened soon after the start) is a flat line across.
function chart(series, w, h, label) {
  const svg = document.createElementNS(SVG_NS, "svg");
  svg.setAttribute("width", w);
  svg.setAttribute("height", h);
  svg.setAttribute("viewBox", `0 0 ${w} ${h}`);
  svg.setAttribute("class", "chart");
  let max = 0, begin = Infinity, end = -Infinity;
  for (const s of series) {
    for (const v of s.values) max = Math.max(max, v);
    for (const t of s.times) { begin = Math.min(begin, t); end = Math.max(end, t); }
  }
  svg.dataset.max = String(max);
  const title = document.createElementNS(SVG_NS, "title");
  title.textContent = `${label}, last 15 min (max ${fmtRate(max)})`;
  svg.appendChild(title);
  const start = Math.max(begin, end - (history.window_s || 900));
  const gapS = 2.5 * (history.interval_s || HISTORY_MS / 1000);
  const x = (t) => (end > start ? Math.max(0, (w * (t - start)) / (end - start)) : w);
  const y = (v) => (h - 1 - (max > 0 ? (v / max) * (h - 2) : 0)).toFixed(1);
  for (const s of series) {
    let points = [];
    const flush = () => {
      if (points.length === 1) {  // alone in the chart: across it; after a gap: a dash
        points = [[end > start ? Math.max(0, points[0][0] - 2) : 0, points[0][1]], points[0]];
      }
      if (points.length > 1) {
        const line = document.createElementNS(SVG_NS, "polyline");
        line.setAttribute("points", points.map(([px, py]) => `${px.toFixed(1)},${py}`).join(" "));
        line.setAttribute("class", s.cls);
        svg.appendChild(line);
      }
      points = [];
    };
    s.values.forEach((v, i) => {
      if (i > 0 && s.times[i] - s.times[i - 1] > gapS) flush();
      points.push([x(s.times[i]), y(v)]);
    });
    flush();
  }
  return svg;
}

function charts(name, w, h) {
  const q = history.queues[name];
  if (!q) return [];
  const rateTimes = q.t.slice(1);  // a rate is of the interval ending at its sample
  return [
    chart([{ values: q.items, times: q.t, cls: "depth" }], w, h, `${name}: items waiting`),
    chart([{ values: q.puts, times: rateTimes, cls: "puts" },
           { values: q.gets, times: rateTimes, cls: "gets" }], w, h,
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

// Paging through the reader's items with browse: `pages` holds the `after` of each page
// opened so far (0: the head); Next adds the last id shown, Previous drops one. Each poll
// redraws the page it is on; a reply to an older request (the page changed meanwhile)
// is dropped.
const pages = [0];
let lastShown = 0;
let more = false;
let headSeq = 0;

async function pollHead() {
  const name = pageName();
  const seq = ++headSeq;
  const after = pages[pages.length - 1];
  let status, body;
  try {
    ({ status, body } = await getJson("/api/queues/" + encodeURIComponent(name) +
                                      (after ? `?after=${after}` : "")));
  } catch (e) {
    return;  // the stats poll reports the server unreachable
  }
  if (seq !== headSeq) return;  // a newer request is on its way
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
  if (status === 403 || status === 400) {
    $("peek-denied").textContent = `Cannot show the items: ${body.error}.`;
    $("peek-denied").hidden = false;
    tbody.replaceChildren();
    return;
  }
  if (status !== 200) return;
  $("peek-denied").hidden = true;
  tbody.replaceChildren();
  for (const item of body.items) drawItem(tbody, item);
  lastShown = body.items.length ? body.items[body.items.length - 1].id : 0;
  more = Boolean(body.more);
  $("page-next").disabled = !more;
  $("page-prev").disabled = pages.length < 2;
  $("page-label").textContent = pages.length < 2 ? "page 1 (the head)"
    : `page ${pages.length} (after item ${fmtInt(after)})`;
  $("peek-empty").textContent = !body.reader
    ? `${name} has no default reader (a fanout reader took it over): pick one of its readers above.`
    : pages.length > 1 ? "No more items on this page: they were taken meanwhile." : "No items waiting.";
  $("peek-empty").hidden = body.items.length > 0;
  $("peek-note").textContent =
    `(${body.limit} a page in delivery order, ${body.preview_bytes} bytes each; ` +
    "looking removes nothing)";
}

function nextPage() {
  if (!more || !lastShown) return;
  pages.push(lastShown);
  pollHead();
}

function previousPage() {
  if (pages.length < 2) return;
  pages.pop();
  pollHead();
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
  $("page-next").addEventListener("click", nextPage);
  $("page-prev").addEventListener("click", previousPage);
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
