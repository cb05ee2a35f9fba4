// stepskip view: the page over the JSON endpoints of `stepskip view` (src/stepskip/view/server.py), or over
// the data inlined by `stepskip report` (window.STEPSKIP_REPORT). Every value from the cache is written with
// textContent, never as HTML: a cache is data someone else may have written.
"use strict";

const REPORT = window.STEPSKIP_REPORT || null;
// A server other machines reach takes its token from the URL once and keeps it in a cookie: the token
// then leaves the address bar and the history, where a screen share or a copied link would show it.
if (!REPORT && new URLSearchParams(location.search).has("token")) history.replaceState(null, "", location.pathname + location.hash);
const PAGE = 50;
const charts = [];
let pendingCharts = [];  // drawn once their view is in the page (a detached canvas has no size)

// ------------------------------------------------------------------ data: the server, or the report's copy

function key(...parts) { return parts.join("|"); }

function queryRows(rows, p, maxLength) {  // the same rules as stepskip.view.data.query_rows
  let out = rows.slice();
  for (const f of p.filter || []) {
    if (f === "reward0") out = out.filter(r => r.reward === 0);
    if (f === "lenmax") out = out.filter(r => maxLength != null && (r.length || 0) >= maxLength);
  }
  const q = (p.q || "").trim().toLowerCase();
  if (q) out = out.filter(r => ["prompt", "response", "group", "key", "data_source"]
    .map(k => r[k] == null ? "" : String(r[k])).join(" ").toLowerCase().includes(q));
  if (p.sort) {
    const s = p.sort, dir = p.desc === "1" ? -1 : 1;
    const has = out.filter(r => r[s] != null), miss = out.filter(r => r[s] == null);
    has.sort((a, b) => {
      const x = a[s], y = b[s];
      if (typeof x === "number" && typeof y === "number") return (x - y) * dir;
      return String(x).localeCompare(String(y)) * dir;
    });
    out = has.concat(miss);
  }
  return out;
}

function summary(values) {  // as stepskip.view.data.percentiles
  const d = values.filter(v => typeof v === "number" && isFinite(v)).sort((a, b) => a - b);
  if (!d.length) return null;
  const at = q => { const p = q * (d.length - 1), lo = Math.floor(p), hi = Math.ceil(p); return d[lo] + (d[hi] - d[lo]) * (p - lo); };
  return { count: d.length, mean: d.reduce((a, b) => a + b, 0) / d.length, min: d[0], p10: at(0.1), p50: at(0.5), p90: at(0.9), max: d[d.length - 1] };
}

function compareGroups(a, b) {  // as stepskip.view.data.compare_groups
  const groups = rows => { const m = new Map(); for (const r of rows) { const k = r.group != null ? String(r.group) : "row " + r.i; if (!m.has(k)) m.set(k, []); m.get(k).push(r); } return m; };
  const ga = groups(a), gb = groups(b);
  const shared = [...ga.keys()].filter(k => gb.has(k));
  let pairs;
  if (shared.length) {
    const keys = [...ga.keys(), ...[...gb.keys()].filter(k => !ga.has(k))];
    pairs = keys.map(k => [ga.has(k) ? k : null, gb.has(k) ? k : null]);
  } else {
    const la = [...ga.keys()], lb = [...gb.keys()];
    pairs = Array.from({ length: Math.max(la.length, lb.length) }, (_, i) => [la[i] ?? null, lb[i] ?? null]);
  }
  const sum = (k, m) => {
    if (k == null) return null;
    const rows = m.get(k), rw = summary(rows.map(r => r.reward)), ln = summary(rows.map(r => r.length));
    return { group: k, rows, mean_reward: rw ? rw.mean : null, mean_length: ln ? ln.mean : null };
  };
  return pairs.map(([ka, kb], n) => ({ n, a: sum(ka, ga), b: sum(kb, gb) }));
}

function local(endpoint, p) {
  const step = () => {
    const s = REPORT.steps[key(p.run, p.role, p.step)];
    if (!s) return { error: `step ${p.step} of ${p.run} (${p.role}) is not in this report`, kind: "not-found" };
    return s;
  };
  if (endpoint === "runs") return REPORT.listing;
  if (endpoint === "step") {
    const s = step(); if (s.error) return s;
    const rows = queryRows(s.rows, p, s.max_length), offset = +(p.offset || 0), limit = +(p.limit || PAGE);
    return Object.assign({}, s, { total: s.rows.length, matched: rows.length, offset, limit, rows: rows.slice(offset, offset + limit) });
  }
  if (endpoint === "stats") return REPORT.stats[key(p.run, p.role, p.step)] || step();
  if (endpoint === "trend") return REPORT.trends[key(p.run, p.role)] || { error: "not in this report", kind: "not-found" };
  if (endpoint === "compare") {
    const a = REPORT.steps[key(p.run, p.role, p.step)], b = REPORT.steps[key(p.run2 || p.run, p.role2 || p.role, p.step2)];
    if (!a || !b) return { error: "one of the two steps is not in this report", kind: "not-found" };
    if (a.error || b.error) return a.error ? a : b;
    const groups = compareGroups(a.rows, b.rows), offset = +(p.offset || 0), limit = +(p.limit || 20);
    const side = (s, r, o, st) => ({ run: r, role: o, step: +st, reward: summary(s.rows.map(x => x.reward)), length: summary(s.rows.map(x => x.length)) });
    return { a: side(a, p.run, p.role, p.step), b: side(b, p.run2 || p.run, p.role2 || p.role, p.step2), total: groups.length, offset, limit, groups: groups.slice(offset, offset + limit) };
  }
  if (endpoint === "tokens") return { error: "per-token strips are shown by stepskip view (a report keeps no per-token values)", kind: "not-found" };
  return { error: "unknown view", kind: "not-found" };
}

async function api(endpoint, p) {
  if (REPORT) return local(endpoint, p);
  const qs = new URLSearchParams();
  for (const [k, v] of Object.entries(p || {})) {
    if (Array.isArray(v)) v.forEach(x => qs.append(k, x)); else if (v != null && v !== "") qs.append(k, v);
  }
  try {
    const res = await fetch(`/api/${endpoint}?${qs}`);
    return await res.json();
  } catch (e) {
    return { error: `the server did not answer (${e}); is stepskip view still running?`, kind: "network" };
  }
}

// ------------------------------------------------------------------ DOM helpers (textContent only)

function el(tag, attrs, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === "onclick" || k === "oninput" || k === "onchange") e[k] = v;
    else if (v != null) e.setAttribute(k, v);
  }
  for (const c of children.flat()) if (c != null) e.append(c instanceof Node ? c : document.createTextNode(String(c)));
  return e;
}
function link(text, hash) { return el("a", { href: hash }, text); }
function hashFor(view, p) { return "#/" + view + "?" + new URLSearchParams(Object.entries(p).filter(([, v]) => v != null && v !== "")); }
function fmt(v, digits = 3) { return v == null ? "–" : (typeof v === "number" ? (Number.isInteger(v) ? String(v) : v.toFixed(digits)) : String(v)); }
function bytes(n) { if (n == null) return "–"; const u = ["B", "KiB", "MiB", "GiB", "TiB"]; let i = 0; while (n >= 1024 && i < u.length - 1) { n /= 1024; i++; } return `${i ? n.toFixed(1) : n} ${u[i]}`; }
function age(s) { if (s == null) return "–"; if (s < 90) return `${Math.round(s)} s`; if (s < 5400) return `${Math.round(s / 60)} min`; if (s < 172800) return `${Math.round(s / 3600)} h`; return `${Math.round(s / 86400)} d`; }
function text(v) { if (v == null) return "–"; if (Array.isArray(v)) return "[" + v.join(", ") + "]"; return typeof v === "object" ? JSON.stringify(v) : String(v); }
function tagLines(v) { return v && typeof v === "object" && !Array.isArray(v) ? Object.entries(v).map(([k, x]) => `${k}: ${text(x)}`).join("\n") : text(v); }
function problem(body) { return el("div", { class: "error", "data-error-kind": body.kind || "" }, body.error); }
function done(node) { if (!node || node.isConnected) document.body.setAttribute("data-ready", "1"); }

function chart(id, config) {
  const box = el("div", { class: "chart" }), canvas = el("canvas", { id, "data-chart": id });
  box.append(canvas);
  pendingCharts.push(() => {
    if (typeof Chart === "undefined") { box.replaceChildren(el("p", { class: "muted" }, "charting library not loaded")); return; }
    config.options = Object.assign({ animation: false, responsive: true, maintainAspectRatio: false }, config.options || {});
    const c = new Chart(canvas, config);
    charts.push(c);
    canvas.setAttribute("data-points", String(config.data.datasets.reduce((a, d) => a + d.data.length, 0)));
  });
  return box;
}
function histChart(id, title, hist) {
  if (!hist) return el("div", { class: "chart muted" }, `no ${title.toLowerCase()} in this step`);
  const labels = hist.counts.map((_, i) => {
    const lo = hist.edges[i], hi = hist.edges[i + 1];
    return Number.isInteger(lo) && hi - lo === 1 ? String(lo) : `${fmt(lo, 2)}–${fmt(hi, 2)}`;
  });
  return chart(id, { type: "bar", data: { labels, datasets: [{ label: title, data: hist.counts, backgroundColor: "#4f7cc9" }] },
    options: { plugins: { title: { display: true, text: title } } } });
}

// ------------------------------------------------------------------ views

let LISTING = null;

async function viewRuns() {
  const body = await api("runs", {});
  const app = el("div", {});
  if (body.error) { app.append(problem(body)); return app; }
  app.append(el("h2", {}, "Runs"));
  if (!body.runs.length) app.append(el("p", { class: "muted" }, "no runs in this cache"));
  for (const run of body.runs) {
    const sec = el("section", { class: "run", "data-run": run.name, "data-live": run.live ? "1" : "0" });
    sec.append(el("h3", {}, run.name, " ", el("span", { class: "muted" }, Object.entries(run.shape).map(([k, v]) => `${k}=${v}`).join(" ")),
      run.live ? el("span", { class: "pill live", title: `a step recorded (or being written) in the last ${age(body.live_seconds)}` },
        REPORT ? "being written when reported" : "being written") : null));
    for (const role of run.roles) {
      sec.append(el("h3", {}, "role ", el("span", { class: "pill" }, role.role), " ", el("span", { class: "muted" }, `${role.formats.join(", ")} · ${bytes(role.bytes)} · `),
        link("trend across steps", hashFor("trend", { run: run.name, role: role.role }))));
      const t = el("table", { class: "steps", "data-role": role.role },
        el("tr", {}, ["step", "kind", "rows", "format", "size", REPORT ? "recorded (UTC)" : "age", "generation s", "fingerprint", "written by", "status", ""].map(h => el("th", {}, h))));
      for (const s of role.steps) {
        const status = (s.valid ? "ok" : s.issues.join("; ")) + (s.compared ? " · compared" : "");
        const other = role.steps.find(x => x.step > s.step && x.valid);
        t.append(el("tr", { "data-step": s.step, class: s.valid ? "" : "bad" },
          el("td", { class: "num" }, link(String(s.step), hashFor("step", { run: run.name, role: role.role, step: s.step }))),
          el("td", {}, s.kind + (s.inner.length ? ` (${s.inner.length} inner)` : "")),
          el("td", { class: "num" }, fmt(s.rows)), el("td", {}, s.formats.join(", ")),
          el("td", { class: "num" }, bytes(s.bytes)),
          // a report is read later: an age would be wrong by then, an absolute time is not
          REPORT ? el("td", { class: "num", "data-col": "recorded" }, fmt(s.recorded_utc)) : el("td", { class: "num", title: s.recorded_utc || "" }, age(s.age_seconds)),
          el("td", { class: "num" }, fmt(s.generation_seconds)),
          el("td", { title: s.fingerprint_values ? JSON.stringify(s.fingerprint_values, null, 1) : "" }, fmt(s.fingerprint)),
          el("td", {}, fmt(s.written_by)), el("td", {}, status),
          el("td", {}, other ? link(`compare with ${other.step}`, hashFor("compare", { run: run.name, role: role.role, step: s.step, step2: other.step })) : "")));
      }
      sec.append(t);
    }
    if (run.issues.length) {
      sec.append(el("details", {}, el("summary", {}, `${run.issues.length} problem(s)`),
        el("ul", {}, run.issues.map(i => el("li", {}, `${i.kind}: ${i.path}: ${i.detail}`)))));
    }
    app.append(sec);
  }
  const runs = body.runs.map(r => r.name);
  if (runs.length > 1) {  // the same step of two runs
    const pick = (id) => el("select", { id }, runs.map(r => el("option", { value: r }, r)));
    const a = pick("cmp-a"), b = pick("cmp-b"); b.selectedIndex = 1;
    const role = el("input", { id: "cmp-role", value: "rollout", size: 12 }), step = el("input", { id: "cmp-step", value: "1", size: 4 });
    app.append(el("h3", {}, "Compare the same step of two runs"),
      el("div", { class: "controls" }, a, b, "role", role, "step", step,
        el("button", { onclick: () => { location.hash = hashFor("compare", { run: a.value, role: role.value, step: step.value, run2: b.value, step2: step.value }); } }, "compare")));
  }
  return app;
}

function statsLine(name, s) {
  if (!s) return el("span", { class: "pill" }, `${name}: –`);
  return el("span", { class: "pill" }, `${name}: mean ${fmt(s.mean)} · p10 ${fmt(s.p10)} · p50 ${fmt(s.p50)} · p90 ${fmt(s.p90)} · min ${fmt(s.min)} · max ${fmt(s.max)}`);
}

// A compared step's drift record (action: compare): verdict, figures per field, and divergent rows of the worst
// field, recorded and live side by side. Every value is the record's own: written as text, numbers checked.
function num(v) { return typeof v === "number" && isFinite(v) ? v : null; }
function driftPanel(records) {
  const box = el("section", { id: "drift", class: "drift" }, el("h3", {}, "drift (action: compare)"));
  for (const r of records) {
    if (!r || typeof r !== "object") continue;
    if (r.damaged) { box.append(el("div", { class: "error" }, `not compared: the entry was damaged (${text(r.reason)})`)); continue; }
    const verdict = r.passed === true ? "matches its recording" : (r.prompts_equal === false ? "saw other prompts than its recording" : "drifted from its recording");
    box.append(el("div", { class: "controls", "data-passed": r.passed === true ? "1" : "0" },
      el("strong", { class: r.passed === true ? "" : "bad" }, `step ${text(r.step)} ${verdict}`),
      el("span", { class: "pill" }, `token match ${fmt(num(r.token_match), 4)}`),
      el("span", { class: "pill" }, `worst field ${text(r.worst_field)} · ${fmt(num(r.worst_match), 4)} · max |Δ| ${fmt(num(r.worst_delta), 4)}`),
      el("span", { class: "pill" }, `first row ${fmt(num(r.first_row))}`),
      el("span", { class: "pill" }, `prompts ${r.prompts_equal === true ? "equal" : (r.prompts_equal === false ? "differ" : "–")}`),
      el("span", { class: "muted" }, `min match ${fmt(num(r.min_match))} · rtol ${text(r.rtol)} · atol ${text(r.atol)} · train_on ${text(r.train_on)}`)));
    const fields = r.fields && typeof r.fields === "object" ? Object.values(r.fields).filter(f => f && typeof f === "object") : [];
    if (fields.length) {
      const t = el("table", { class: "drift-fields" }, el("tr", {}, ["field", "kind", "match", "max |Δ|", "mean |Δ|", "first row", "note"].map(h => el("th", {}, h))));
      for (const f of fields) t.append(el("tr", { class: f.passed === false ? "bad" : "", "data-field": text(f.name) },
        el("td", {}, text(f.name)), el("td", {}, text(f.kind)), el("td", { class: "num" }, fmt(num(f.match), 4)),
        el("td", { class: "num" }, fmt(num(f.max_delta), 4)), el("td", { class: "num" }, fmt(num(f.mean_delta), 4)),
        el("td", { class: "num" }, fmt(num(f.first_row))), el("td", {}, f.note == null ? "" : text(f.note))));
      box.append(t);
    }
    // the divergent rows of the worst field and of the lowest token field (the responses, usually)
    const tokens = fields.filter(f => f.kind === "tokens" && num(f.match) != null).sort((a, b) => a.match - b.match)[0];
    const shown = [fields.find(f => f.name === r.worst_field), tokens].filter((f, i, all) => f && all.indexOf(f) === i);
    for (const f of shown) {
      for (const ex of Array.isArray(f.examples) ? f.examples : []) {
        if (!ex || typeof ex !== "object") continue;
        box.append(el("div", { class: "side", "data-example-row": text(ex.row), "data-field": text(f.name) },
          el("div", { class: "group" }, el("strong", {}, `${text(f.name)} · row ${text(ex.row)} · recorded`), el("div", { class: "text" }, text(ex.recorded))),
          el("div", { class: "group" }, el("strong", {}, `${text(f.name)} · row ${text(ex.row)} · live`), el("div", { class: "text" }, text(ex.live)))));
      }
    }
  }
  return box;
}

async function viewStep(p) {
  const app = el("div", {});
  const other = el("input", { id: "cmp-step2", size: 4, value: String(+p.step + 1) });
  const otherRun = el("input", { id: "cmp-run2", size: 40, placeholder: "same run", value: "" });
  app.append(el("h2", {}, `${p.run} · ${p.role} · step ${p.step}`),
    el("div", { class: "controls" }, link("trend of this run", hashFor("trend", { run: p.run, role: p.role })),
      "compare with step", other, "of run", otherRun,
      el("button", { id: "cmp-go", onclick: () => { location.hash = hashFor("compare", { run: p.run, role: p.role, step: p.step, run2: otherRun.value, step2: other.value }); } }, "side by side")));
  const stats = await api("stats", { run: p.run, role: p.role, step: p.step });
  if (stats.error) { app.append(problem(stats)); return app; }
  app.append(el("div", { class: "controls" }, `${stats.rows} trajectories`, statsLine("reward", stats.reward.summary),
    statsLine("response length", stats.length.summary), groupsLine(stats.groups)));
  app.append(el("div", { class: "charts" }, histChart("reward-hist", "Reward", stats.reward.histogram),
    histChart("length-hist", "Response length", stats.length.histogram)));
  const state = { sort: p.sort || "", desc: p.desc || "", q: p.q || "", filter: p.filter ? [].concat(p.filter) : [], offset: +(p.offset || 0) };
  const holder = el("div", {});
  const driftBox = el("div", {});
  const stripBox = el("div", { id: "strip-box" });
  app.append(driftBox, stripBox);
  let stripColumns = [];
  async function showStrip(row, column) {
    const body = await api("tokens", { run: p.run, role: p.role, step: p.step, row, column });
    stripBox.replaceChildren(body.error ? problem(body) : stripPanel(body, c => showStrip(row, c)));
    const h = new URLSearchParams(location.hash.split("?")[1] || "");
    h.set("strip", String(row)); if (column) h.set("strip_col", column); else h.delete("strip_col");
    history.replaceState(null, "", location.pathname + location.search + "#/step?" + h);
  }
  const box = (name, label) => {
    const c = el("input", { type: "checkbox", id: "f-" + name });
    c.checked = state.filter.includes(name);
    c.onchange = () => { state.filter = state.filter.filter(x => x !== name).concat(c.checked ? [name] : []); state.offset = 0; load(); };
    return el("label", {}, c, label);
  };
  const search = el("input", { id: "search", type: "search", placeholder: "search prompt / response / group", size: 36, value: state.q });
  let timer = null;
  search.oninput = () => { clearTimeout(timer); timer = setTimeout(() => { state.q = search.value; state.offset = 0; load(); }, 250); };
  app.append(el("div", { class: "controls" }, search, box("reward0", " reward = 0"), box("lenmax", " length ≥ max")), holder);

  async function load() {
    document.body.removeAttribute("data-ready");
    const page = await api("step", Object.assign({ run: p.run, role: p.role, step: p.step, limit: PAGE }, state));
    if (page.error) { holder.replaceChildren(problem(page)); done(holder); return; }
    if (Array.isArray(page.drift) && page.drift.length && !driftBox.firstChild) driftBox.append(driftPanel(page.drift));
    stripColumns = Array.isArray(page.strip_columns) ? page.strip_columns : [];
    const cols = ["i"].concat(page.columns);
    const head = el("tr", {}, cols.map(c => {
      const label = c === "length" ? "response length" : (c === "group" ? "group (uid)" : (c === "key" ? "trajectory key" : c));
      const mark = state.sort === c ? (state.desc === "1" ? " ▼" : " ▲") : "";
      return el("th", { class: "sortable", "data-col": c, onclick: () => { state.desc = state.sort === c && state.desc !== "1" ? "1" : ""; state.sort = c; load(); } }, label + mark);
    }));
    const table = el("table", { id: "rows", "data-total": page.total, "data-matched": page.matched }, head);
    if (stripColumns.length) head.append(el("th", {}, "per token"));
    for (const r of page.rows) {
      const tr = el("tr", { "data-row": r.i }, cols.map(c => {
        const v = r[c], numeric = typeof v === "number";
        return el("td", { class: numeric ? "num" : (c === "prompt" || c === "response" ? "text" : ""), "data-col": c }, c === "reward" || c === "length" || c === "i" ? fmt(v) : (c === "tags" ? tagLines(v) : text(v)));
      }));
      if (stripColumns.length) tr.append(el("td", {}, el("button", { class: "strip-go", "data-row": r.i, onclick: () => showStrip(r.i) }, "log-probs")));
      table.append(tr);
    }
    const last = Math.min(page.offset + page.limit, page.matched);
    const nav = el("div", { class: "controls", id: "pager" },
      el("button", { id: "prev", onclick: () => { state.offset = Math.max(0, state.offset - PAGE); load(); } }, "◀ previous"),
      el("span", { id: "page-info" }, `rows ${page.matched ? page.offset + 1 : 0}–${last} of ${page.matched}` + (page.matched !== page.total ? ` (filtered from ${page.total})` : "")),
      el("button", { id: "next", onclick: () => { state.offset += PAGE; load(); } }, "next ▶"),
      page.max_length != null ? el("span", { class: "muted" }, `max response length ${page.max_length}`) : null,
      page.reward_source ? el("span", { class: "muted" }, `reward from ${page.reward_source}`) : null,
      page.tokenizer ? el("span", { class: "muted", id: "decoded-by" }, `text decoded with ${page.tokenizer}`) : null);
    nav.querySelector("#prev").disabled = page.offset === 0;
    nav.querySelector("#next").disabled = last >= page.matched;
    holder.replaceChildren(nav, table);
    done(holder);
  }
  await load();
  if (p.strip != null && stripColumns.length) await showStrip(p.strip, p.strip_col);
  return app;
}

// GRPO groups whose rewards are all equal: zero advantage, nothing learned from them.
function groupsLine(g) {
  if (!g || typeof g !== "object") return null;
  const values = g.by_value && typeof g.by_value === "object" ? Object.entries(g.by_value).map(([k, n]) => `${fmt(num(n))} all ${k}`).join(", ") : "";
  return el("span", { class: "pill", id: "equal-groups", "data-equal": fmt(num(g.equal)), "data-groups": fmt(num(g.groups)), title: `groups by ${text(g.grouped_by)}` },
    `groups with equal rewards (zero advantage): ${fmt(num(g.equal))} of ${fmt(num(g.groups))}` + (values ? ` (${values})` : ""));
}

// One trajectory's tokens, each a cell colored by its value: a class picked from the number alone.
function stripBucket(v, column, lo, hi) {
  if (typeof v !== "number" || !isFinite(v)) return "lpnone";
  const x = /log_prob/.test(column) ? Math.exp(Math.min(0, v)) : (hi > lo ? (v - lo) / (hi - lo) : 1);
  return "lp" + Math.max(0, Math.min(9, Math.floor(x * 10)));
}
function stripPanel(s, choose) {
  const box = el("section", { id: "strip", class: "strip", "data-row": text(s.row), "data-column": text(s.column) });
  const pick = el("select", { id: "strip-column", onchange: () => choose(pick.value) }, (Array.isArray(s.columns) ? s.columns : []).map(c => el("option", { value: text(c) }, text(c))));
  pick.value = text(s.column);
  box.append(el("div", { class: "controls" }, el("strong", {}, `row ${text(s.row)} · per-token values`), pick,
    el("span", { class: "pill" }, `${fmt(num(s.count))} tokens · mean ${fmt(num(s.mean))} · min ${fmt(num(s.min))} · max ${fmt(num(s.max))}`),
    s.truncated ? el("span", { class: "muted" }, `first ${(s.tokens || []).length} shown`) : null));
  const cells = el("div", { class: "tokens" });
  const lo = num(s.min), hi = num(s.max);
  for (const t of Array.isArray(s.tokens) ? s.tokens : []) {
    if (!t || typeof t !== "object") continue;
    const v = num(t.v);
    cells.append(el("span", { class: "tok " + stripBucket(v, text(s.column), lo, hi), "data-v": v == null ? "" : String(v), title: v == null ? "–" : v.toFixed(4) }, text(t.t)));
  }
  box.append(cells);
  return box;
}

async function viewTrend(p) {
  const app = el("div", {});
  app.append(el("h2", {}, `${p.run} · ${p.role} · across steps`));
  const body = await api("trend", p);
  if (body.error) { app.append(problem(body)); return app; }
  const steps = body.steps.map(s => String(s.step));
  const line = (id, title, pick) => chart(id, { type: "line", data: { labels: steps, datasets: ["mean", "p10", "p50", "p90"].map((k, i) => ({
    label: k, data: body.steps.map(s => pick(s) ? pick(s)[k] : null), borderColor: ["#1d4ed8", "#9ca3af", "#10b981", "#f59e0b"][i], borderDash: k === "mean" ? [] : [4, 3], spanGaps: true })) },
    options: { plugins: { title: { display: true, text: title } }, scales: { x: { title: { display: true, text: "step" } } } } });
  app.append(el("div", { class: "charts" }, line("reward-trend", "Reward across steps", s => s.reward), line("length-trend", "Response length across steps", s => s.length)));
  const t = el("table", { id: "trend" }, el("tr", {}, ["step", "rows", "reward mean", "reward p50", "length mean", "length p10", "length p50", "length p90", "length max", "equal-reward groups"].map(h => el("th", {}, h))));
  const equal = g => g ? `${fmt(num(g.equal))} of ${fmt(num(g.groups))}` : "–";
  for (const s of body.steps) {
    const r = s.reward || {}, l = s.length || {};
    t.append(el("tr", { "data-step": s.step }, el("td", {}, link(String(s.step), hashFor("step", { run: p.run, role: p.role, step: s.step }))),
      [s.rows, r.mean, r.p50, l.mean, l.p10, l.p50, l.p90, l.max].map(v => el("td", { class: "num" }, fmt(v))),
      el("td", { class: "num", "data-col": "groups" }, equal(s.groups))));
  }
  if (body.groups) app.append(el("p", { id: "groups-total" }, `GRPO groups with equal rewards (zero advantage) across ${fmt(num(body.groups.steps))} steps: ${equal(body.groups)}`));
  app.append(t);
  for (const pr of body.problems) app.append(problem({ error: `step ${pr.step}: ${pr.detail}`, kind: pr.kind }));
  return app;
}

async function viewCompare(p) {
  const app = el("div", {});
  const b = { run: p.run2 || p.run, role: p.role2 || p.role, step: p.step2 };
  app.append(el("h2", {}, `${p.run} · ${p.role} · step ${p.step}  vs  ${b.run} · ${b.role} · step ${b.step}`));
  const state = { offset: +(p.offset || 0) };
  const holder = el("div", {});
  app.append(holder);
  async function load() {
    document.body.removeAttribute("data-ready");
    const body = await api("compare", Object.assign({}, p, { offset: state.offset, limit: 20 }));
    if (body.error) { holder.replaceChildren(problem(body)); done(holder); return; }
    const head = el("div", { class: "side" },
      [body.a, body.b].map((s, i) => el("div", { class: "group", id: i ? "side-b" : "side-a" }, el("strong", {}, `${s.run} · ${s.role} · step ${s.step}`), el("br"),
        statsLine("reward", s.reward), el("br"), statsLine("length", s.length))));
    const groups = el("div", { id: "groups", "data-total": body.total });
    for (const g of body.groups) {
      groups.append(el("div", { class: "side", "data-group": g.n }, [g.a, g.b].map(side => {
        if (!side) return el("div", { class: "group muted" }, "no such group");
        const t = el("table", {}, el("tr", {}, ["i", "response", "reward", "length"].map(h => el("th", {}, h))));
        for (const r of side.rows) t.append(el("tr", {}, el("td", { class: "num" }, fmt(r.i)), el("td", { class: "text" }, text(r.response)),
          el("td", { class: "num" }, fmt(r.reward)), el("td", { class: "num" }, fmt(r.length))));
        return el("div", { class: "group" }, el("div", {}, el("strong", {}, "group "), side.group, " · ",
          `mean reward ${fmt(side.mean_reward)} · mean length ${fmt(side.mean_length)}`), t);
      })));
    }
    const last = Math.min(state.offset + 20, body.total);
    const nav = el("div", { class: "controls" },
      el("button", { id: "prev", onclick: () => { state.offset = Math.max(0, state.offset - 20); load(); } }, "◀ previous"),
      `groups ${body.total ? state.offset + 1 : 0}–${last} of ${body.total}`,
      el("button", { id: "next", onclick: () => { state.offset += 20; load(); } }, "next ▶"));
    nav.querySelector("#prev").disabled = state.offset === 0;
    nav.querySelector("#next").disabled = last >= body.total;
    holder.replaceChildren(head, nav, groups);
    done(holder);
  }
  await load();
  return app;
}

// ------------------------------------------------------------------ routing

async function route() {
  document.body.removeAttribute("data-ready");
  while (charts.length) charts.pop().destroy();
  pendingCharts = [];
  const [path, query] = (location.hash.replace(/^#\/?/, "") || "").split("?");
  const qs = new URLSearchParams(query || "");
  const p = {};
  for (const k of new Set(qs.keys())) { const all = qs.getAll(k); p[k] = all.length > 1 ? all : all[0]; }
  const crumbs = document.getElementById("crumbs");
  crumbs.replaceChildren(link("runs", "#/"));
  if (p.run) crumbs.append(link(`${p.run} · ${p.role}`, hashFor("trend", { run: p.run, role: p.role })));
  let view;
  if (path === "step") view = await viewStep(p);
  else if (path === "trend") view = await viewTrend(p);
  else if (path === "compare") view = await viewCompare(p);
  else view = await viewRuns();
  document.getElementById("app").replaceChildren(view);
  document.body.setAttribute("data-view", path || "runs");
  const draw = pendingCharts; pendingCharts = [];
  for (const f of draw) { try { f(); } catch (e) { console.error(e); } }
  done();
}

// --follow: ask the server whether the cache changed; the run list and a trend are drawn again when it did
// (a step's table is left alone: it may be mid-search). Each redraw ends with a "stepskip:updated" event.
let followed = null;
async function follow(seconds) {
  const body = await api("follow", {});
  if (!body.error) {
    const state = `${body.version}|${(body.live || []).join("\n")}`;
    const view = document.body.getAttribute("data-view");
    if (followed != null && state !== followed && (view === "runs" || view === "trend")) {
      await route();
      document.dispatchEvent(new CustomEvent("stepskip:updated", { detail: { version: body.version } }));
    }
    followed = state;
    document.body.setAttribute("data-version", String(body.version));
  }
  setTimeout(() => follow(seconds), seconds * 1000);
}

window.addEventListener("hashchange", route);
window.addEventListener("DOMContentLoaded", async () => {
  if (REPORT) document.getElementById("root").textContent = `report of ${REPORT.listing.root} · created ${REPORT.created}`;
  else {
    const r = await api("runs", {}); document.getElementById("root").textContent = r.root || "";
    if (r.follow && typeof r.follow.seconds === "number" && Array.isArray(r.runs)) {
      followed = `${r.version}|${r.runs.filter(x => x.live).map(x => x.name).sort().join("\n")}`;  // what the first view shows
      document.body.setAttribute("data-follow", "1");
      setTimeout(() => follow(Math.max(0.5, r.follow.seconds)), r.follow.seconds * 1000);
    }
  }
  route();
});
