// dclens explorer page (built by dclens.explorer; docs/explorer.md).
// Data: per layer one deflate-compressed buffer of 8-bit rows with float32
// scales (META.manifest says where each array lies), decoded on first use.
// Contract: #layer=L&head=H&query=Q&view=V[&phase=P&key=K&tab=circuit] selects a view;
// once drawn, body.dataset.ready is "1" and #dcs-selected's data-values
// holds the displayed numbers as JSON (null at masked keys).
(function () {
  "use strict";
  const META = JSON.parse(document.getElementById("dcs-meta").textContent);
  const BLOBS = JSON.parse(document.getElementById("dcs-blobs").textContent);
  const N = META.n_head, T = META.T, TOK = META.tokens;
  const FB = META.flow_branches;                      // branch axis of the flows
  const $ = (id) => document.getElementById(id);
  const decoded = {};                                 // layer -> {name: array}
  const CIRC = META.circuit;                          // explore(circuit=...): the circuit tab's data, or null
  const TAB0 = CIRC ? "circuit" : "maps";             // a page with a circuit opens on its tab
  const state = { layer: META.layers[0], head: 0, query: T - 1, key: null, view: META.dcmha ? "pattern_composed" : "pattern",
                  phase: "post", show: "both", preview: null, tab: TAB0 };
  const circHeads = new Set();                        // "l.h" of every head node of the circuit
  if (CIRC) CIRC.nodes.forEach((n) => { if (n.kind === "head") circHeads.add(n.layer + "." + n.head); });
  const inCircuit = (l, h) => circHeads.has(l + "." + h);
  if (META.ig) {                                      // open on the head IG ranks first (and the target's position)
    [state.layer, state.head] = META.ig.top;
    if (META.ig.query !== null) state.query = META.ig.query;
  } else if (CIRC) {                                  // or on the head of the circuit's top edge
    for (const e of CIRC.edges) {
      const n = [e.node, e.sender].map((id) => CIRC.nodes.find((x) => x.id === id)).find((x) => x && x.kind === "head" && META.layers.includes(x.layer));
      if (n) { state.layer = n.layer; state.head = n.head; break; }
    }
  }

  // ------------------------------------------------------------ decoding
  async function decodeLayer(l) {
    if (decoded[l]) return decoded[l];
    const bin = Uint8Array.from(atob(BLOBS[l]), (c) => c.charCodeAt(0));
    const stream = new Blob([bin]).stream().pipeThrough(new DecompressionStream("deflate"));
    const buf = await new Response(stream).arrayBuffer();
    const out = {};
    for (const [name, e] of Object.entries(META.manifest[l])) {
      const Arr = { u8: Uint8Array, i8: Int8Array, u16: Uint16Array, i16: Int16Array }[e.kind];
      out[name] = { q: new Arr(buf, e.data, e.n),
                    sc: new Float32Array(buf, e.scale, e.rows), shape: e.shape };
    }
    const w = META.windows[l];
    const lo = new Int32Array(T), start = new Int32Array(T + 1);
    for (let t = 0; t < T; t++) { lo[t] = w > 0 ? Math.max(0, t - w) : 0; start[t + 1] = start[t] + t - lo[t] + 1; }
    out._lo = lo; out._start = start;
    const tw = META.twin_windows && META.twin_windows[l];
    out._twlo = new Int32Array(T); out._twstart = new Int32Array(T + 1);
    for (let t = 0; t < T; t++) {
      out._twlo[t] = tw > 0 ? Math.max(0, t - tw) : 0;
      out._twstart[t + 1] = out._twstart[t] + t - out._twlo[t] + 1;
    }
    decoded[l] = out;
    return out;
  }

  // row (head n, query t) of a stored map [N, T, S] over all keys; NaN at masked keys
  function mapRow(D, name, n, t) {
    const a = D[name], row = new Float64Array(T).fill(NaN);
    if (!a) return null;
    const twin = name.startsWith("twin."), lo = twin ? D._twlo : D._lo, st = twin ? D._twstart : D._start;
    const base = n * st[T] + st[t], s = a.sc[n * T + t];
    for (let k = lo[t]; k <= t; k++) row[k] = a.q[base + k - lo[t]] * s;
    return row;
  }
  // a stored dense array, value at flat index i (rows over its last axis)
  function dense(a, i) { return a.q[i] * a.sc[Math.floor(i / a.shape[a.shape.length - 1])]; }

  // ------------------------------------------------------------ flows (routing.flows, in the page)
  // F[(n * B + b) * T + s]: the part of target head m's composed score (pre) or
  // weight (post) at (t, s) lent by source head n through branch b; NaN at masked keys.
  function flows(D, phase, m, t) {
    const B = FB.length, F = new Float64Array(N * B * T).fill(NaN);
    const X = [];
    for (let n = 0; n < N; n++) X.push(mapRow(D, phase === "pre" ? "scores" : "pattern", n, t));
    const g = N / META.groups, same = (n) => Math.floor(n / g) === Math.floor(m / g);
    const dy = (k) => D["dyn." + phase + "." + k];
    const proj = (w1, w2, pos) => {                   // (w1[pos]^T w2[pos])[n, m] for every n
      const R = w1.shape[1], c = new Float64Array(N);
      for (let n = 0; n < N; n++) {
        if (!same(n)) continue;
        for (let i = 0; i < R; i++) c[n] += dense(w1, (pos * R + i) * N + n) * dense(w2, (pos * R + i) * N + m);
      }
      return c;
    };
    const qw1 = dy("qw1"), kw1 = dy("kw1"), W = D["static." + phase];
    const qc = META.dcmha && qw1 ? proj(qw1, dy("qw2"), t) : null;
    const qg = META.dcmha && qw1 ? dense(dy("qdd"), t * N + m) : 0;
    for (let s = 0; s <= t; s++) {
      if (isNaN(X[m][s])) continue;
      const kc = META.dcmha && kw1 ? proj(kw1, dy("kw2"), s) : null;
      for (let n = 0; n < N; n++) for (let b = 0; b < B; b++) F[(n * B + b) * T + s] = 0;
      for (let b = 0; b < B; b++) {
        const br = FB[b];
        for (let n = 0; n < N; n++) {
          const x = X[n][s];
          let v = 0;
          if (br === "skip") v = n === m ? x : 0;
          else if (br === "qp") v = qc ? x * qc[n] : 0;
          else if (br === "kp") v = kc ? x * kc[n] : 0;
          else if (br === "qg") v = n === m && qw1 ? x * qg : 0;
          else if (br === "kg") v = n === m && kw1 ? x * dense(dy("kdd"), s * N + m) : 0;
          else if (br === "static") v = W && same(n) ? x * dense(W, n * N + m) : 0;
          F[(n * B + b) * T + s] = v;
        }
      }
    }
    return F;
  }
  function branchRow(F, b) {                          // sum over source heads
    const B = FB.length, row = new Float64Array(T).fill(NaN);
    for (let s = 0; s < T; s++) {
      if (isNaN(F[b * T + s])) continue;
      let v = 0;
      for (let n = 0; n < N; n++) v += F[(n * B + b) * T + s];
      row[s] = v;
    }
    return row;
  }
  function routingMat(D, phase, t) {
    const a = D["routing." + phase];
    if (!a) return null;
    const M = [];
    for (let n = 0; n < N; n++) { const r = []; for (let m = 0; m < N; m++) r.push(dense(a, (t * N + n) * N + m)); M.push(r); }
    return M;
  }

  // ------------------------------------------------------------ colours (the PNG renderer's maps)
  const lut = (arr, i) => "rgb(" + arr[3 * i] + "," + arr[3 * i + 1] + "," + arr[3 * i + 2] + ")";
  function colourOf(v, lim, signed) {
    if (isNaN(v)) return null;
    if (signed) {
      const u = lim > 0 ? Math.max(-1, Math.min(1, v / lim)) : 0;
      return lut(META.cmap.div, Math.round((u + 1) * 127.5));
    }
    const u = lim > 0 ? Math.max(0, Math.min(1, v / lim)) : 0;
    return lut(META.cmap.seq, Math.round(u * 255));
  }
  // The colour rule (docs/explorer.md): the colour map follows what a quantity is, not the signs
  // one row happens to have. Sequential, from 0, only for what is never negative: the softmax
  // patterns (the model's and the twin's) and the post-compose skip branch (the pattern itself).
  // Everything signed (scores, composed maps, qp, kp, qg, kg, static, routing, flows, dynamic
  // weights) diverging, centred on 0.
  function signedView(view, phase) {
    return !(view === "pattern" || view === "twin" || (view === "branch:skip" && phase === "post"));
  }
  function rangeOf(vals, signed) {
    let lo = Infinity, hi = -Infinity;
    for (const v of vals) if (!isNaN(v)) { lo = Math.min(lo, v); hi = Math.max(hi, v); }
    if (lo === Infinity) return { signed: !!signed, lim: 0, lo: 0, hi: 0 };
    return { signed: !!signed || lo < 0, lim: Math.max(Math.abs(lo), Math.abs(hi)), lo, hi };
  }
  let hatch = null;                                   // masked cells: grey with a diagonal hatch, as in the PNGs
  function hatchPattern(ctx) {
    if (hatch) return hatch;
    const c = document.createElement("canvas"); c.width = c.height = 5;
    const x = c.getContext("2d");
    x.fillStyle = "rgb(214,214,214)"; x.fillRect(0, 0, 5, 5);
    x.fillStyle = "rgb(168,168,168)";
    for (let i = 0; i < 5; i++) x.fillRect(i, 4 - i, 1, 1);
    hatch = ctx.createPattern(c, "repeat");
    return hatch;
  }
  const fmt = (v) => (v === null || isNaN(v)) ? "masked" : (Math.abs(v) >= 100 ? v.toFixed(1) : v.toFixed(3));
  const tokLabel = (s) => JSON.stringify(TOK[s]).slice(1, -1);

  // ------------------------------------------------------------ drawing helpers
  const CELL = Math.max(2, Math.min(14, Math.floor((Math.max(700, window.innerWidth) - 260) / T)));
  function strip(vals, signed, onPick, mark) {       // one row over keys, its own colour scale
    const c = document.createElement("canvas");
    c.width = T * CELL; c.height = 14;
    const ctx = c.getContext("2d"), r = rangeOf(vals, signed);
    c.dataset.cmap = r.signed ? "div" : "seq";
    for (let s = 0; s < T; s++) {
      ctx.fillStyle = isNaN(vals[s]) ? hatchPattern(ctx) : colourOf(vals[s], r.lim, r.signed);
      ctx.fillRect(s * CELL, 0, CELL, 14);
    }
    if (mark !== null && mark !== undefined) { ctx.strokeStyle = "#c0392b"; ctx.lineWidth = 2; ctx.strokeRect(mark * CELL + 1, 1, CELL - 2, 12); }
    tip(c, (e) => { const s = Math.floor(e.offsetX / CELL); return s >= 0 && s < T ? "key " + s + " '" + tokLabel(s) + "': " + fmt(vals[s]) : ""; });
    if (onPick) c.addEventListener("click", (e) => onPick(Math.floor(e.offsetX / CELL)));
    return { el: c, r };
  }
  function rowEl(label, vals, signed, on, onLabel, onPick, mark) {
    const d = document.createElement("div"); d.className = "strip-row" + (on ? " on" : "");
    const l = document.createElement("span"); l.className = "lab"; l.textContent = label;
    if (onLabel) l.addEventListener("click", onLabel);
    const s = strip(vals, signed, onPick, mark);
    const g = document.createElement("span"); g.className = "rng";
    g.textContent = s.r.signed ? "\u00b1" + s.r.lim.toPrecision(3) : "0.." + s.r.hi.toPrecision(3);
    d.append(l, s.el, g);
    return d;
  }
  function tip(el, text) {
    el.addEventListener("mousemove", (e) => { const t = text(e), b = $("dcs-tip"); b.hidden = !t; b.textContent = t; b.style.left = (e.clientX + 12) + "px"; b.style.top = (e.clientY + 12) + "px"; });
    el.addEventListener("mouseleave", () => { $("dcs-tip").hidden = true; });
  }
  function matTable(M, rowLab, colLab, cls, onCol, colOn) { // routing, flows, dynamic weights: all signed
    let lim = 0;
    const signed = true;
    for (const r of M) for (const v of r) if (!isNaN(v)) lim = Math.max(lim, Math.abs(v));
    const t = document.createElement("table"); t.className = "mat " + cls;
    const h = t.insertRow(); h.appendChild(document.createElement("th"));
    colLab.forEach((c, j) => { const th = document.createElement("th"); th.textContent = c; if (j === colOn) th.className = "on"; if (onCol) { th.style.cursor = "pointer"; th.onclick = () => onCol(j); } h.appendChild(th); });
    M.forEach((r, i) => {
      const tr = t.insertRow(); const th = document.createElement("th"); th.textContent = rowLab[i]; tr.appendChild(th);
      r.forEach((v) => {
        const td = tr.insertCell(); td.textContent = fmt(v);
        const col = colourOf(v, lim, signed);
        if (col) { td.style.background = col; if (lim > 0 && Math.abs(v) / lim > 0.7) td.style.color = "#fff"; }
      });
    });
    const w = document.createElement("div"); w.className = "hscroll"; w.appendChild(t);  // scrolls under itself
    return w;
  }

  // ------------------------------------------------------------ the panels
  const H = (n) => "H" + n;
  function rowFor(D, view, n, t, phase) {
    if (view === "pattern" || view === "scores" || view === "pattern_composed" || view === "scores_composed") return mapRow(D, view, n, t);
    if (view === "twin") return mapRow(D, "twin.pattern", n, t);
    if (view.startsWith("branch:")) {
      const b = FB.indexOf(view.slice(7));
      return b < 0 ? null : branchRow(flows(D, phase, n, t), b);
    }
    return null;
  }
  function defaultKey(D, t) {
    const r = mapRow(D, META.dcmha ? "pattern_composed" : "pattern", state.head, t);
    let best = t;
    for (let s = 0; s <= t; s++) if (!isNaN(r[s]) && Math.abs(r[s]) > Math.abs(r[best])) best = s;
    return best;
  }
  function visible(D, t, s) { return s !== null && s >= D._lo[t] && s <= t; }

  function drawTokens(D, t, row, signed) {
    const box = $("dcs-tokens");
    if (!box.childElementCount) {
      TOK.forEach((s, i) => {
        const sp = document.createElement("span"); sp.className = "tok"; sp.textContent = s.replace(/\n/g, "\u23ce");
        sp.dataset.pos = i; sp.title = "position " + i;
        sp.addEventListener("click", () => { state.query = i; state.key = null; state.preview = null; update(); });
        sp.addEventListener("mouseenter", () => { state.preview = i; update(); });
        sp.addEventListener("mouseleave", () => { state.preview = null; update(); });
        box.appendChild(sp);
      });
    }
    const r = row ? rangeOf(row, signed) : null;
    [...box.children].forEach((sp, s) => {
      const v = row ? row[s] : NaN, masked = row && isNaN(v);
      sp.className = "tok" + (masked ? " masked" : "") + (s === t ? " query" : "") + (s === state.key ? " key" : "");
      const col = row && !masked ? colourOf(v, r.lim, r.signed) : null;
      sp.style.background = col || "";
      const u = r && r.lim > 0 ? Math.abs(v) / r.lim : 0;
      sp.style.color = col && ((r.signed && u > 0.7) || (!r.signed && u < 0.55)) ? "#fff" : "";
      sp.title = "position " + s + (row ? ": " + fmt(v) : "");
    });
  }

  function drawSelected(D, t, phase) {
    const box = $("dcs-selected"); box.textContent = "";
    const v = state.view, m = state.head, L = state.layer;
    let values = null, title = "";
    if (v === "routing") {
      const M = routingMat(D, phase, t);
      title = "layer " + L + ", " + phase + "-compose routing at query " + t + " '" + tokLabel(t) + "': R[source n, target m]";
      if (!M) { box.textContent = "plain multi-head attention: no routing between heads"; }
      else {
        values = M;
        const f = document.createElement("div"); f.className = "flexrow";
        f.append(matTable(M, M.map((_, n) => "src " + H(n)), M.map((_, j) => H(j)), "routing", (j) => { state.head = j; update(); }, m), headGraph(M));
        box.appendChild(f);
        box.insertAdjacentHTML("beforeend", "<p class=note>R[n, m] = \u2211<sub>s</sub> X[n, t, s] C[t, s][n, m]: how much of source head n's " + (phase === "pre" ? "score (signed logits)" : "attention") + " lands in target head m; edge widths in the graph are |R| (self-loops left out).</p>");
      }
    } else if (v === "flows") {
      const s = state.key;
      title = "flows into layer " + L + " " + H(m) + " at query " + t + " '" + tokLabel(t) + "', key " + s + " '" + tokLabel(s) + "' (" + phase + ")";
      values = flowsTable(D, box, phase, m, t, s);
    } else {
      values = rowFor(D, v, m, t, phase);
      const what = { pattern: "softmax pattern", pattern_composed: "composed weights (what multiplies v)", scores: "raw scores", scores_composed: "composed scores", twin: (META.twin || "twin") + " pattern" }[v] || (phase + "-compose branch " + v.slice(7));
      title = "layer " + L + " " + H(m) + ", " + what + ", query " + t + " '" + tokLabel(t) + "'";
      if (!values) box.textContent = "not in this page";
      else {
        box.appendChild(bars(values, signedView(v, phase)));
        const order = [...values.keys()].filter((s) => !isNaN(values[s])).sort((a, b) => Math.abs(values[b]) - Math.abs(values[a])).slice(0, 6);
        box.insertAdjacentHTML("beforeend", "<div class=top>largest: " + order.map((s) => s + " '" + tokLabel(s).replace(/</g, "&lt;") + "' " + fmt(values[s])).join(" &nbsp; ") + "</div>");
      }
    }
    $("dcs-selected-title").textContent = title;
    const json = values === null ? null : JSON.stringify(values instanceof Float64Array ? Array.from(values) : values, (k, x) => (typeof x === "number" && isNaN(x)) ? null : x);
    box.dataset.values = json === null ? "null" : json;
    Object.assign(box.dataset, { view: v, layer: L, head: m, query: t, phase, key: state.key === null ? "" : state.key });
    return values;
  }
  function niceTicks(lo, hi) {                       // about five round values spanning [lo, hi] (0 among them)
    if (!(hi > lo)) return [lo];
    const raw = (hi - lo) / 4, p = Math.pow(10, Math.floor(Math.log10(raw))), f = raw / p;
    const step = (f <= 1 ? 1 : f <= 2 ? 2 : f <= 2.5 ? 2.5 : f <= 5 ? 5 : 10) * p, out = [];
    for (let k = Math.ceil(lo / step - 1e-9); k * step <= hi * (1 + 1e-9) + 1e-300; k++) out.push(k === 0 ? 0 : Number((k * step).toPrecision(6)));
    return out;
  }
  function bars(vals, signed) {                      // the row as bars over keys, with a value axis on the left
    const c = document.createElement("canvas"), h = 110;
    c.width = T * CELL; c.height = h;
    const ctx = c.getContext("2d"), r = rangeOf(vals, signed);
    c.dataset.cmap = r.signed ? "div" : "seq";
    const lo = Math.min(0, r.lo), hi = Math.max(0, r.hi), y = (v) => hi === lo ? h - 1 : (hi - v) / (hi - lo) * (h - 2) + 1;
    const ticks = niceTicks(lo, hi), axis = document.createElement("div");
    axis.className = "axis"; axis.style.height = h + "px"; axis.dataset.ticks = JSON.stringify(ticks);
    ctx.fillStyle = "#eee";
    for (const v of ticks) {
      ctx.fillRect(0, Math.round(y(v)), T * CELL, 1);       // a light grid line at every tick
      const sp = document.createElement("span"); sp.textContent = String(v); sp.style.top = Math.round(y(v) - 7) + "px";
      axis.appendChild(sp);
    }
    for (let s = 0; s < T; s++) {
      if (isNaN(vals[s])) { ctx.fillStyle = hatchPattern(ctx); ctx.fillRect(s * CELL, 0, CELL, h); continue; }
      ctx.fillStyle = colourOf(vals[s], r.lim, r.signed) || "#888";
      const a = y(Math.max(0, vals[s])), b = y(Math.min(0, vals[s]));
      ctx.fillRect(s * CELL, a, Math.max(1, CELL - 1), Math.max(1, b - a));
      if (s === state.key) { ctx.strokeStyle = "#c0392b"; ctx.strokeRect(s * CELL + 0.5, 0.5, CELL - 1, h - 1); }
    }
    ctx.fillStyle = "#444"; ctx.fillRect(0, Math.round(y(0)), T * CELL, 1);
    tip(c, (e) => { const s = Math.floor(e.offsetX / CELL); return s >= 0 && s < T ? "key " + s + " '" + tokLabel(s) + "': " + fmt(vals[s]) : ""; });
    c.addEventListener("click", (e) => { const s = Math.floor(e.offsetX / CELL); if (!isNaN(vals[s])) { state.key = s; update(); } });
    const wrap = document.createElement("div"); wrap.className = "bars"; wrap.append(axis, c);
    return wrap;
  }
  function headGraph(M) {                            // sources left, targets right, width ~ |R[n, m]|
    const ns = "http://www.w3.org/2000/svg", W = 230, Hh = Math.max(120, N * 26 + 20);
    const svg = document.createElementNS(ns, "svg"); svg.setAttribute("width", W); svg.setAttribute("height", Hh);
    const yy = (n) => 16 + n * (Hh - 32) / Math.max(1, N - 1);
    let lim = 0; M.forEach((r, n) => r.forEach((v, m) => { if (n !== m) lim = Math.max(lim, Math.abs(v)); }));
    M.forEach((r, n) => r.forEach((v, m) => {
      if (n === m || lim === 0 || Math.abs(v) < 0.02 * lim) return;
      const e = document.createElementNS(ns, "path");
      e.setAttribute("d", "M40," + yy(n) + " C115," + yy(n) + " 115," + yy(m) + " 190," + yy(m));
      e.setAttribute("fill", "none"); e.setAttribute("stroke", v >= 0 ? "#c0392b" : "#2b5fab");
      e.setAttribute("stroke-width", (0.5 + 7 * Math.abs(v) / lim).toFixed(2)); e.setAttribute("stroke-opacity", m === state.head ? "0.9" : "0.35");
      const ti = document.createElementNS(ns, "title"); ti.textContent = H(n) + " \u2192 " + H(m) + ": " + fmt(v); e.appendChild(ti);
      svg.appendChild(e);
    }));
    for (let n = 0; n < N; n++) for (const [x, anchor] of [[32, "end"], [198, "start"]]) {
      const tx = document.createElementNS(ns, "text"); tx.setAttribute("x", x); tx.setAttribute("y", yy(n) + 4);
      tx.setAttribute("text-anchor", anchor); tx.textContent = H(n);
      if (x > 100 && n === state.head) tx.setAttribute("font-weight", "bold");
      svg.appendChild(tx);
    }
    return svg;
  }

  function drawHeads(D, t) {
    const box = $("dcs-heads-panel"); box.textContent = "";
    $("dcs-heads-title").textContent = "every head of layer " + state.layer + " at query " + t + " '" + tokLabel(t) + "'";
    const show = META.dcmha ? state.show : "pattern";
    for (let n = 0; n < N; n++) {
      const pick = () => { state.head = n; update(); };
      const lab = H(n);
      const rows = [];
      if (show !== "composed") rows.push(rowEl(lab + " pat", mapRow(D, "pattern", n, t), false, n === state.head, pick));
      if (show !== "pattern") rows.push(rowEl(lab + " comp", mapRow(D, "pattern_composed", n, t), true, n === state.head, pick));
      if (D["twin.pattern"]) rows.push(rowEl(H(n) + " twin", mapRow(D, "twin.pattern", n, t), false, n === state.head, pick));
      rows.forEach((r) => { if (inCircuit(state.layer, n)) { r.classList.add("circ"); r.title = "a head of the circuit"; } box.appendChild(r); });
    }
    box.insertAdjacentHTML("beforeend", "<p class=note>pat: softmax pattern; comp: composed weights (what multiplies v)" + (D["twin.pattern"] ? "; twin: " + META.twin + "'s pattern" : "") + ". Click a row to select its head" + (circHeads.size ? " (orange labels: heads of the circuit)" : "") + ". Each row has its own scale; hatched: masked (causal" + (META.windows[state.layer] > 0 ? ", window " + META.windows[state.layer] : "") + ").</p>");
  }
  function drawBranches(D, t, phase) {
    const box = $("dcs-branches"); box.textContent = "";
    $("dcs-branches-title").textContent = phase + "-compose branches of " + H(state.head) + " at query " + t + " (contribution per key)";
    if (!META.dcmha) { box.textContent = "plain multi-head attention: no composition"; return; }
    const F = flows(D, phase, state.head, t), pick = (s) => { if (visible(D, t, s)) { state.key = s; update(); } };
    FB.forEach((b, i) => box.appendChild(rowEl(b, branchRow(F, i), signedView("branch:" + b, phase), state.view === "branch:" + b, () => { state.view = "branch:" + b; update(); }, pick, state.key)));
    box.appendChild(rowEl("sum", mapRow(D, phase === "pre" ? "scores_composed" : "pattern_composed", state.head, t), true, false, null, pick, state.key));
    box.appendChild(rowEl(phase === "pre" ? "scores" : "pattern", mapRow(D, phase === "pre" ? "scores" : "pattern", state.head, t), phase === "pre", false, null, pick, state.key));
    box.insertAdjacentHTML("beforeend", "<p class=note>Click a branch name to show it above, a key to see its flows. The branches are computed in the page from the stored " + (phase === "pre" ? "scores" : "pattern") + " and dynamic weights.</p>");
  }
  function drawRouting(D, t, phase) {
    const box = $("dcs-routing"); box.textContent = "";
    box.parentElement.hidden = state.view === "routing";   // shown once: above, as the selected view
    if (box.parentElement.hidden) return;
    $("dcs-routing-title").textContent = phase + "-compose routing at query " + t + " (who lends to whom)";
    const M = routingMat(D, phase, t);
    if (!M) { box.textContent = "plain multi-head attention: no routing"; return; }
    const f = document.createElement("div"); f.className = "flexrow";
    f.append(matTable(M, M.map((_, n) => H(n)), M.map((_, j) => H(j)), "routing", (j) => { state.head = j; update(); }, state.head), headGraph(M));
    box.appendChild(f);
  }
  // the flows into head m at (t, s) as a table, with their total, the head's own share and the
  // composed value as stored (8-bit: rounded, so it differs from the flows' sum by up to its step)
  function flowsTable(D, box, phase, m, t, s) {
    const F = flows(D, phase, m, t), M = [];
    for (let n = 0; n < N; n++) M.push(FB.map((_, b) => F[(n * FB.length + b) * T + s]));
    box.appendChild(matTable(M, M.map((_, n) => "from " + H(n)), FB, "flows"));
    let own = 0, tot = 0;
    M.forEach((r, n) => r.forEach((x) => { tot += x; if (n === m) own += x; }));
    const name = phase === "pre" ? "scores_composed" : "pattern_composed", row = mapRow(D, name, m, t);
    const half = D[name] ? D[name].sc[m * T + t] / 2 : NaN;
    box.insertAdjacentHTML("beforeend", "<p class=note>sum of the flows " + fmt(tot) + ": " + H(m) + " itself " + fmt(own) + ", borrowed from other heads " + fmt(tot - own) +
      ". " + name + " as stored, rounded to 8 bits: <span class=rounded>" + fmt(row ? row[s] : NaN) + "</span> (\u00b1" + half.toPrecision(2) + "). Both come from rounded data (the flows from the stored " + (phase === "pre" ? "scores" : "pattern") + " and dynamic weights), so each may differ from the engine's value by a few steps. Click a key in the branches panel to move the key.</p>");
    return M;
  }
  function drawFlows(D, t, phase) {
    const box = $("dcs-flows"); box.textContent = "";
    box.parentElement.hidden = state.view === "flows";   // shown once: above, as the selected view
    if (box.parentElement.hidden) return;
    const s = state.key;
    $("dcs-flows-title").textContent = "flows into " + H(state.head) + " at (" + t + ", key " + s + " '" + tokLabel(s) + "'): source head \u00d7 branch";
    if (!META.dcmha) { box.textContent = "plain multi-head attention: every head keeps its own attention"; return; }
    flowsTable(D, box, phase, state.head, t, s);
  }
  function drawDyn(D, t) {
    const box = $("dcs-dyn"); box.textContent = "";
    $("dcs-dyn-title").textContent = "dynamic weights of token " + t + " '" + tokLabel(t) + "' (as query, and as key)";
    if (!META.dcmha) { box.textContent = "plain multi-head attention: none"; return; }
    const f = document.createElement("div"); f.className = "flexrow";
    for (const ph of ["pre", "post"]) {
      const rows = [], labs = [];
      for (const k of ["qw1", "qw2", "kw1", "kw2"]) {
        const a = D["dyn." + ph + "." + k]; if (!a) continue;
        const R = a.shape[1];
        for (let i = 0; i < R; i++) { labs.push(ph + "." + k + "[" + i + "]"); rows.push([...Array(N).keys()].map((n) => dense(a, (t * R + i) * N + n))); }
      }
      for (const k of ["qdd", "kdd"]) {
        const a = D["dyn." + ph + "." + k]; if (!a) continue;
        labs.push(ph + "." + k); rows.push([...Array(N).keys()].map((n) => dense(a, t * N + n)));
      }
      f.appendChild(matTable(rows, labs, [...Array(N).keys()].map(H), "dyn"));
    }
    box.appendChild(f);
    box.insertAdjacentHTML("beforeend", "<p class=note>C[t, s] = I + qw1[t]\u1d40qw2[t] + kw1[s]\u1d40kw2[s] + diag(qdd[t]) + diag(kdd[s]); q* rows act when this token is the query, k* rows when it is the key.</p>");
  }
  // ------------------------------------------------------------ the circuit tab (explore(circuit=...))
  const SVGNS = "http://www.w3.org/2000/svg";
  function svgEl(name, attrs, text) {
    const e = document.createElementNS(SVGNS, name);
    for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
    if (text !== undefined) e.textContent = text;
    return e;
  }
  const COL = { rp: "#2060c0", rn: "#c03030", cp: "#e08a00", cn: "#7d3c98" };   // residual +/-, composition +/-
  function edgeColour(e) { const neg = e.score !== null && e.score < 0; return e.kind === "comp" ? (neg ? COL.cn : COL.cp) : (neg ? COL.rn : COL.rp); }
  function coefAt(e, t, s) {                          // the edge's clean map entry at query t (key s for kp, kg)
    if (e.kind !== "comp") return null;
    return e.axis === "query" ? e.coef[t] : e.axis === "key" ? (s === null ? null : e.coef[s]) : e.coef;
  }
  const lentAt = (e, t) => e.kind === "comp" ? e.lent[t] : null;
  const pct = (v) => (100 * v).toFixed(v >= 0.995 || v < 0.1 ? 0 : 1) + "%";
  function selectHead(l, h, view, phase) {
    if (!META.layers.includes(l)) { $("dcs-status").textContent = "layer " + l + " is not in this page (build it with explore(..., layers=[...]) holding it)"; return; }
    state.layer = l; state.head = h; state.key = null;
    if (view && (VIEWS.includes(view))) state.view = view;
    if (phase) state.phase = phase;
    update();
  }
  function highlightEdge(name, on) {
    document.querySelectorAll("#dcs-circuit .cedge").forEach((p) => { if (p.dataset.edge === name) p.classList.toggle("hl", on); });
    document.querySelectorAll("#dcs-circuit tr[data-edge]").forEach((r) => { if (r.dataset.edge === name) r.classList.toggle("hl", on); });
  }
  function circuitGraph(t, s) {                      // the circuit as a layered graph: embed at the bottom, logits on top
    const L = META.n_layer, colW = N > 10 ? 66 : 86, RH = L > 8 ? 78 : 96, padL = 70, padT = 40;
    const bw = colW - 14, bh = 34;
    const W = padL + (N + 2) * colW + 10, Hh = padT + (L + 1) * RH + bh / 2 + 12;
    const X = (col) => padL + col * colW + colW / 2;  // col 0: the dynamic-weight input, 1..N: heads, N + 1: the MLP
    const Y = (row) => padT + (L + 1 - row) * RH;     // row 0: embed, 1..L: the layers, L + 1: logits
    const mid = X((N + 1) / 2);
    const at = (n) => n.kind === "embed" ? [mid, Y(0)] : n.kind === "logits" ? [mid, Y(L + 1)] : n.kind === "head" ? [X(1 + n.head), Y(n.layer + 1)]
      : n.kind === "dyn" ? [X(0), Y(n.layer + 1)] : [X(N + 1), Y(n.layer + 1) - 0.42 * RH];
    const byId = {}; CIRC.nodes.forEach((n) => { byId[n.id] = n; });
    const svg = svgEl("svg", { id: "dcs-circuit-svg", width: W, height: Hh, viewBox: "0 0 " + W + " " + Hh });
    const defs = svgEl("defs");
    for (const [k, c] of Object.entries(COL)) {
      const m = svgEl("marker", { id: "dcs-arrow-" + k, viewBox: "0 0 8 8", refX: 7, refY: 4, markerUnits: "userSpaceOnUse", markerWidth: 10, markerHeight: 10, orient: "auto" });
      m.appendChild(svgEl("path", { d: "M0,0 L8,4 L0,8 z", fill: c })); defs.appendChild(m);
    }
    svg.appendChild(defs);
    for (let l = 0; l < L; l++) {                     // the rows, faint: every head of every layer
      svg.appendChild(svgEl("text", { x: 6, y: Y(l + 1) + 4, class: "rowlab" }, "layer " + l));
      for (let h = 0; h < N; h++) svg.appendChild(svgEl("rect", { x: X(1 + h) - bw / 2, y: Y(l + 1) - bh / 2, width: bw, height: bh, rx: 4, class: "bgnode" }));
    }
    svg.appendChild(svgEl("text", { x: 6, y: Y(0) + 4, class: "rowlab" }, "embed"));
    svg.appendChild(svgEl("text", { x: 6, y: Y(L + 1) + 4, class: "rowlab" }, "logits"));
    let top = 0; CIRC.edges.forEach((e) => { if (e.score !== null) top = Math.max(top, Math.abs(e.score)); });
    const width = (e) => e.score === null || top === 0 ? 2 : 1.2 + 5.5 * Math.abs(e.score) / top;
    const PORT = { q: -0.3, k: 0, v: 0.3 }, pairs = {};
    const edges = svgEl("g", { class: "cedges" });
    for (const e of CIRC.edges) {
      const a = at(byId[e.sender]), b = at(byId[e.node]);
      let d;
      if (e.kind === "comp" && e.src === e.dst) {     // a head's own branch: a loop above it
        const k = pairs[e.node] = (pairs[e.node] || 0) + 1, yt = a[1] - bh / 2, up = 20 + 7 * k;
        d = "M" + (a[0] - 9) + "," + yt + " C" + (a[0] - 26) + "," + (yt - up) + " " + (a[0] + 26) + "," + (yt - up) + " " + (a[0] + 9) + "," + yt;
      } else if (e.kind === "comp") {                 // lending inside the layer: an arc above the row
        const key = e.sender + ">" + e.node, k = pairs[key] = (pairs[key] || 0) + 1, yt = a[1] - bh / 2;
        const up = Math.min(0.7 * RH, 16 + 0.16 * Math.abs(b[0] - a[0])) + 7 * (k - 1), dx = b[0] > a[0] ? 6 : -6;
        d = "M" + (a[0] + dx) + "," + yt + " C" + (a[0] + dx) + "," + (yt - up) + " " + (b[0] - dx) + "," + (yt - up) + " " + (b[0] - dx) + "," + yt;
      } else {                                        // residual: from the sender's top to the receiver's input below it
        const x2 = b[0] + (PORT[e.part] || 0) * bw, y1 = a[1] - bh / 2, y2 = b[1] + bh / 2, my = (y1 + y2) / 2;
        d = "M" + a[0] + "," + y1 + " C" + a[0] + "," + my + " " + x2 + "," + my + " " + x2 + "," + y2;
      }
      const neg = e.score !== null && e.score < 0, mk = e.kind === "comp" ? (neg ? "cn" : "cp") : (neg ? "rn" : "rp");
      const p = svgEl("path", { d, class: "cedge " + e.kind, fill: "none", stroke: edgeColour(e), "stroke-width": width(e).toFixed(2), "marker-end": "url(#dcs-arrow-" + mk + ")" });
      if (e.kind === "comp" && e.phase === "pre") p.setAttribute("stroke-dasharray", "5 3");
      p.dataset.edge = e.name;
      const c = coefAt(e, t, s), lent = lentAt(e, t);
      p.appendChild(svgEl("title", {}, e.name + (e.score !== null ? "\nscore " + fmt(e.score) : "") + (e.kind === "comp" ? "\nC at query " + t + (e.axis === "key" ? ", key " + s : "") + ": " + fmt(c) + "\nlent at query " + t + ": " + fmt(lent) : "")));
      p.addEventListener("mouseenter", () => highlightEdge(e.name, true));
      p.addEventListener("mouseleave", () => highlightEdge(e.name, false));
      edges.appendChild(p);
    }
    svg.appendChild(edges);
    for (const n of CIRC.nodes) {                     // the circuit's nodes, on top
      const [x, y] = at(n), head = n.kind === "head", sel = head && n.layer === state.layer && n.head === state.head;
      const w = head ? bw : n.kind === "embed" || n.kind === "logits" ? 2 * bw : bw;
      const g = svgEl("g", { class: "cnode" + (sel ? " on" : "") + (n.reaches ? "" : " dangling") });
      g.dataset.node = n.id; g.dataset.layer = n.layer; g.dataset.head = n.head;
      g.appendChild(svgEl("rect", { x: x - w / 2, y: y - bh / 2, width: w, height: bh, rx: 4 }));
      g.appendChild(svgEl("text", { x, y: head ? y - 3 : y + 4, "text-anchor": "middle", class: "nlab" }, n.kind === "head" ? "L" + n.layer + ".H" + n.head : n.id));
      if (head) g.appendChild(svgEl("text", { x, y: y + 11, "text-anchor": "middle", class: "small" }, "own " + pct(n.share[t])));
      g.appendChild(svgEl("title", {}, n.id + (n.reaches ? "" : " (does not reach the logits through the circuit)") + (head ? "\nat query " + t + ": own " + fmt(n.own[t]) + " of " + fmt(n.total[t]) + ", own share " + pct(n.share[t]) + "\nclick to select this head" : "")));
      if (head) g.addEventListener("click", () => selectHead(n.layer, n.head));
      svg.appendChild(g);
    }
    svg.dataset.nodes = CIRC.nodes.length; svg.dataset.edges = CIRC.edges.length;
    const wrap = document.createElement("div"); wrap.className = "hscroll"; wrap.appendChild(svg);
    return wrap;
  }
  function circuitHeads(t) {                         // each head of the circuit at the query: its own share of the flow into it
    const d = document.createElement("div"); d.className = "circ-side";
    const heads = CIRC.nodes.filter((n) => n.kind === "head");
    const tb = document.createElement("table"); tb.className = "mat circheads";
    tb.insertAdjacentHTML("beforeend", "<tr><th>head</th><th>own</th><th>total</th><th>own share</th></tr>");
    heads.forEach((n) => {
      const tr = tb.insertRow(); tr.dataset.node = n.id;
      if (n.layer === state.layer && n.head === state.head) tr.className = "on";
      const th = document.createElement("th"); th.textContent = n.id; tr.appendChild(th);
      [fmt(n.own[t]), fmt(n.total[t]), pct(n.share[t])].forEach((v) => { tr.insertCell().textContent = v; });
      tr.style.cursor = "pointer"; tr.addEventListener("click", () => selectHead(n.layer, n.head));
    });
    d.insertAdjacentHTML("beforeend", "<h3>heads of the circuit at query " + t + "</h3>");
    const w = document.createElement("div"); w.className = "hscroll"; w.appendChild(tb); d.appendChild(w);
    d.insertAdjacentHTML("beforeend", "<p class=note>From the post-compose routing R at query " + t + " (this prompt's pass): own = R[h, h], the part of the head's composed attention that comes from its own pattern; total = what all heads give it; own share = |own| / (|own| + \u2211 |what each other head lends|)" + (META.dcmha ? "" : " (100% without composition)") + ". Click a head to select it.</p>");
    d.insertAdjacentHTML("beforeend", "<p class=note><b>The graph</b>, bottom to top: the embedding, each layer (its dynamic-weight input at the left, its heads, its MLP at the right), the logits. Residual edges run from a sender's top to the receiver's q, k or v input (left to right under a head), or its dyn, MLP or logits input: <span style='color:" + COL.rp + "'>blue +</span>, <span style='color:" + COL.rn + "'>red \u2212</span> by the score's sign. Composition edges are arcs above a row: a head lending its scores (pre, dashed) or pattern (post, solid) to another through qp, kp or static, <span style='color:" + COL.cp + "'>orange +</span>, <span style='color:" + COL.cn + "'>purple \u2212</span>; loops are a head's own branches (skip, qg, kg). Widths by |score|; a dashed outline: a node that does not reach the logits through the circuit.</p>");
    return d;
  }
  function circuitEdges(t, s) {                      // the edges, largest |score| first, with their values at the query
    const d = document.createElement("div"); d.className = "circ-edges";
    const tb = document.createElement("table"); tb.className = "mat cedges";
    tb.insertAdjacentHTML("beforeend", "<tr><th>edge</th><th>kind</th><th>score</th><th>C[m\u2192n]</th><th>C at</th><th>lent at query " + t + "</th></tr>");
    let top = 0; CIRC.edges.forEach((e) => { if (e.score !== null) top = Math.max(top, Math.abs(e.score)); });
    for (const e of CIRC.edges) {
      const tr = tb.insertRow(); tr.dataset.edge = e.name; tr.dataset.kind = e.kind;
      const c = coefAt(e, t, s), lent = lentAt(e, t);
      const name = tr.insertCell(); name.className = "name"; name.textContent = e.name;
      name.style.borderLeft = "5px solid " + edgeColour(e);            // the edge's colour in the graph
      tr.insertCell().textContent = e.kind === "comp" ? (e.src === e.dst ? "own " : "lent ") + e.part : "residual";
      const sc = tr.insertCell(); sc.textContent = e.score === null ? "\u2013" : fmt(e.score); sc.className = "score";
      if (e.score !== null && top > 0) {                                // a bar of |score|, in the edge's colour
        const bar = document.createElement("span"); bar.className = "sbar";
        bar.style.width = (36 * Math.abs(e.score) / top).toFixed(1) + "px"; bar.style.background = edgeColour(e);
        sc.prepend(bar);
      }
      const cc = tr.insertCell(); cc.textContent = e.kind === "comp" ? fmt(c) : "\u2013"; cc.className = "coef";
      tr.insertCell().textContent = e.kind !== "comp" ? "" : e.axis === "query" ? "query " + t : e.axis === "key" ? "key " + s : "fixed";
      const lc = tr.insertCell(); lc.textContent = e.kind === "comp" ? fmt(lent) : "\u2013"; lc.className = "lent";
      tr.addEventListener("mouseenter", () => highlightEdge(e.name, true));
      tr.addEventListener("mouseleave", () => highlightEdge(e.name, false));
      const rx = CIRC.nodes.find((x) => x.id === e.node);
      if (rx && rx.kind === "head") {
        tr.style.cursor = "pointer";
        tr.addEventListener("click", () => selectHead(rx.layer, rx.head, e.kind === "comp" && META.dcmha ? "branch:" + e.branch : null, e.kind === "comp" ? e.phase : null));
      }
    }
    d.appendChild(tb);
    return d;
  }
  function drawCircuit(t) {
    if (!CIRC) return;
    const box = $("dcs-circuit"); box.textContent = "";
    const s = state.key;
    $("dcs-circuit-title").textContent = "circuit: " + CIRC.n_edges + " edges (" + CIRC.n_comp + " composition), " + CIRC.nodes.length + " nodes; values at query " + t + " '" + tokLabel(t) + "'" + (CIRC.n_comp ? ", key " + s + " '" + tokLabel(s) + "'" : "");
    const values = { query: t, key: s, edges: {}, heads: {} };
    CIRC.edges.forEach((e) => { values.edges[e.name] = { coef: coefAt(e, t, s), lent: lentAt(e, t) }; });
    CIRC.nodes.forEach((n) => { if (n.kind === "head") values.heads[n.id] = { own: n.own[t], total: n.total[t], share: n.share[t] }; });
    box.dataset.values = JSON.stringify(values);
    if (!CIRC.n_edges) { box.textContent = "the circuit has no edges"; return; }
    const row = document.createElement("div"); row.className = "flexrow";
    row.append(circuitGraph(t, s), circuitHeads(t));
    box.appendChild(row);
    box.appendChild(circuitEdges(t, s));
    box.insertAdjacentHTML("beforeend", "<p class=note>Edges by |score| (hover one to find it in the graph; click one to select its receiving head" + (META.dcmha ? ", and a composition edge's branch view" : "") + "). For a composition edge m \u2192 n: C, the clean map entry C[m, n] of its branch in this prompt's pass (qp, qg: at the query; kp, kg: at the selected key; skip, static: fixed); lent, \u2211<sub>s</sub> X[m, t, s] C[t, s][m, n] over the visible keys: what source m's " + "scores (pre) or pattern (post) give target n through that branch at query t. Computed by dclens from the engine's float values (6 digits), not from the page's 8-bit maps. Move the query in the token strip.</p>");
  }

  function igOf(l) { const i = META.layers.indexOf(l); return META.ig && i >= 0 ? META.ig.values[i] : null; }
  function drawIG() {
    const sec = $("dcs-ig-section");
    if (!META.ig) { sec.hidden = true; return; }
    const box = $("dcs-ig"); box.textContent = "";
    $("dcs-ig-title").textContent = META.ig.label + ": heads ranked by |value| (click to select)";
    const all = [];
    META.layers.forEach((l, i) => META.ig.values[i].forEach((v, n) => all.push([v, l, n])));
    all.sort((a, b) => Math.abs(b[0]) - Math.abs(a[0]));
    const lim = Math.max(1e-30, Math.abs(all[0][0]));
    const list = document.createElement("div"); list.className = "iglist"; box.appendChild(list);
    all.slice(0, 12).forEach(([v, l, n]) => {
      const d = document.createElement("div"); d.className = "igrow" + (l === state.layer && n === state.head ? " on" : "");
      d.innerHTML = "<span style='width:70px'>L" + l + " H" + n + "</span><span style='width:60px;text-align:right'>" + v.toFixed(3) + "</span>";
      const b = document.createElement("span"); b.className = "igbar" + (v < 0 ? " neg" : ""); b.style.width = (160 * Math.abs(v) / lim).toFixed(1) + "px";
      d.appendChild(b);
      d.addEventListener("click", () => { state.layer = l; state.head = n; state.key = null; update(); });
      list.appendChild(d);
    });
    if (META.ig.note) box.insertAdjacentHTML("beforeend", "<p class=note>" + META.ig.note.replace(/</g, "&lt;") + "</p>");
  }

  // ------------------------------------------------------------ state, fragment, controls
  const VIEWS = META.dcmha ? ["pattern", "pattern_composed", ...FB.map((b) => "branch:" + b), "routing", "flows", "scores", "scores_composed"] : ["pattern", "scores"];
  if (META.twin) VIEWS.push("twin");
  function readFragment() {
    const p = new URLSearchParams(location.hash.replace(/^#/, ""));
    const int = (k, lo, hi) => { if (!p.has(k)) return null; const v = Number(p.get(k)); if (!Number.isInteger(v)) return null; const w = v < 0 ? v + hi : v; return w >= lo && w < hi ? w : null; };
    const l = int("layer", 0, META.n_layer); if (l !== null && META.layers.includes(l)) state.layer = l;
    const h = int("head", 0, N); if (h !== null) state.head = h;
    const q = int("query", 0, T); if (q !== null) state.query = q;
    state.key = int("key", 0, T);                     // absent: the head's largest key
    if (p.has("view") && VIEWS.includes(p.get("view"))) state.view = p.get("view");
    state.phase = p.get("phase") === "pre" ? "pre" : "post";
    const tab = p.get("tab");
    state.tab = tab === "maps" || (tab === "circuit" && CIRC) ? tab : TAB0;
    const bad = ["layer", "head", "query", "key"].filter((x) => p.has(x) && int(x, 0, x === "layer" ? META.n_layer : x === "head" ? N : T) === null);
    if (p.has("layer") && int("layer", 0, META.n_layer) !== null && !META.layers.includes(int("layer", 0, META.n_layer))) bad.push("layer (not in this page)");
    if (p.has("view") && !VIEWS.includes(p.get("view"))) bad.push("view");
    if (p.has("tab") && state.tab !== tab) bad.push(tab === "circuit" ? "tab (no circuit in this page)" : "tab");
    notice = bad.length ? "ignored in the URL: " + bad.join(", ") : "";
  }
  function writeFragment() {
    const f = "layer=" + state.layer + "&head=" + state.head + "&query=" + state.query + "&view=" + state.view + "&phase=" + state.phase + (state.key !== null ? "&key=" + state.key : "") + (CIRC ? "&tab=" + state.tab : "");
    try { if (location.hash.slice(1) !== f) history.replaceState(null, "", "#" + f); } catch (e) { /* srcdoc iframes */ }
  }
  function setupControls() {
    const ls = $("dcs-layer");
    META.layers.forEach((l) => { const o = document.createElement("option"); o.value = l; o.textContent = l + (META.windows[l] > 0 ? " (local, window " + META.windows[l] + ")" : ""); ls.appendChild(o); });
    ls.onchange = () => { state.layer = Number(ls.value); state.key = null; update(); };
    const hs = $("dcs-heads");
    for (let n = 0; n < N; n++) { const b = document.createElement("button"); b.textContent = H(n); b.dataset.head = n; b.onclick = () => { state.head = n; update(); }; hs.appendChild(b); }
    const vs = $("dcs-view");
    VIEWS.forEach((v) => { const o = document.createElement("option"); o.value = v; o.textContent = v; vs.appendChild(o); });
    vs.onchange = () => { state.view = vs.value; update(); };
    $("dcs-phase").onchange = () => { state.phase = $("dcs-phase").value; update(); };
    $("dcs-show").onchange = () => { state.show = $("dcs-show").value; update(); };
    if (!META.dcmha) { $("dcs-phase").disabled = true; $("dcs-show").disabled = true; }
    if (CIRC) {
      $("dcs-tabs").hidden = false;
      $("dcs-tab-circuit").textContent = "circuit (" + CIRC.n_edges + " edges)";
      [...$("dcs-tabs").children].forEach((b) => { b.onclick = () => { state.tab = b.dataset.tab; update(); }; });
    }
    const held = META.layers.length === META.n_layer ? "all " + META.n_layer + " layers" : "layers " + META.layers.join(", ") + " of " + META.n_layer + " (build with layers=[...] for others)";
    $("dcs-holds").textContent = META.model + " \u00b7 " + T + " tokens \u00b7 " + held + (META.twin ? " \u00b7 twin " + META.twin : "") + (META.dcmha ? " \u00b7 pre- and post-compose" : " \u00b7 plain multi-head attention");
    document.addEventListener("keydown", (e) => {
      if (e.target.tagName === "SELECT") return;
      if (e.key === "ArrowLeft" && state.query > 0) { state.query--; state.key = null; update(); }
      if (e.key === "ArrowRight" && state.query < T - 1) { state.query++; state.key = null; update(); }
    });
    window.addEventListener("hashchange", () => { readFragment(); update(); });
  }

  let pending = 0, notice = "";                      // notice: what the status line says once drawn
  async function update() {
    const ticket = ++pending;
    document.body.dataset.ready = "0";
    if (!decoded[state.layer]) $("dcs-status").textContent = "decoding layer " + state.layer + "\u2026";
    const D = await decodeLayer(state.layer);
    if (ticket !== pending) return;                  // a later update draws
    const t = state.preview !== null ? state.preview : state.query;
    if (state.key === null || !visible(D, t, state.key)) state.key = defaultKey(D, t);
    if (!META.dcmha && !VIEWS.includes(state.view)) state.view = "pattern";
    $("dcs-layer").value = state.layer; $("dcs-view").value = state.view; $("dcs-phase").value = state.phase;
    const ig = igOf(state.layer);
    [...$("dcs-heads").children].forEach((b, n) => {
      b.className = (n === state.head ? "on" : "") + (inCircuit(state.layer, n) ? " circ" : "");
      b.title = (ig ? META.ig.label + ": " + ig[n].toFixed(3) : "") + (inCircuit(state.layer, n) ? (ig ? "; " : "") + "a head of the circuit" : "");
    });
    document.body.classList.toggle("tab-circuit", state.tab === "circuit");
    if (CIRC) [...$("dcs-tabs").children].forEach((b) => { b.className = b.dataset.tab === state.tab ? "on" : ""; b.setAttribute("aria-selected", String(b.dataset.tab === state.tab)); });
    const row = drawSelected(D, t, state.phase);
    const own = row && !Array.isArray(row);           // the selected view is a row over keys
    const stripRow = own ? row : mapRow(D, META.dcmha ? "pattern_composed" : "pattern", state.head, t);
    drawTokens(D, t, stripRow, own ? signedView(state.view, state.phase) : META.dcmha);
    drawHeads(D, t); drawBranches(D, t, state.phase); drawRouting(D, t, state.phase); drawFlows(D, t, state.phase); drawDyn(D, t); drawIG(); drawCircuit(t);
    $("dcs-status").textContent = notice;
    if (state.preview === null) writeFragment();
    document.body.dataset.ready = "1";
  }

  setupControls();
  readFragment();
  update().catch((e) => { $("dcs-status").textContent = "error: " + e; document.body.dataset.error = String(e); });
})();
