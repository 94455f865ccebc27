# ruff: noqa: E501 (JavaScript in a string: the line limit is Python's)
"""The report page's script (plain JavaScript, no library): it reads the inlined JSON and draws
each section with the renderer its spec names. Text from the run is always set as text
(`textContent`), never parsed as HTML, so a model's output cannot inject markup."""

SCRIPT = r"""
"use strict";
const RENDERERS = {};
const DATA = JSON.parse(document.getElementById("report-data").textContent);
const TOKENS = DATA.tokens || {};
const PALETTE = ["#2563eb", "#dc2626", "#16a34a", "#9333ea", "#ea580c", "#0891b2", "#4b5563", "#ca8a04"];
const DASHES = ["", "6 3", "2 2", "8 3 2 3"];
const SVGNS = "http://www.w3.org/2000/svg";

function el(tag, attrs, ...kids) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === null || v === undefined) continue;
    if (k === "class") e.className = v;
    else if (k === "style") e.style.cssText = v;
    else if (k.startsWith("on")) e.addEventListener(k.slice(2), v);
    else e.setAttribute(k, v);
  }
  for (const kid of kids.flat()) {
    if (kid !== null && kid !== undefined) e.append(kid instanceof Node ? kid : String(kid));
  }
  return e;
}
function sv(tag, attrs) {
  const e = document.createElementNS(SVGNS, tag);
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
  return e;
}
function fmt(x) {
  if (typeof x !== "number") return String(x);
  const a = Math.abs(x);
  if (a !== 0 && (a < 0.001 || a >= 1e5)) return x.toExponential(2);
  return String(Math.round(x * 1000) / 1000);
}
function empty(root, text) { root.append(el("p", {class: "empty"}, text)); }

// ---- config ------------------------------------------------------------------------------
RENDERERS.config = (root, d) => {
  if (d.not_comparable.length) {
    root.append(el("div", {class: "warn"}, "Not comparable: " + d.not_comparable.join("; ")));
  }
  if (d.runs.length > 1) {
    if (!d.diff.length) root.append(el("p", {class: "note"}, "The configs agree (run names and paths aside)."));
    else {
      const head = el("tr", {}, el("th", {}, "setting"), d.runs.map((r) => el("th", {}, r)));
      const rows = d.diff.map((row) => el("tr", {}, el("td", {}, row.key), row.values.map((v) => el("td", {}, v))));
      root.append(el("table", {class: "config-diff"}, head, rows));
    }
  }
  if (d.yaml) root.append(el("details", {open: d.runs.length > 1 ? null : ""}, el("summary", {}, "config.yaml of " + d.runs[0]), el("pre", {}, d.yaml)));
  else empty(root, "no config.yaml recorded");
};

// ---- curves: one inline SVG per chart ----------------------------------------------------
function chart(c, runs) {
  const W = 430, H = 200, L = 46, R = 8, T = 8, B = 24;
  let x0 = Infinity, x1 = -Infinity, y0 = Infinity, y1 = -Infinity;
  for (const s of c.series) for (const [x, y] of s.points) {
    x0 = Math.min(x0, x); x1 = Math.max(x1, x); y0 = Math.min(y0, y); y1 = Math.max(y1, y);
  }
  if (x1 === x0) { x0 -= 1; x1 += 1; }
  if (y1 === y0) { y0 -= 0.5; y1 += 0.5; }
  const px = (x) => L + (x - x0) / (x1 - x0) * (W - L - R);
  const py = (y) => T + (1 - (y - y0) / (y1 - y0)) * (H - T - B);
  const svg = sv("svg", {width: W, height: H, viewBox: `0 0 ${W} ${H}`});
  for (let i = 0; i <= 4; i++) {
    const y = y0 + (y1 - y0) * i / 4;
    svg.append(sv("line", {x1: L, x2: W - R, y1: py(y), y2: py(y), stroke: "#eceef2"}));
    const ty = sv("text", {x: L - 4, y: py(y) + 3, "text-anchor": "end"}); ty.textContent = fmt(y); svg.append(ty);
  }
  const every = Math.max(1, Math.ceil((x1 - x0) / 5));  // steps are whole numbers: so are the ticks
  for (let x = Math.ceil(x0); x <= x1; x += every) {
    const tx = sv("text", {x: px(x), y: H - 8, "text-anchor": "middle"}); tx.textContent = String(x); svg.append(tx);
  }
  svg.append(sv("rect", {x: L, y: T, width: W - L - R, height: H - T - B, fill: "none", stroke: "#d9dde5"}));
  const legend = el("div", {class: "legend"});
  c.series.forEach((s, i) => {
    const run = Math.max(0, runs.indexOf(s.run));
    const color = PALETTE[(runs.length > 1 ? c.series.filter((t) => t.run === s.run).indexOf(s) : i) % PALETTE.length];
    const pts = s.points.map(([x, y]) => `${px(x)},${py(y)}`).join(" ");
    svg.append(sv("polyline", {points: pts, fill: "none", stroke: color, "stroke-width": 1.6, "stroke-dasharray": DASHES[run % DASHES.length]}));
    if (s.points.length <= 24) for (const [x, y] of s.points) svg.append(sv("circle", {cx: px(x), cy: py(y), r: 2.5, fill: color}));
    const swatch = run === 0 ? color : `repeating-linear-gradient(90deg, ${color} 0 ${run + 3}px, transparent ${run + 3}px ${run + 6}px)`;
    legend.append(el("span", {}, el("i", {style: `background:${swatch}`}), s.label));
  });
  return el("div", {class: "chart"}, el("h3", {}, c.title), svg, legend);
}
RENDERERS.curves = (root, d) => {
  if (!d.charts.length) return empty(root, d.empty || "no metrics recorded");
  if (d.runs.length > 1) root.append(el("p", {class: "note"}, "Runs: " + d.runs.map((r, i) => `${r} (${["solid", "dashed", "dotted", "dash-dot"][i % 4]})`).join(", ")));
  root.append(el("div", {class: "charts"}, d.charts.map((c) => chart(c, d.runs))));
};

// ---- episodes: tokens, advantages, masks -------------------------------------------------
function advColor(a, scale) {
  const t = Math.max(-1, Math.min(1, a / (scale || 1)));
  const alpha = (0.12 + 0.78 * Math.abs(t)).toFixed(2);
  return t >= 0 ? `rgba(33,102,172,${alpha})` : `rgba(178,24,43,${alpha})`;
}
function tokenText(id) { const t = TOKENS[id]; return t === undefined ? `\u27e8${id}\u27e9` : t; }
// a piece cut to fit the page: how long the whole is, and where to read it (the episode's `show`)
function cutNote(shown, whole) {
  return whole === undefined ? null : el("span", {class: "cut", "data-whole": whole}, ` \u2026 ${shown.toLocaleString("en")} of ${whole.toLocaleString("en")} tokens shown`);
}
function maskedTokens(ids, what, whole) {
  return el("div", {class: "toks"}, ids.map((id) => el("span", {class: "tok masked", "data-masked": "1", title: `masked (${what}; not trained) · id ${id}`}, tokenText(id))), cutNote(ids.length, whole));
}
function actionTokens(ids, adv, scale, whole) {
  return el("div", {class: "toks"}, ids.map((id, k) => {
    if (!adv) return el("span", {class: "tok act untrained", title: `model token, no advantage saved · id ${id}`}, tokenText(id));
    const a = adv[k];
    const ink = Math.abs(a) > 0.55 * (scale || 1) ? ";color:#fff" : "";  // dark fills: light text
    return el("span", {class: "tok act", "data-adv": a, style: `background:${advColor(a, scale)}${ink}`, title: `advantage ${fmt(a)} · id ${id}`}, tokenText(id));
  }), cutNote(ids.length, whole));
}
function advScale(ep) {
  let m = 0;
  for (const t of ep.turns) for (const a of t.adv || []) m = Math.max(m, Math.abs(a));
  return m;
}
function turnCount(ep) { return ep.turns_total === undefined ? ep.turns.length : ep.turns_total; }
function badge(ok, yes, no) { return el("span", {class: "badge " + (ok ? "ok" : "bad")}, ok ? yes : no); }
function turnView(t, i, scale, marked) {
  const k = t.k === undefined ? i : t.k;  // the turn's index in the whole episode
  const comps = t.info && t.info.reward_components ? Object.entries(t.info.reward_components).map(([n, v]) => `${n} ${fmt(v)}`).join(", ") : "";
  const rest = Object.entries(t.info || {}).filter(([n, v]) => n !== "reward_components" && v !== null).map(([n, v]) => `${n}=${typeof v === "object" ? JSON.stringify(v) : v}`).join("  ");
  return el("div", {class: "turn" + (marked ? " first-diff" : ""), "data-turn": k},
    el("div", {class: "turnhead"}, marked ? el("span", {class: "badge mark"}, "first difference") : null,
      ` turn ${k + 1} · policy v${t.v} · reward ${fmt(t.r)}` + (comps ? ` (${comps})` : ""),
      t.c === undefined ? null : el("span", {class: "credit", "data-credit": t.c, title: "the step-reward model's reward for this step (algorithm.step_reward), before alpha"}, ` · step credit ${fmt(t.c)}`)),
    actionTokens(t.a, t.adv, scale, t.al),
    t.o.length ? maskedTokens(t.o, "observation", t.ol) : null,
    rest ? el("div", {class: "note"}, rest) : null);
}
function episodeView(ep, opts) {
  const o = opts || {};
  const scale = advScale(ep);
  const box = el("div", {class: "episode", "data-kind": ep.kind, "data-task": ep.task});
  box.append(el("div", {}, el("b", {}, `${ep.kind} · step ${ep.step} · ${ep.task}`), " ", badge(ep.success, "solved", "not solved"),
    ` reward ${fmt(ep.reward)} · ${ep.end} · ${turnCount(ep)} turns · env ${ep.env} · group ${ep.group}`));
  if (ep.show) box.append(el("div", {class: "warn cut-note"}, "Cut to fit the page (the \u2026 marks say how long the whole is); all of it: ", el("code", {}, ep.show)));
  box.append(el("div", {class: "note"}, scale > 0 ? ["advantage ", el("span", {class: "scale"}), ` \u2212${fmt(scale)} \u2026 +${fmt(scale)}; grey hatched: masked (prompt, observations)`]
    : "no advantages saved for this episode (held-out, or not trained on); grey hatched: masked"));
  box.append(el("div", {class: "turnhead"}, "prompt"), maskedTokens(ep.prompt, "prompt", ep.pl));
  ep.turns.forEach((t, i) => {
    const k = t.k === undefined ? i : t.k;
    if (i > 0 && ep.turns[i - 1].k !== undefined && k > ep.turns[i - 1].k + 1) box.append(el("div", {class: "turn cut"}, `\u2026 turns ${ep.turns[i - 1].k + 2}\u2013${k} not embedded`));
    box.append(turnView(t, i, scale, o.mark === k));
  });
  if (o.mark !== undefined && o.mark !== null && o.mark >= turnCount(ep)) box.append(el("div", {class: "turn first-diff"}, el("span", {class: "badge mark"}, "first difference"), " (no such turn: the episode had ended)"));
  return box;
}

RENDERERS.episodes = (root, d) => {
  root.append(el("p", {class: "note"}, d.shown));
  if (d.token_note) root.append(el("p", {class: "note"}, d.token_note));
  if (!d.episodes.length) return empty(root, d.empty || "no episodes recorded");
  const eps = d.episodes;
  const uniq = (f) => [...new Set(eps.map(f))].sort((a, b) => (a < b ? -1 : a > b ? 1 : 0));
  const select = (name, values) => el("label", {}, name + " ", el("select", {"data-filter": name}, el("option", {value: ""}, "all"), values.map((v) => el("option", {value: String(v)}, String(v)))));
  const f = {
    kind: select("source", uniq((e) => e.kind)), step: select("step", uniq((e) => e.step).sort((a, b) => a - b)),
    env: select("env", uniq((e) => e.env)), end: select("end", uniq((e) => e.end)),
    task: el("label", {}, "task ", el("input", {type: "text", placeholder: "id contains"})),
    lo: el("label", {}, "reward \u2265 ", el("input", {type: "number", step: "any"})),
    hi: el("label", {}, "\u2264 ", el("input", {type: "number", step: "any"})),
  };
  const count = el("span", {class: "note"});
  root.append(el("div", {class: "filters"}, Object.values(f), count));
  const tbody = el("tbody");
  const list = el("div", {class: "eplist"}, el("table", {}, el("thead", {}, el("tr", {}, ["#", "source", "step", "task", "end", "reward", "turns"].map((h) => el("th", {}, h)))), tbody));
  const detail = el("div", {});
  root.append(el("div", {class: "browser"}, list, detail));
  const val = (w) => w.querySelector("select, input").value;
  let selected = null;
  function show(i) {
    selected = i;
    detail.replaceChildren(episodeView(eps[i]));
    for (const tr of tbody.children) tr.classList.toggle("sel", Number(tr.dataset.index) === i);
  }
  function refresh() {
    const lo = val(f.lo) === "" ? -Infinity : Number(val(f.lo)), hi = val(f.hi) === "" ? Infinity : Number(val(f.hi));
    const task = val(f.task).toLowerCase();
    const keep = eps.map((e, i) => [e, i]).filter(([e]) => (!val(f.kind) || e.kind === val(f.kind)) && (!val(f.step) || String(e.step) === val(f.step))
      && (!val(f.env) || e.env === val(f.env)) && (!val(f.end) || e.end === val(f.end)) && (!task || e.task.toLowerCase().includes(task))
      && e.reward >= lo && e.reward <= hi);
    const LIMIT = 400;
    tbody.replaceChildren(...keep.slice(0, LIMIT).map(([e, i]) => el("tr", {class: "ep-row", "data-index": i, onclick: () => show(i)},
      [i + 1, e.kind, e.step, e.task, e.end, fmt(e.reward), turnCount(e)].map((c) => el("td", {}, c)))));
    count.textContent = `${keep.length} of ${eps.length} episodes` + (keep.length > LIMIT ? ` (first ${LIMIT} listed; narrow the filter)` : "");
    if (keep.length && !keep.some(([, i]) => i === selected)) show(keep[0][1]);
  }
  for (const w of Object.values(f)) w.querySelector("select, input").addEventListener("input", refresh);
  refresh();
  // open on a trained episode, a solved multi-turn one if there is (the colouring says most there)
  const solved = eps.findIndex((e) => advScale(e) > 0 && e.success && e.turns.length > 1);
  const trained = solved >= 0 ? solved : eps.findIndex((e) => advScale(e) > 0);
  if (trained >= 0) show(trained);
};

// ---- learning diff ---------------------------------------------------------------------
RENDERERS.learning_diff = (root, d) => {
  if (!d.pairs.length) return empty(root, d.empty || "no held-out episodes to compare");
  const t = d.tally, s = d.success;
  if (d.warn) root.append(el("div", {class: "warn"}, d.warn));
  root.append(el("p", {class: "note"}, `Held-out tasks at the evaluation after step ${d.first_step} vs after step ${d.last_step} (same task, same seed; ` +
    `solved ${s.first[0]}/${s.first[1]} then ${s.last[0]}/${s.last[1]} episodes): ${t.learned} learned, ${t.forgot} forgotten (p \u2264 0.05 each), ` +
    `${t.weak_gain} solved more and ${t.weak_loss} less on too few episodes to tell, ${t.changed} changed without a new verdict, ${t.same} acted identically. Strongest evidence first.`));
  const VERDICT = {learned: "learned", forgot: "forgot", weak_gain: "weak gain", weak_loss: "weak loss", changed: "changed", same: "same"};
  const evidence = (e) => `solved ${e.first[0]}/${e.first[1]} \u2192 ${e.last[0]}/${e.last[1]}, p = ${fmt(e.p)}`;
  const pick = el("select", {}, d.pairs.map((p, i) => el("option", {value: i}, `${p.task} (${VERDICT[p.verdict] || p.verdict}; ${evidence(p.evidence)})`)));
  const body = el("div", {});
  root.append(el("label", {class: "note"}, "task ", pick), body);
  function draw() {
    const p = d.pairs[Number(pick.value)];
    const mark = p.first_diff_turn;
    body.replaceChildren(
      el("p", {}, el("b", {}, p.task), ` \u2014 ${VERDICT[p.verdict] || p.verdict}; ` + (mark === null ? "these two episodes acted identically" : `first difference at turn ${mark + 1}`)),
      el("p", {class: "note evidence"}, `${evidence(p.evidence)} (Fisher's exact test, one-sided: how often chance alone gives so large a change); by evaluation: ` +
        p.evidence.history.map(([st, ok, n]) => `${ok}/${n} after step ${st}`).join(", ")),
      el("div", {class: "diff"},
        el("div", {}, el("div", {class: "label"}, `after step ${d.first_step}`), episodeView(p.first, {mark})),
        el("div", {}, el("div", {class: "label"}, `after step ${d.last_step}`), episodeView(p.last, {mark}))));
  }
  pick.addEventListener("input", draw);
  draw();
};

// ---- a generic table (the slots later features fill) ----------------------------------------
RENDERERS.table = (root, d) => {
  if (!d.rows || !d.rows.length) return empty(root, d.empty || "none recorded");
  root.append(el("table", {}, el("tr", {}, d.columns.map((c) => el("th", {}, c))), d.rows.map((r) => el("tr", {}, r.map((c) => el("td", {}, fmt(c)))))));
};

// ---- the page --------------------------------------------------------------------------
function main() {
  document.title = "steprl report: " + DATA.title;
  const top = document.getElementById("top");
  top.append(el("h1", {}, "steprl report: " + DATA.title),
    el("div", {class: "runs"}, DATA.runs.map((r) => `${r.label}: ${r.path}`).join(" \u00b7 ")));
  if (DATA.notes.length) top.append(el("div", {class: "notes"}, DATA.notes.join("; ")));
  const nav = document.getElementById("nav"), main = document.getElementById("sections");
  for (const s of DATA.sections) {
    nav.append(el("a", {href: "#" + s.name}, s.title));
    const body = el("div", {class: "body"});
    main.append(el("section", {id: s.name}, el("h2", {}, s.title), body));
    if (s.error !== undefined) { body.append(el("div", {class: "error"}, "This section could not be built: " + s.error)); continue; }
    const draw = RENDERERS[s.renderer];
    if (!draw) { console.error(`no renderer ${s.renderer} for section ${s.name}`); continue; }
    try { draw(body, s.data, DATA); } catch (err) {
      body.append(el("div", {class: "error"}, "This section could not be drawn: " + err));
      console.error(err);
    }
  }
}
document.addEventListener("DOMContentLoaded", () => {
  main();
  // the sections exist only now: a link to one (report.html#episodes) scrolls once they do
  const target = location.hash && document.getElementById(decodeURIComponent(location.hash.slice(1)));
  if (target) target.scrollIntoView();
});
"""
