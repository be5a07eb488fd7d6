"""The page's inline CSS and script. The script only ever writes data through `textContent`
and `setAttribute` of attributes it names (never innerHTML), and the page's
Content-Security-Policy allows this one script by its hash and nothing else, so even a value
that escaped escaping could not run."""

from __future__ import annotations

import base64
import hashlib

CSS = """
body{font:14px/1.4 system-ui,sans-serif;margin:1.5em;color:#1b1f24;background:#fafbfc}
h1{font-size:1.3em;margin:0 0 .2em}h2{font-size:1.05em;margin:1.4em 0 .4em}
.meta{color:#57606a;font-size:.9em}
table{border-collapse:collapse;background:#fff;box-shadow:0 0 0 1px #d0d7de}
th,td{padding:.3em .7em;text-align:left;border-bottom:1px solid #eaeef2;vertical-align:top}
th{background:#f3f5f7;font-weight:600}td.n,th.n{text-align:right;font-variant-numeric:tabular-nums}
td{max-width:32em;overflow-wrap:anywhere}
.cards{display:flex;gap:1em;flex-wrap:wrap}.card{background:#fff;box-shadow:0 0 0 1px #d0d7de;
padding:.5em 1em;min-width:9em}.card b{display:block;font-size:1.3em}
.bad b{color:#cf222e}svg{background:#fff;box-shadow:0 0 0 1px #d0d7de}
.critical{stroke:#cf222e}.ordinary{stroke:#0969da}polyline{fill:none;stroke-width:2}
pre{background:#fff;box-shadow:0 0 0 1px #d0d7de;padding:.6em;overflow-x:auto}
.legend span{margin-right:1em}.legend .critical{color:#cf222e}.legend .ordinary{color:#0969da}
.axis{font-size:11px;fill:#57606a}.empty{color:#57606a}
.banner{background:#cf222e;color:#fff;padding:.6em 1em;font-weight:600;margin:.8em 0}
.allup{background:#dafbe1;color:#116329;padding:.6em 1em;margin:.8em 0}
tr.down td{background:#ffebe9;color:#82071e;font-weight:600}
"""

SCRIPT = """
(function () {
  "use strict";
  var interval = Number(document.body.getAttribute("data-refresh")) * 1000 || 3000;
  var offset = document.body.getAttribute("data-offset") || "0";
  // A fleet's page of one database names it (relay/serving/ui/fleet.py); else nothing.
  var database = document.body.getAttribute("data-database");
  var of = database === null ? "" : "&database=" + encodeURIComponent(database);
  function cell(tr, value) {
    var td = document.createElement("td");
    // A link only to a run page (view.py builds those); any other pair is text.
    if (Array.isArray(value) && String(value[1]).indexOf("/runs/") === 0) {
      var a = document.createElement("a");
      a.setAttribute("href", value[1]);
      a.textContent = value[0];
      td.appendChild(a);
    } else {
      td.textContent = Array.isArray(value) ? String(value[0]) : value;
    }
    tr.appendChild(td);
  }
  function rows(id, data) {
    var body = document.getElementById(id);
    if (!body) { return; }
    while (body.firstChild) { body.removeChild(body.firstChild); }
    data.forEach(function (r) {
      var tr = document.createElement("tr");
      r.forEach(function (v) { cell(tr, v); });
      body.appendChild(tr);
    });
    var empty = document.getElementById(id + "-empty");
    if (empty) { empty.hidden = data.length > 0; }
  }
  function apply(view) {
    var f = view.figures;
    Object.keys(f).forEach(function (k) {
      document.querySelectorAll('[data-k="' + k + '"]').forEach(function (el) {
        el.textContent = f[k];
      });
    });
    document.querySelectorAll("[data-alarm]").forEach(function (el) {
      var calm = (el.getAttribute("data-calm") || "0").split("|");
      el.classList.toggle("bad", calm.indexOf(f[el.getAttribute("data-alarm")]) < 0);
    });
    rows("blocked-rows", view.blocked);
    rows("key-rows", view.keys || []);
    rows("fleet-rows", view.fleet);
    ["critical", "ordinary"].forEach(function (lane) {
      var line = document.getElementById("line-" + lane);
      if (line) { line.setAttribute("points", view.chart[lane]); }
    });
    var top = document.getElementById("chart-max");
    if (top) { top.textContent = view.chart.max; }
    document.body.setAttribute("data-updates",
      String(Number(document.body.getAttribute("data-updates") || "0") + 1));
  }
  function tick() {
    fetch("/api/status?offset=" + encodeURIComponent(offset) + of,
          {credentials: "same-origin", cache: "no-store"})
      .then(function (r) { if (!r.ok) { throw new Error("HTTP " + r.status); } return r.json(); })
      .then(function (d) {
        apply(d.view);
        document.getElementById("updated").textContent = "live";
      })
      .catch(function (e) {
        document.getElementById("updated").textContent = "refresh failed: " + e.message;
      })
      .finally(function () { setTimeout(tick, interval); });
  }
  if (document.getElementById("blocked-rows")) { setTimeout(tick, interval); }
})();
"""


def _hash(text: str) -> str:
    return "sha256-" + base64.b64encode(hashlib.sha256(text.encode()).digest()).decode()


CSP = (
    "default-src 'none'; connect-src 'self'; img-src 'self'; "
    f"style-src '{_hash(CSS)}'; script-src '{_hash(SCRIPT)}'; "
    "base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
