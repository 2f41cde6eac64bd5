// The report's only script. It reads the embedded JSON and builds the token panel with DOM
// calls and textContent only: model text is never parsed as HTML here.
(function () {
  "use strict";
  var data = JSON.parse(document.getElementById("lmtrace-data").textContent);
  var panel = document.getElementById("panel");
  var pinned = null; // [view, step] of the pinned token, or null
  var mode = "raw";
  var hoverLayer = null; // the heatmap row under the pointer
  var lines = {}, parsed = {}; // per view: its steps' JSON lines (split once), the steps parsed so far
  // A step's data, parsed when first asked for: a long report opens without parsing every step.
  // (A page may also embed its steps whole, as data.views[v].steps.)
  function stepAt(v, i) {
    var view = data.views[v];
    if (!view || i < 0 || i >= count(v)) return null;
    if (view.steps) return view.steps[i];
    var key = v + ":" + i;
    if (!(key in parsed)) {
      if (!lines[v]) lines[v] = document.getElementById("lmtrace-steps-" + v).textContent.split("\n");
      parsed[key] = JSON.parse(lines[v][i]);
    }
    return parsed[key];
  }
  function count(v) {
    var view = data.views[v];
    return !view ? 0 : view.steps ? view.steps.length : view.count;
  }
  document.documentElement.classList.add("js"); // the raw/sampled switch only works with script

  function el(tag, cls, text) {
    var e = document.createElement(tag);
    if (cls) e.className = cls;
    if (text !== undefined && text !== null) e.textContent = String(text);
    return e;
  }
  function num(x, digits) {
    if (x === null || x === undefined) return "–";
    if (typeof x !== "number") return String(x);
    return Number.isInteger(x) ? String(x) : x.toPrecision(digits || 4);
  }
  // a probability as a person reads it: 0.412, 0.0031, or "< 0.0001" (never 4.260e-14)
  function pr(p) {
    if (p === null || p === undefined) return "–";
    if (p >= 0.01 || p === 0) return p === 0 ? "0" : p.toFixed(3);
    return p >= 0.0001 ? p.toFixed(4) : "< 0.0001";
  }
  function bytes(n) {
    if (typeof n !== "number") return num(n);
    var units = ["B", "KiB", "MiB", "GiB"], i = 0;
    while (Math.abs(n) >= 1024 && i < units.length - 1) { n /= 1024; i++; }
    return (i ? n.toPrecision(3) : String(n)) + " " + units[i];
  }
  function bucketColour(p) {
    var scale = [[0.9, "--b0"], [0.5, "--b1"], [0.2, "--b2"], [0.05, "--b3"], [0, "--b4"]];
    if (p === null || p === undefined) return "var(--bn)";
    for (var k = 0; k < scale.length; k++) if (p >= scale[k][0]) return "var(" + scale[k][1] + ")";
    return "var(--b4)";
  }
  function rows(dl, pairs) {
    pairs.forEach(function (kv) {
      if (kv[1] === undefined) return;
      dl.appendChild(el("dt", null, kv[0]));
      dl.appendChild(el("dd", null, kv[1]));
    });
  }
  function bar(p, cls) {
    var fill = el("div", "bar-fill" + (cls ? " " + cls : ""));
    fill.style.width = (Math.max(0, Math.min(1, p || 0)) * 100).toFixed(1) + "%";
    if (!cls) fill.style.background = bucketColour(p);
    return fill;
  }
  function alternatives(s) {
    var table = el("table", "alts"), showSampled = data.sampled || s.p === null, head = el("tr");
    ["token", showSampled ? "bar: raw, sampled" : "", "raw"].forEach(function (h) { head.appendChild(el("th", null, h)); });
    if (showSampled) head.appendChild(el("th", null, "sampled"));
    head.firstChild.style.textAlign = "left";
    table.appendChild(head);
    s.top.forEach(function (a) {
      var tr = el("tr", a.chosen ? "chosen" : null), track = el("div", "bar-track");
      track.appendChild(bar(a.p));
      if (showSampled) track.appendChild(bar(a.sp, "sampled"));
      var td = el("td");
      td.appendChild(track);
      tr.appendChild(el("td", "t", a.shown));
      tr.appendChild(td);
      tr.appendChild(el("td", "n", pr(a.p)));
      // a null sampled probability is a token the processors filtered out
      if (showSampled) tr.appendChild(el("td", "n", a.sp === null ? "cut" : pr(a.sp)));
      tr.title = "token id " + a.id;
      table.appendChild(tr);
    });
    return table;
  }
  function grid(list) {
    // a table of records with whatever keys they have (waterfall stages, KV layers)
    var cols = [];
    list.forEach(function (r) { Object.keys(r).forEach(function (k) { if (cols.indexOf(k) < 0) cols.push(k); }); });
    var table = el("table", "data"), head = el("tr");
    cols.forEach(function (c) { head.appendChild(el("th", null, c)); });
    table.appendChild(head);
    list.forEach(function (r) {
      var tr = el("tr");
      cols.forEach(function (c) {
        var v = r[c];
        tr.appendChild(el("td", null, v !== null && typeof v === "object" ? JSON.stringify(v) : num(v)));
      });
      table.appendChild(tr);
    });
    var box = el("div", "scroll");
    box.appendChild(table);
    return box;
  }
  var last = null; // the step shown last
  function show(v, i) {
    var view = data.views[v], s = stepAt(v, i);
    if (!s) return;
    last = [v, i];
    panel.replaceChildren();
    var title = (data.views.length > 1 ? view.label + " · " : "") + (data.kind === "score" ? "token " : "step ") + s.i;
    panel.appendChild(el("h3", null, title));
    var tok = el("span", "panel-token", s.shown);
    tok.style.background = bucketColour(mode === "sampled" && s.sp !== null ? s.sp : s.p);
    panel.appendChild(tok);
    var dl = el("dl", "panel-nums");
    rows(dl, [
      ["token id", num(s.id)],
      ["bytes", s.own !== s.shown ? s.own : undefined],
      ["probability", pr(s.p) + "  (logprob " + num(s.lp) + ")"],
      ["sampled prob.", data.sampled || (s.p === null && s.sp !== null) ? pr(s.sp) : undefined],
      ["rank", num(s.rank)],
      ["entropy", s.H === null || s.H === undefined ? undefined : num(s.H, 3) + " nats"],
      ["sampled entropy", (data.sampled || s.H === null) && s.sH !== null && s.sH !== undefined ? num(s.sH, 3) + " nats" : undefined],
      ["KV cache", s.kv ? s.kv.seq_len + " positions, " + bytes(s.kv.bytes) : undefined],
      ["KV by formula", s.kv && s.kv.expected_bytes !== undefined ? bytes(s.kv.expected_bytes) : undefined],
      ["time", s.ms !== null && s.ms !== undefined ? num(s.ms, 3) + " ms" : undefined]
    ]);
    Object.keys(s.extra || {}).forEach(function (k) { rows(dl, [[k, num(s.extra[k])]]); });
    panel.appendChild(dl);
    (s.problems || []).forEach(function (m) { panel.appendChild(el("p", "panel-problem", "⚠ " + m)); });
    if (s.top && s.top.length) {
      panel.appendChild(el("h4", null, "alternatives"));
      panel.appendChild(alternatives(s));
    }
    if (s.waterfall && s.waterfall.length) {
      panel.appendChild(el("h4", null, "sampling waterfall"));
      panel.appendChild(grid(s.waterfall));
    }
    var kvLayers = s.kv && (s.kv.layers || (s.kv.rows || []).map(function (r) {
      var o = {};
      s.kv.cols.forEach(function (c, k) { o[c] = r[k]; });
      return o;
    }));
    if (kvLayers && kvLayers.length) {  // the ledger's layers as a table of columns (views.kv_view)
      var details = el("details");
      details.appendChild(el("summary", null, "KV cache by layer (" + kvLayers.length + ")"));
      details.appendChild(grid(kvLayers));
      panel.appendChild(details);
    }
    if (s.lens) lensPanel(s);
    if (s.attr) attributionPanel(s);
    if (s.att) attentionText(v, i);
    mark(v, i);
  }
  // Attribution of a step: each part's share of logit(chosen) - logit(other), largest first, as
  // bars from a centre line (right: toward the chosen token); an attention part opens its heads.
  function attributionPanel(s) {
    var a = s.attr, top = 0;
    a.parts.forEach(function (p) { top = Math.max(top, Math.abs(p[1])); });
    panel.appendChild(el("h4", null, "attribution · vs " + JSON.stringify(a.against) + " · logit diff " + num(a.diff)));
    function row(table, name, value, scale) {
      var tr = el("tr"), track = el("div", "bar-track attr"), fill = el("div", "bar-fill " + (value >= 0 ? "pos" : "neg"));
      var w = scale > 0 ? Math.min(1, Math.abs(value) / scale) * 50 : 0;
      fill.style.width = w.toFixed(1) + "%";
      fill.style.left = (value >= 0 ? 50 : 50 - w).toFixed(1) + "%";
      track.appendChild(fill);
      var td = el("td");
      td.appendChild(track);
      tr.appendChild(el("td", "t", name));
      tr.appendChild(td);
      tr.appendChild(el("td", "n", (value >= 0 ? "+" : "") + num(value, 3)));
      table.appendChild(tr);
    }
    var table = el("table", "alts attr");
    a.parts.slice(0, 12).forEach(function (p) { row(table, p[0], p[1], top); });
    panel.appendChild(table);
    a.parts.slice(0, 12).forEach(function (p) {
      var m = /^L(\d+)\.attn$/.exec(p[0]), heads = m && a.heads[m[1]];
      if (!heads || !heads.length) return;
      var details = el("details"), inner = el("table", "alts attr");
      details.appendChild(el("summary", null, p[0] + " by head (" + heads.length + ")"));
      heads.forEach(function (h) { row(inner, h[0] === "bias" ? "bias" : "h" + h[0], h[1], top); });
      details.appendChild(inner);
      panel.appendChild(details);
    });
    if (a.parts.length > 12) panel.appendChild(el("p", "meta", (a.parts.length - 12) + " smaller parts in the JSON"));
  }
  // The logit lens of a step: per layer the chosen token's probability and rank, and the top
  // tokens of the hovered layer (a heatmap cell) or of the settling layer.
  function lensPanel(s) {
    var at = hoverLayer !== null ? hoverLayer : (s.lens.settled !== null ? s.lens.settled : s.lens.layers.length - 1);
    panel.appendChild(el("h4", null, "logit lens · settled at layer " + num(s.lens.settled)));
    var layer = s.lens.layers[at];
    if (layer) {
      panel.appendChild(el("p", "meta", (layer.l === 0 ? "embeddings (layer 0)" : "layer " + layer.l) + " top tokens:"));
      var list = el("table", "alts");
      layer.top.forEach(function (t) {
        var tr = el("tr"), track = el("div", "bar-track"), td = el("td");
        track.appendChild(bar(t[1]));
        td.appendChild(track);
        tr.appendChild(el("td", "t", t[0]));
        tr.appendChild(td);
        tr.appendChild(el("td", "n", pr(t[1])));
        list.appendChild(tr);
      });
      panel.appendChild(list);
    }
    var table = el("table", "data lens"), head = el("tr");
    ["layer", "p(chosen)", "rank", "top-1", "entropy", "KL"].forEach(function (h) { head.appendChild(el("th", null, h)); });
    table.appendChild(head);
    s.lens.layers.slice().reverse().forEach(function (x) {
      var tr = el("tr", (x.l === at ? "here" : "") + (x.l === s.lens.settled ? " settled" : ""));
      [x.l === 0 ? "emb" : x.l, pr(x.p), num(x.rank), x.top.length ? x.top[0][0] : "–", num(x.H, 3), num(x.kl, 3)].forEach(function (c) {
        tr.appendChild(el("td", null, c));
      });
      table.appendChild(tr);
    });
    var box = el("div", "scroll");
    box.appendChild(table);
    panel.appendChild(box);
  }
  // Shades the attention text by the step's weights at the chosen layer (or their mean): the
  // value-weighted ones by default, the raw ones when asked (or for one head: only raw per head).
  function attentionText(v, i) {
    var s = stepAt(v, i), select = document.getElementById("att-layer");
    var boxes = document.querySelectorAll(".att-text .pos");
    if (!boxes.length || !select) return;
    var layers = s.att.layers, pick = select.value, weights = {}, chosen = layers;
    var headSelect = document.getElementById("att-head"), head = headSelect ? headSelect.value : "mean";
    var picked = document.querySelector('input[name="att-weights"]:checked');
    var valued = (!picked || picked.value === "vw") && head === "mean" && layers.some(function (x) { return x.vw; });
    if (pick !== "mean") chosen = layers.filter(function (x) { return String(x.l) === pick; });
    if (head !== "mean") {  // one head's own record of each chosen layer (attention="heads")
      chosen = chosen.filter(function (x) { return x.heads && x.heads[+head]; }).map(function (x) {
        var h = x.heads[+head];
        return {l: x.l, head: +head, top: h.top, sink: h.sink, recent: h.recent, H: h.H};
      });
    }
    var shown = chosen.map(function (x) { return valued && x.vw ? {l: x.l, top: x.vw.top, sink: x.vw.sink, H: x.vw.H, raw: x} : x; });
    shown.forEach(function (x) {
      x.top.forEach(function (t) { weights[t[0]] = (weights[t[0]] || 0) + t[1] / shown.length; });
    });
    var most = Math.max.apply(null, Object.keys(weights).map(function (k) { return weights[k]; }).concat([1e-9]));
    var prompt = document.querySelectorAll(".att-text .pos.in-prompt").length, query = prompt + i - 1;
    boxes.forEach(function (b) {
      var pos = +b.dataset.pos, w = weights[pos] || 0;
      b.style.background = w > 0 ? "rgba(37, 99, 235, " + (0.08 + 0.72 * w / most).toFixed(3) + ")" : "";
      b.title = "position " + pos + (w > 0 ? " · weight " + num(w, 3) : "");
      b.classList.toggle("future", pos > query);
      b.classList.toggle("query", pos === query);
    });
    var one = shown.length === 1 ? shown[0] : null, note = document.getElementById("att-note");
    var which = head !== "mean" ? ", head " + head : "", kind = valued ? "value-weighted" : "raw weights";
    var recent = +document.querySelector(".att-controls").dataset.recent || 0;  // shown only past the window
    var facts = one ? [["sink mass (first 4)", num(one.sink, 3)]] : [];
    if (one && valued) facts.push(["raw sink mass", num(one.raw.sink, 3)]);
    if (one && recent) facts.push(["last-" + recent + " mass", num((one.raw || one).recent, 3)]);
    if (one) facts.push(["entropy", num(one.H, 3) + " nats"]);
    note.textContent = "step " + s.i + " (" + s.shown + "), " + (one ? "layer " + (one.l + 1) : "mean of " + shown.length + " layers") +
      which + ", " + kind + (facts.length ? ": " + facts.map(function (f) { return f[0] + " " + f[1]; }).join(", ") : "");
    if (one) {
      panel.appendChild(el("h4", null, "attention · layer " + (one.l + 1) + which + " · " + kind));
      var dl = el("dl", "panel-nums");
      rows(dl, facts);
      panel.appendChild(dl);
    }
  }
  function mark(v, i) {
    document.querySelectorAll(".tok.sel").forEach(function (t) { t.classList.remove("sel"); });
    var box = document.querySelector('.text[data-v="' + v + '"] .tok[data-i="' + i + '"]');
    if (box) box.classList.add("sel");
    document.querySelectorAll("svg.chart").forEach(function (svg) {
      var c = svg.querySelector(".cursor"), x = +svg.dataset.x0 + i * +svg.dataset.dx;
      if (!c || svg.closest(".no-cursor")) return;
      c.setAttribute("x1", x); c.setAttribute("x2", x); c.setAttribute("visibility", "visible");
    });
  }
  // A long trace's heatmap is painted as paths (render/html/inside.py): its cell under the pointer is
  // found from the grid the svg describes, [view, step, layer], or null off the cells.
  function paintedCell(e) {
    var svg = e.target.closest ? e.target.closest("svg.heatmap[data-cw]") : null;
    if (!svg || e.clientX === undefined) return null;
    var pt = svg.createSVGPoint();
    pt.x = e.clientX; pt.y = e.clientY;
    var at = pt.matrixTransform(svg.getScreenCTM().inverse()), d = svg.dataset;
    var i = Math.floor((at.x - d.x0) / d.cw), row = Math.floor((at.y - d.y0) / d.ch);
    if (i < 0 || i >= +d.steps || row < 0 || row >= +d.layers) return null;
    return [+d.v, i, +d.layers - 1 - row];
  }
  function target(e) {
    var cell = paintedCell(e);
    if (cell) {
      hoverLayer = cell[2];
      return [cell[0], cell[1]];
    }
    var t = e.target.closest ? e.target.closest(".tok[data-i], circle[data-i], rect[data-i]") : null;
    if (!t) return null;
    hoverLayer = t.dataset.l !== undefined ? +t.dataset.l : null;
    var text = t.closest(".text");
    return [text ? +text.dataset.v : +t.dataset.v, +t.dataset.i];
  }
  document.addEventListener("mouseover", function (e) {
    var at = target(e);
    if (at && !pinned) show(at[0], at[1]);
  });
  var lastCell = null; // the painted heatmap's cell last shown: moving within one path fires no mouseover
  document.addEventListener("mousemove", function (e) {
    var cell = paintedCell(e);
    if (!cell || pinned || (lastCell && lastCell.join() === cell.join())) return;
    lastCell = cell;
    hoverLayer = cell[2];
    show(cell[0], cell[1]);
  });
  document.addEventListener("focusin", function (e) {
    var at = target(e);
    if (at && !pinned) show(at[0], at[1]);
  });
  document.addEventListener("click", function (e) {
    var at = target(e);
    if (!at) return;
    pinned = pinned && pinned[0] === at[0] && pinned[1] === at[1] ? null : at;
    panel.classList.toggle("pinned", !!pinned);
    show(at[0], at[1]);
  });
  document.addEventListener("keydown", function (e) {
    if (!pinned) return;
    if (e.key === "Escape") { pinned = null; panel.classList.remove("pinned"); return; }
    var d = e.key === "ArrowRight" ? 1 : e.key === "ArrowLeft" ? -1 : 0;
    var next = pinned[1] + d;
    if (d && next >= 0 && next < count(pinned[0])) {
      pinned = [pinned[0], next];
      show(pinned[0], next);
      e.preventDefault();
    }
  });
  function again() {
    var at = pinned || last;
    if (at) show(at[0], at[1]);
  }
  ["att-layer", "att-head"].forEach(function (id) {
    var select = document.getElementById(id);
    if (select) select.addEventListener("change", again);
  });
  document.querySelectorAll('input[name="att-weights"]').forEach(function (input) { input.addEventListener("change", again); });
  // the attention text is shaded from the start: by the last step, until another is pointed at
  if (document.querySelector(".att-text")) {
    var at = count(0) - 1;
    while (at > 0 && !stepAt(0, at).att) at--;
    if (stepAt(0, at) && stepAt(0, at).att) show(0, at);
  }
  document.querySelectorAll('input[name="dist"]').forEach(function (input) {
    input.addEventListener("change", function () {
      mode = input.value;
      document.body.classList.toggle("mode-raw", mode === "raw");
      document.body.classList.toggle("mode-sampled", mode === "sampled");
      if (pinned) show(pinned[0], pinned[1]);
    });
  });
})();
