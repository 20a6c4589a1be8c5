"""The data server's status page at ``/``: one self-contained HTML document (no CDN, no build
step) whose script polls ``/v1/cluster`` every two seconds and draws nodes, the ring, each job's
roles with their restorable step and where each shard and replica lives, cache fill, the link gate
and recent failures with their recovery. A follower data server's page says which server
coordinates and links to it."""

from __future__ import annotations

__all__ = ["STATUS_PAGE"]

STATUS_PAGE = """<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>ffplane status</title>
<style>
 body { font: 14px/1.4 system-ui, sans-serif; margin: 1.5em; color: #222; }
 h1 { font-size: 1.4em; margin: 0 0 .2em; } h2 { font-size: 1.1em; margin: 1.4em 0 .4em; }
 table { border-collapse: collapse; margin-bottom: .5em; } td, th { padding: .25em .7em; border-bottom: 1px solid #ddd; text-align: left; }
 th { background: #f4f4f4; } .alive { color: #1a7f37; } .dead, .closed { color: #c0392b; } .unreachable { color: #b7791f; }
 .bar { display: inline-block; width: 90px; height: 10px; background: #eee; vertical-align: middle; margin-right: .4em; }
 .bar span { display: block; height: 100%; background: #4a7fd4; } .muted { color: #888; } code { font-size: 13px; }
 #ring li { display: inline; } #ring li:not(:last-child)::after { content: " \\2192  "; color: #888; }
</style>
</head>
<body>
<h1>ffplane</h1>
<div id="meta" class="muted">loading&hellip;</div>
<div id="error" class="dead"></div>
<h2>Nodes</h2>
<table id="nodes"><thead><tr><th>node</th><th>state</th><th>address</th><th>roles (newest committed step)</th><th>replicas held</th><th>checkpoints held</th><th>cache</th><th>link gate</th></tr></thead><tbody></tbody></table>
<h2>Ring</h2><ol id="ring"></ol>
<h2>Jobs</h2><div id="jobs"></div>
<h2>Recent failures</h2>
<table id="failures"><thead><tr><th>when</th><th>what</th><th>node</th><th>job / worker</th><th>recovered after</th></tr></thead><tbody></tbody></table>
<script>
"use strict";
const esc = (s) => String(s ?? "").replace(/[&<>"']/g, (c) => ({"&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;"})[c]);
const mib = (b) => (b / 1048576).toFixed(0) + " MiB";
// Only an http(s) URL becomes a link: the leader's URL comes from another server (its
// --advertise-url, through etcd), and a javascript: one must not run on a click.
const link = (url) => /^https?:[/][/][^\\s"'<>]+$/i.test(url) ? '<a href="' + esc(url) + '/">' + esc(url) + "</a>" : esc(url);
const row = (cells) => "<tr>" + cells.map((c) => "<td>" + c + "</td>").join("") + "</tr>";

function draw(c) {
  document.getElementById("error").textContent = "";
  document.getElementById("meta").textContent = "coordinator " + c.leader + " \\u00b7 updated " + new Date().toLocaleTimeString();
  const nodes = Object.entries(c.members).map(([id, m]) => {
    const d = c.daemons[id] || {}, st = d.state || {}, cache = d.cache || {}, gate = d.gate || {};
    const state = m.alive ? (d.unreadable === undefined ? "alive" : "unreadable") : (m.unreachable ? "unreachable" : "dead");
    const stateCell = state === "unreadable" ? "<span class=unreachable>unreadable</span><br><span class=muted>" + esc(d.unreadable) + "</span>" : "<span class=" + state + ">" + state + "</span>";
    const roles = (st.roles || []).map((r) => esc(r.job + "/" + r.role) + " @" + Math.max(...(r.versions || []).map((v) => v.step), -1)).join("<br>") || "<span class=muted>-</span>";
    const replicas = new Set((st.replicas || []).filter((r) => r.kind !== "incoming").map((r) => r.job + "/" + r.role)).size;
    const fill = cache.budget_bytes ? Math.min(100, 100 * (cache.bytes + (st.slot_bytes || 0)) / cache.budget_bytes) : 0;
    const cacheCell = cache.budget_bytes ? '<span class=bar><span style="width:' + fill.toFixed(0) + '%"></span></span>' + mib(cache.bytes) + " cache, " + mib(st.slot_bytes || 0) + " slots / " + mib(cache.budget_bytes) : "-";
    const held = st.held || {};  // slots and replica files here, as a multiple of this node's roles' shards
    const heldCell = typeof held.slots_bytes === "number" ? mib(held.slots_bytes + (held.replicas_bytes || 0)) +
      (typeof held.multiple === "number" ? " = " + held.multiple.toFixed(2) + "x its shards" : "") +
      (held.survives || []).map((w) => "<br><span class=muted>" + esc(w) + "</span>").join("") : "-";
    const gateCell = gate.open === undefined ? "-" : (gate.open ? "<span class=alive>open</span>" : "<span class=closed>closed: " + esc(gate.closed_because) + "</span>");
    return row([esc(id), stateCell, "<code>" + esc(m.address) + "</code>", roles, m.alive && d.state ? replicas : "-", heldCell, cacheCell, gateCell]);
  });
  document.querySelector("#nodes tbody").innerHTML = nodes.join("");
  document.getElementById("ring").innerHTML = c.ring.map((n) => "<li>" + esc(n) + "</li>").join("") || "<span class=muted>empty</span>";
  const memory = {};  // job/role → what its copies take, from the daemon it saves on
  Object.values(c.daemons).forEach((d) => ((d.state || {}).roles || []).forEach((r) => { memory[r.job + "/" + r.role] = r.memory; }));
  document.getElementById("jobs").innerHTML = Object.entries(c.jobs).map(([job, j]) => {
    const roles = Object.entries(j.shard_locations || {}).map(([role, steps]) => {
      const newest = Object.entries(steps).sort((a, b) => b[0] - a[0]).slice(0, 2);
      const m = memory[job + "/" + role];
      const mem = m && typeof m.multiple === "number" ? m.multiple.toFixed(2) + "x the shard (" + mib(m.here_bytes) + " here, " + mib(m.successor_bytes) + " on its successor)<br><span class=muted>" + esc(m.survives) + "</span>" : "<span class=muted>-</span>";
      return row([esc(role), newest.map(([s, nodes]) => "step " + esc(s) + ": " + nodes.map(esc).join(", ")).join("<br>"), mem]);
    });
    return "<h3>" + esc(job) + ' <span class=muted>restorable step <b class=restorable data-job="' + esc(job) + '">' + esc(j.restorable_step ?? "none") + "</b>, newest committed " + esc(j.committed_step ?? "none") + "</span></h3>" +
      "<table><thead><tr><th>role</th><th>copies (step: nodes holding a primary or a replica)</th><th>host memory</th></tr></thead><tbody>" + roles.join("") + "</tbody></table>";
  }).join("") || "<span class=muted>no jobs</span>";
  document.querySelector("#failures tbody").innerHTML = c.failures.map((f) => row([
    new Date(f.at * 1000).toLocaleTimeString(), esc(f.kind), esc(f.node), esc((f.job || "") + (f.worker !== undefined && f.worker !== null ? " / " + f.worker : "")),
    f.recovered_after_s === null ? "<span class=muted>not yet (or older than the kept versions)</span>" : f.recovered_after_s.toFixed(2) + " s"])).join("") ||
    "<tr><td colspan=5 class=muted>none</td></tr>";
}

async function poll() {
  try {
    const r = await fetch("/v1/cluster");
    if (r.status === 421) {
      const leader = r.headers.get("X-FFplane-Leader");
      document.getElementById("error").innerHTML = "this data server does not coordinate now; the coordinator is " + (leader ? link(leader) : "unknown");
    } else if (!r.ok) {
      document.getElementById("error").textContent = "HTTP " + r.status + ": " + ((await r.json()).detail || "");
    } else {
      draw(await r.json());
    }
  } catch (e) {
    document.getElementById("error").textContent = "the data server does not answer: " + e;
  }
  setTimeout(poll, 2000);
}
poll();
</script>
</body>
</html>
"""
