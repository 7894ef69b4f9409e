"""The depth-map explorer's page: one self-contained HTML file with its data embedded.

Vanilla JavaScript on <canvas>, touching no server, network, storage or dialog: it opens from disk
and inside MLflow's artifact view (an iframe sandboxed to `allow-scripts`). Weights travel as base64
uint16 (w · 65535), far finer than a colour shows. The body's data-ready, data-cells, data-heat-rect
and data-errors attributes let a headless browser check the page.
"""
from __future__ import annotations

import html
import json
import re


def render_page(data: dict) -> str:
    """The HTML page for explorer data (see evaluation.explorer.explorer_data)."""
    fill = {"__TITLE__": html.escape(str(data.get("title", "Depth attention"))), "__DATA__": script_json(data)}
    # one pass: a title or a prompt holding "__DATA__" is text, not a place to fill
    return re.sub("__TITLE__|__DATA__", lambda m: fill[m.group(0)], _TEMPLATE)


# Inside <script> the HTML parser ends the element at "</script" and changes state at "<!--";
# JSON's \u escapes of < > & (and of U+2028/2029, line ends to older JavaScript) keep the text
# the same JSON while no such sequence can form.
_SCRIPT_UNSAFE = {"<": "\\u003c", ">": "\\u003e", "&": "\\u0026", "\u2028": "\\u2028", "\u2029": "\\u2029"}


def script_json(data) -> str:
    """`data` as JSON text that a <script type="application/json"> element holds unchanged."""
    text = json.dumps(data, separators=(",", ":"))
    return re.sub("[<>&\u2028\u2029]", lambda m: _SCRIPT_UNSAFE[m.group(0)], text)


_TEMPLATE = r"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>__TITLE__</title>
<style>
  body { font: 14px/1.4 system-ui, -apple-system, "Segoe UI", sans-serif; margin: 16px 20px; color: #1d2330; background: #fff; }
  h1 { font-size: 20px; margin: 0 0 2px; }
  .meta { color: #5a6272; margin-bottom: 10px; }
  .controls { display: flex; flex-wrap: wrap; gap: 18px; align-items: center; padding: 8px 10px; background: #f3f5f8; border-radius: 6px; }
  .controls fieldset { border: none; margin: 0; padding: 0; display: flex; gap: 8px; align-items: center; }
  .controls legend { float: left; font-weight: 600; margin-right: 6px; padding: 0; }
  .tokens { margin: 10px 0; font-family: ui-monospace, "SFMono-Regular", Menlo, Consolas, monospace; line-height: 1.9; word-break: break-all; }
  .tok { padding: 1px 2px; margin: 0 1px; border-radius: 3px; cursor: pointer; background: #eef1f5; white-space: pre; }
  .tok.sel { background: #ffb000; color: #000; }
  .tok.pinned { outline: 2px solid #c24100; }
  .hint { color: #6b7382; font-size: 12px; }
  .main { display: flex; flex-wrap: wrap; gap: 24px; align-items: flex-start; }
  .side { min-width: 300px; max-width: 460px; }
  .side h3, .strip h3 { font-size: 14px; margin: 4px 0; }
  canvas { display: block; }
  #heat { cursor: crosshair; }
  #strip { cursor: crosshair; }
  .bars text { font: 11px ui-monospace, Menlo, Consolas, monospace; fill: #1d2330; }
  .error { display: none; background: #b00020; color: #fff; padding: 6px 10px; border-radius: 4px; margin: 8px 0; }
  footer { margin-top: 18px; color: #5a6272; font-size: 12px; max-width: 900px; }
</style>
</head>
<body data-ready="0" data-errors="0" data-cells="0">
<div id="error" class="error"></div>
<h1 id="title"></h1>
<div class="meta" id="meta"></div>
<div class="controls">
  <fieldset><legend>Prompt</legend><select id="prompt"></select></fieldset>
  <fieldset><legend>Weights</legend>
    <label><input type="radio" name="view" value="token" checked> hovered token</label>
    <label><input type="radio" name="view" value="avg"> average over tokens</label>
  </fieldset>
  <fieldset><legend>Rows</legend>
    <label><input type="checkbox" id="rows-attn" checked> attention</label>
    <label><input type="checkbox" id="rows-mlp" checked> MLP</label>
    <label><input type="checkbox" id="rows-out" checked> output read</label>
  </fieldset>
  <fieldset><legend>Colour</legend>
    <label><input type="checkbox" id="stretch"> stretch to the largest weight shown</label>
  </fieldset>
</div>
<div class="tokens" id="tokens"></div>
<div class="hint">Hover a token to see its depth weights; click it to pin (arrow keys move). Hover a row of the map to see that sublayer's weights over its sources.</div>
<div class="main">
  <div><h3 id="heat-title"></h3><canvas id="heat"></canvas></div>
  <div class="side">
    <h3 id="detail-title">Hover a row of the map</h3>
    <svg id="bars" class="bars" width="440" height="40"></svg>
    <h3>Colour scale</h3>
    <canvas id="legend" width="300" height="34"></canvas>
  </div>
</div>
<div class="strip"><h3 id="strip-title"></h3><canvas id="strip"></canvas></div>
<footer id="notes"></footer>
<script type="application/json" id="depth-data">__DATA__</script>
<script>
"use strict";
(function () {
  var errors = 0;
  function reportError(message) {
    errors += 1;
    document.body.setAttribute("data-errors", String(errors));
    var box = document.getElementById("error");
    box.style.display = "block";
    box.textContent = "Error: " + message;
  }
  window.addEventListener("error", function (e) { reportError(e.message || String(e)); });

  var D = JSON.parse(document.getElementById("depth-data").textContent);
  var R = D.rows.length, C = D.cols.length;
  var visible = D.visible;  // string of "0"/"1", row-major R x C
  var rowBound = {}, colBound = {};
  D.row_bounds.forEach(function (r) { rowBound[r] = true; });
  D.col_bounds.forEach(function (c) { colBound[c] = true; });

  // Decode every prompt's weights once: Float32Array of R*T*C, [reader][token][source].
  D.prompts.forEach(function (p) {
    var bin = atob(p.weights), n = bin.length / 2, out = new Float32Array(n);
    for (var i = 0; i < n; i++) out[i] = (bin.charCodeAt(2 * i) | (bin.charCodeAt(2 * i + 1) << 8)) / D.scale;
    p.w = out;
    p.T = p.tokens.length;
  });

  var state = { prompt: 0, token: D.prompts[0].T - 1, pinned: false, view: "token", row: R - 1, hoverCol: -1, vmax: 1 };

  // Viridis, five stops, linearly interpolated.
  var STOPS = [[68, 1, 84], [59, 82, 139], [33, 145, 140], [94, 201, 98], [253, 231, 37]];
  function colour(x) {
    x = Math.max(0, Math.min(1, x / state.vmax)) * (STOPS.length - 1);
    var i = Math.min(STOPS.length - 2, Math.floor(x)), f = x - i, a = STOPS[i], b = STOPS[i + 1];
    return "rgb(" + Math.round(a[0] + f * (b[0] - a[0])) + "," + Math.round(a[1] + f * (b[1] - a[1])) + "," + Math.round(a[2] + f * (b[2] - a[2])) + ")";
  }
  function isVisible(r, c) { return visible.charCodeAt(r * C + c) === 49; }
  function weight(p, r, t, c) { return p.w[(r * p.T + t) * C + c]; }
  function rowWeights(p, r) {
    var out = new Float32Array(C);
    if (state.view === "avg") {
      for (var t = 0; t < p.T; t++) for (var c = 0; c < C; c++) out[c] += weight(p, r, t, c) / p.T;
    } else {
      for (var c2 = 0; c2 < C; c2++) out[c2] = weight(p, r, state.token, c2);
    }
    return out;
  }
  function shownRows() {
    var kinds = { attn: document.getElementById("rows-attn").checked, mlp: document.getElementById("rows-mlp").checked, out: document.getElementById("rows-out").checked };
    var rows = [];
    for (var r = 0; r < R; r++) if (kinds[D.rows[r].kind]) rows.push(r);
    return rows;
  }
  function setupCanvas(canvas, w, h) {
    var dpr = window.devicePixelRatio || 1;
    canvas.width = Math.round(w * dpr); canvas.height = Math.round(h * dpr);
    canvas.style.width = w + "px"; canvas.style.height = h + "px";
    var ctx = canvas.getContext("2d");
    ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
    return ctx;
  }
  function hatch(ctx, x, y, w, h) {
    ctx.fillStyle = "#eceef2"; ctx.fillRect(x, y, w, h);
    ctx.strokeStyle = "#d3d7de"; ctx.lineWidth = 1; ctx.beginPath();
    ctx.moveTo(x, y + h); ctx.lineTo(x + w, y); ctx.stroke();
  }

  // --- the heat map: readers (rows) x sources (columns) -------------------------------------------
  var heat = { left: 52, top: 46, cell: 16, rows: [] };
  function drawHeat() {
    var p = D.prompts[state.prompt], rows = shownRows();
    heat.rows = rows;
    // Many sources give small weights: optionally map the largest one shown to the top colour.
    state.vmax = 1;
    if (document.getElementById("stretch").checked) {
      var top = 1e-6;
      rows.forEach(function (r) { var ws = rowWeights(p, r); for (var c = 0; c < C; c++) if (isVisible(r, c)) top = Math.max(top, ws[c]); });
      state.vmax = top;
    }
    heat.cell = Math.max(8, Math.min(36, Math.floor(Math.min(620 / C, 520 / Math.max(1, rows.length)))));
    var s = heat.cell, w = heat.left + C * s + 10, h = heat.top + rows.length * s + 10;
    var ctx = setupCanvas(document.getElementById("heat"), w, h);
    ctx.clearRect(0, 0, w, h);
    ctx.font = "11px ui-monospace, Menlo, Consolas, monospace";
    var cells = 0;
    rows.forEach(function (r, i) {
      var ws = rowWeights(p, r);
      for (var c = 0; c < C; c++) {
        var x = heat.left + c * s, y = heat.top + i * s;
        if (isVisible(r, c)) { ctx.fillStyle = colour(ws[c]); ctx.fillRect(x, y, s, s); cells++; }
        else hatch(ctx, x, y, s, s);
      }
      ctx.fillStyle = r === state.row ? "#c24100" : "#1d2330";
      ctx.textAlign = "right"; ctx.textBaseline = "middle";
      ctx.fillText(D.rows[r].label, heat.left - 6, heat.top + i * s + s / 2);
    });
    ctx.save();
    for (var c = 0; c < C; c++) {
      ctx.save();
      ctx.translate(heat.left + c * s + s / 2, heat.top - 6);
      ctx.rotate(-Math.PI / 2);
      ctx.fillStyle = c === state.hoverCol ? "#c24100" : "#1d2330";
      ctx.textAlign = "left"; ctx.textBaseline = "middle";
      ctx.fillText(D.cols[c].label, 0, 0);
      ctx.restore();
    }
    ctx.restore();
    // Block boundaries: white lines after the rows / columns that close a block.
    ctx.strokeStyle = "#ffffff"; ctx.lineWidth = 2;
    rows.forEach(function (r, i) {
      // A block closes between two shown rows when it closes at any reader from r up to the next
      // shown one (the closing row itself may be hidden by the row filter).
      var closes = false;
      for (var k = r; i < rows.length - 1 && k < rows[i + 1]; k++) closes = closes || !!rowBound[k];
      if (closes) {
        ctx.beginPath(); ctx.moveTo(heat.left, heat.top + (i + 1) * s); ctx.lineTo(heat.left + C * s, heat.top + (i + 1) * s); ctx.stroke();
      }
    });
    for (var c3 = 0; c3 < C - 1; c3++) if (colBound[c3]) {
      ctx.beginPath(); ctx.moveTo(heat.left + (c3 + 1) * s, heat.top); ctx.lineTo(heat.left + (c3 + 1) * s, heat.top + rows.length * s); ctx.stroke();
    }
    var sel = rows.indexOf(state.row);
    if (sel >= 0) { ctx.strokeStyle = "#ff3b00"; ctx.lineWidth = 2; ctx.strokeRect(heat.left - 1, heat.top + sel * s - 1, C * s + 2, s + 2); }
    document.body.setAttribute("data-cells", String(cells));
    var tok = state.view === "avg" ? "average over " + p.T + " tokens" : "token " + state.token + " " + JSON.stringify(p.tokens[state.token]);
    document.getElementById("heat-title").textContent = "Depth weights, " + tok + " (rows: readers; columns: sources)";
  }

  // --- the selected reader's weights over its sources, as bars --------------------------------------
  function drawBars() {
    var p = D.prompts[state.prompt], r = state.row, ws = rowWeights(p, r);
    var svg = document.getElementById("bars"), NS = "http://www.w3.org/2000/svg";
    while (svg.firstChild) svg.removeChild(svg.firstChild);
    var cols = [];
    for (var c = 0; c < C; c++) if (isVisible(r, c)) cols.push(c);
    var bh = 14, width = 440, labelW = 70, valueW = 52, barW = width - labelW - valueW;
    svg.setAttribute("height", String(cols.length * bh + 6));
    var best = 0;
    cols.forEach(function (c) { best = Math.max(best, ws[c]); });
    cols.forEach(function (c, i) {
      var y = i * bh + 2;
      var label = document.createElementNS(NS, "text");
      label.setAttribute("x", String(labelW - 6)); label.setAttribute("y", String(y + 10)); label.setAttribute("text-anchor", "end");
      label.textContent = D.cols[c].label;
      var rect = document.createElementNS(NS, "rect");
      rect.setAttribute("x", String(labelW)); rect.setAttribute("y", String(y + 1));
      rect.setAttribute("width", String(Math.max(1, barW * ws[c] / Math.max(best, 1e-9)))); rect.setAttribute("height", String(bh - 3));
      rect.setAttribute("fill", colour(ws[c]));
      var title = document.createElementNS(NS, "title");
      title.textContent = D.cols[c].title + ": " + ws[c].toFixed(4);
      rect.appendChild(title);
      var value = document.createElementNS(NS, "text");
      value.setAttribute("x", String(labelW + barW + 4)); value.setAttribute("y", String(y + 10));
      value.textContent = ws[c].toFixed(3);
      svg.appendChild(label); svg.appendChild(rect); svg.appendChild(value);
    });
    var where = state.view === "avg" ? "averaged over tokens" : "at token " + state.token;
    document.getElementById("detail-title").textContent = D.rows[r].title + " reads " + cols.length + " sources, " + where;
  }

  // --- the selected reader across tokens: sources (rows) x tokens (columns) --------------------------
  var strip = { left: 52, top: 8, cell: 10 };
  function drawStrip() {
    var p = D.prompts[state.prompt], r = state.row;
    strip.cell = Math.max(6, Math.min(22, Math.floor(900 / p.T)));
    var s = strip.cell, h = Math.max(6, Math.min(16, Math.floor(300 / C)));
    strip.rowH = h;
    var w = strip.left + p.T * s + 10, height = strip.top + C * h + 8;
    var ctx = setupCanvas(document.getElementById("strip"), w, height);
    ctx.clearRect(0, 0, w, height);
    ctx.font = "10px ui-monospace, Menlo, Consolas, monospace";
    for (var c = 0; c < C; c++) {
      for (var t = 0; t < p.T; t++) {
        var x = strip.left + t * s, y = strip.top + c * h;
        if (isVisible(r, c)) { ctx.fillStyle = colour(weight(p, r, t, c)); ctx.fillRect(x, y, s, h); }
        else hatch(ctx, x, y, s, h);
      }
      if (h >= 9) { ctx.fillStyle = "#1d2330"; ctx.textAlign = "right"; ctx.textBaseline = "middle"; ctx.fillText(D.cols[c].label, strip.left - 6, strip.top + c * h + h / 2); }
    }
    if (state.view === "token") { ctx.strokeStyle = "#ff3b00"; ctx.lineWidth = 2; ctx.strokeRect(strip.left + state.token * s, strip.top - 1, s, C * h + 2); }
    document.getElementById("strip-title").textContent = D.rows[r].title + ": weights over sources at every token of the prompt (columns: tokens)";
  }

  function drawLegend() {
    var ctx = setupCanvas(document.getElementById("legend"), 300, 34);
    for (var i = 0; i < 280; i++) { ctx.fillStyle = colour(state.vmax * i / 279); ctx.fillRect(10 + i, 2, 1, 14); }
    ctx.fillStyle = "#1d2330"; ctx.font = "11px system-ui, sans-serif";
    ctx.textAlign = "left"; ctx.fillText("0", 10, 29);
    ctx.textAlign = "center"; ctx.fillText((state.vmax / 2).toFixed(3).replace(/\.?0+$/, ""), 150, 29);
    ctx.textAlign = "right"; ctx.fillText(state.vmax.toFixed(3).replace(/\.?0+$/, ""), 290, 29);
  }

  function drawTokens() {
    var p = D.prompts[state.prompt], box = document.getElementById("tokens");
    while (box.firstChild) box.removeChild(box.firstChild);
    p.tokens.forEach(function (tok, t) {
      var span = document.createElement("span");
      span.className = "tok" + (t === state.token && state.view === "token" ? " sel" : "") + (t === state.token && state.pinned ? " pinned" : "");
      span.textContent = tok;
      span.title = "token " + t;
      span.addEventListener("mouseenter", function () { if (!state.pinned) { state.token = t; update(false); } });
      span.addEventListener("click", function () { state.pinned = !(state.pinned && state.token === t); state.token = t; update(false); });
      box.appendChild(span);
    });
  }
  function markTokens() {
    var spans = document.getElementById("tokens").children;
    for (var t = 0; t < spans.length; t++) {
      spans[t].className = "tok" + (t === state.token && state.view === "token" ? " sel" : "") + (t === state.token && state.pinned ? " pinned" : "");
    }
  }

  function update(rebuildTokens) {
    if (rebuildTokens) drawTokens(); else markTokens();
    drawHeat(); drawBars(); drawStrip(); drawLegend();
  }

  // --- wiring --------------------------------------------------------------------------------------
  document.getElementById("title").textContent = D.title;
  document.getElementById("meta").textContent = D.subtitle;
  document.getElementById("notes").textContent = D.notes;
  var select = document.getElementById("prompt");
  D.prompts.forEach(function (p, i) {
    var o = document.createElement("option"); o.value = String(i); o.textContent = p.name; select.appendChild(o);
  });
  select.addEventListener("change", function () {
    state.prompt = Number(select.value); state.token = D.prompts[state.prompt].T - 1; state.pinned = false; update(true);
  });
  Array.prototype.forEach.call(document.querySelectorAll("input[name=view]"), function (el) {
    el.addEventListener("change", function () { state.view = el.value; update(false); });
  });
  ["rows-attn", "rows-mlp", "rows-out", "stretch"].forEach(function (id) {
    document.getElementById(id).addEventListener("change", function () {
      var rows = shownRows();
      if (rows.length && rows.indexOf(state.row) < 0) state.row = rows[rows.length - 1];
      update(false);
    });
  });
  document.getElementById("heat").addEventListener("mousemove", function (e) {
    var rect = e.target.getBoundingClientRect(), s = heat.cell;
    var i = Math.floor((e.clientY - rect.top - heat.top) / s), c = Math.floor((e.clientX - rect.left - heat.left) / s);
    if (i >= 0 && i < heat.rows.length && heat.rows[i] !== state.row) { state.row = heat.rows[i]; state.hoverCol = c; update(false); }
    else if (c !== state.hoverCol) { state.hoverCol = (c >= 0 && c < C) ? c : -1; drawHeat(); }
  });
  document.getElementById("strip").addEventListener("mousemove", function (e) {
    var rect = e.target.getBoundingClientRect(), t = Math.floor((e.clientX - rect.left - strip.left) / strip.cell);
    var p = D.prompts[state.prompt];
    if (!state.pinned && t >= 0 && t < p.T && t !== state.token) { state.token = t; update(false); }
  });
  document.addEventListener("keydown", function (e) {
    var p = D.prompts[state.prompt];
    if (e.key === "ArrowLeft" && state.token > 0) { state.token -= 1; update(false); }
    if (e.key === "ArrowRight" && state.token < p.T - 1) { state.token += 1; update(false); }
  });

  // A view can be linked: #prompt=1&token=5&row=2&view=avg&rows=attn,out&stretch=1
  (function applyHash() {
    var args = {};
    window.location.hash.replace(/^#/, "").split("&").forEach(function (kv) {
      var i = kv.indexOf("="); if (i > 0) args[kv.slice(0, i)] = decodeURIComponent(kv.slice(i + 1));
    });
    var n = function (v, hi) { v = parseInt(v, 10); return isNaN(v) ? null : Math.max(0, Math.min(hi, v)); };
    if (args.prompt !== undefined && n(args.prompt, D.prompts.length - 1) !== null) {
      state.prompt = n(args.prompt, D.prompts.length - 1); select.value = String(state.prompt);
      state.token = D.prompts[state.prompt].T - 1;
    }
    if (args.token !== undefined && n(args.token, D.prompts[state.prompt].T - 1) !== null) { state.token = n(args.token, D.prompts[state.prompt].T - 1); state.pinned = true; }
    if (args.row !== undefined && n(args.row, R - 1) !== null) state.row = n(args.row, R - 1);
    if (args.view === "avg" || args.view === "token") {
      state.view = args.view;
      document.querySelector("input[name=view][value=" + args.view + "]").checked = true;
    }
    if (args.rows) ["attn", "mlp", "out"].forEach(function (k) { document.getElementById("rows-" + k).checked = args.rows.split(",").indexOf(k) >= 0; });
    if (args.stretch) document.getElementById("stretch").checked = args.stretch === "1";
    var rows = shownRows();
    if (rows.length && rows.indexOf(state.row) < 0) state.row = rows[rows.length - 1];
  })();
  update(true);
  // Where the heat map's cells are, in page pixels: lets a headless test look at exactly those.
  var box = document.getElementById("heat").getBoundingClientRect();
  document.body.setAttribute("data-heat-rect", [box.left + window.scrollX + heat.left, box.top + window.scrollY + heat.top,
    C * heat.cell, heat.rows.length * heat.cell].map(Math.round).join(","));
  document.body.setAttribute("data-ready", "1");
})();
</script>
</body>
</html>
"""
