// The oncegate console: a page over the admin API, served by the proxy itself. The admin token is
// kept in sessionStorage (never a cookie) and sent as a bearer header. Every value shown is set as
// text, never as markup: paths, headers and reasons come from clients and operators.
"use strict";

const TOKEN = "oncegate-admin-token";
const main = document.getElementById("main");
const nav = document.getElementById("nav");

// ---------------------------------------------------------------- helpers

function h(tag, attrs, ...children) {
  const el = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === null || v === undefined || v === false) continue;
    if (k.startsWith("on")) el.addEventListener(k.slice(2), v);
    else if (k === "class") el.className = v;
    else el.setAttribute(k, v === true ? "" : String(v));
  }
  for (const c of children.flat()) {
    if (c === null || c === undefined || c === false) continue;
    el.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
  return el;
}

const SVG = "http://www.w3.org/2000/svg";

// An SVG element: presentation attributes only (the page's CSP allows no inline style).
function svg(tag, attrs, ...children) {
  const el = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs || {})) if (v !== null && v !== undefined) el.setAttribute(k, String(v));
  for (const c of children.flat()) if (c !== null && c !== undefined) el.append(c instanceof Node ? c : document.createTextNode(String(c)));
  return el;
}

function show(...nodes) {
  main.replaceChildren(...nodes);
}

function token() {
  return sessionStorage.getItem(TOKEN);
}

class ApiError extends Error {}

async function api(path, opts = {}) {
  const headers = { Authorization: "Bearer " + token() };
  if (opts.body !== undefined) headers["Content-Type"] = "application/json";
  const r = await fetch(path, {
    method: opts.method || "GET",
    headers,
    body: opts.body === undefined ? undefined : JSON.stringify(opts.body),
    cache: "no-store",
  });
  if (r.status === 401) {
    sessionStorage.removeItem(TOKEN);
    // A proxy with no token set refuses every token: say so, as the API does.
    let detail = "";
    try {
      detail = (await r.json()).detail || "";
    } catch (_) {}
    route();
    throw new ApiError(detail.startsWith("the admin API is locked") ? detail : "the token was refused");
  }
  const type = r.headers.get("content-type") || "";
  if (!r.ok) {
    let detail = r.status + " " + r.statusText;
    if (type.includes("json")) {
      const p = await r.json();
      detail = p.detail || p.title || detail;
    }
    throw new ApiError(detail);
  }
  if (opts.raw) return r;
  return type.includes("ndjson")
    ? (await r.text()).split("\n").filter(Boolean).map((l) => JSON.parse(l))
    : r.json();
}

function stateTag(s) {
  return h("span", { class: "state " + s }, s);
}

function age(secs) {
  if (secs < 90) return secs + " s";
  if (secs < 5400) return Math.round(secs / 60) + " min";
  if (secs < 172800) return Math.round(secs / 3600) + " h";
  return Math.round(secs / 86400) + " d";
}

function request(a) {
  return a.tool ? "tools/call " + a.tool : a.method + " " + a.path;
}

function table(head, rows, rowAttrs) {
  return h(
    "div",
    { class: "scroll" },
    h(
      "table",
      {},
      h("thead", {}, h("tr", {}, head.map((c) => h("th", {}, c)))),
      h(
        "tbody",
        {},
        rows.length === 0
          ? h("tr", {}, h("td", { colspan: head.length, class: "muted" }, "none"))
          : rows.map((r, i) => h("tr", rowAttrs ? rowAttrs(i) : {}, r.map((c) => h("td", {}, c)))),
      ),
    ),
  );
}

function failure(e) {
  return h("p", { class: "error", role: "alert" }, "Error: " + e.message);
}

function download(name, text) {
  const a = h("a", { href: URL.createObjectURL(new Blob([text], { type: "application/x-ndjson" })), download: name });
  document.body.append(a);
  a.click();
  a.remove();
}

// ---------------------------------------------------------------- login

function login(message) {
  nav.hidden = true;
  const input = h("input", { id: "token", type: "password", autocomplete: "off", required: true, "aria-label": "Admin token" });
  const form = h(
    "form",
    {
      class: "card",
      id: "login",
      onsubmit: async (ev) => {
        ev.preventDefault();
        sessionStorage.setItem(TOKEN, input.value.trim());
        try {
          await api("/v1/overview");
          location.hash = "#/actions";
          route();
        } catch (e) {
          login(e.message.startsWith("the admin API is locked") ? "The " + e.message.slice(4) + "." : "That token was refused.");
        }
      },
    },
    h("h1", {}, "Sign in"),
    h("p", { class: "muted" }, "The admin token (the variable named by admin.token_env). It stays in this tab only."),
    message ? h("p", { class: "error", role: "alert" }, message) : null,
    h("label", {}, "Admin token", input),
    h("div", {}, h("button", { class: "primary", type: "submit" }, "Sign in")),
  );
  show(form);
  input.focus();
}

// ---------------------------------------------------------------- overview

function parseMetrics(text) {
  const out = [];
  for (const line of text.split("\n")) {
    const m = line.match(/^([a-z_]+)(\{([^}]*)\})? ([0-9.eE+-]+)$/);
    if (!m) continue;
    const labels = {};
    for (const kv of (m[3] || "").matchAll(/([a-z_]+)="([^"]*)"/g)) labels[kv[1]] = kv[2];
    out.push({ name: m[1], labels, value: Number(m[4]) });
  }
  return out;
}

// What the chart stacks, bottom up, as /v1/overview's minutes name them.
const KINDS = [
  ["sent", "sent", "#1a7f37"],
  ["replayed", "replayed", "#0b5cad"],
  ["unknown", "unknown", "#e08a00"],
  ["not_applied", "not applied", "#7a8591"],
  ["refused", "refused", "#c62828"],
];

function hhmm(secs) {
  const d = new Date(secs * 1000);
  return String(d.getHours()).padStart(2, "0") + ":" + String(d.getMinutes()).padStart(2, "0");
}

// Bars of `values(m)` for each minute, stacked by `parts`; a title per bar says its counts.
function barChart(minutes, parts, label, height, unit) {
  const W = 600, H = height, top = 14, bottom = 16, left = 4;
  const slot = (W - left) / minutes.length;
  const totals = minutes.map((m) => parts.reduce((s, [k]) => s + (m[k] || 0), 0));
  const max = Math.max(1, ...totals);
  const scale = (H - top - bottom) / max;
  const bars = minutes.map((m, i) => {
    let y = H - bottom;
    const x = left + i * slot;
    const rects = parts.map(([k, , color]) => {
      const n = m[k] || 0;
      if (!n) return null;
      const hgt = Math.max(1, n * scale);
      y -= hgt;
      return svg("rect", { x: x.toFixed(1), y: y.toFixed(1), width: Math.max(1, slot - 1).toFixed(1), height: hgt.toFixed(1), fill: color, "data-kind": k, "data-n": n });
    });
    const said = parts.map(([k, name]) => name + " " + (m[k] ?? "—")).join(", ");
    return svg("g", { "data-at": m.at }, svg("title", {}, hhmm(m.at) + ": " + said), svg("rect", { x: x.toFixed(1), y: top, width: slot.toFixed(1), height: H - top - bottom, fill: "transparent" }), rects);
  });
  return svg(
    "svg",
    { viewBox: `0 0 ${W} ${H}`, width: "100%", role: "img", "aria-label": label, class: "chart" },
    svg("line", { x1: left, x2: W, y1: H - bottom, y2: H - bottom, stroke: "#d7dde4" }),
    svg("text", { x: left, y: 10, "font-size": 10, fill: "#5d6876" }, "max " + max + " " + unit),
    svg("text", { x: left, y: H - 3, "font-size": 10, fill: "#5d6876" }, minutes.length ? hhmm(minutes[0].at) : ""),
    svg("text", { x: W - 2, y: H - 3, "font-size": 10, fill: "#5d6876", "text-anchor": "end" }, "now"),
    bars,
  );
}

function legend(parts, minutes) {
  return h(
    "ul",
    { class: "legend" },
    parts.map(([k, name, color]) =>
      h("li", {}, svg("svg", { width: 10, height: 10, "aria-hidden": "true" }, svg("rect", { width: 10, height: 10, fill: color })), " " + name + " ", h("b", { "data-total": k }, minutes.reduce((s, m) => s + (m[k] || 0), 0))),
    ),
  );
}

async function overview() {
  const [o, metricsText] = await Promise.all([api("/v1/overview"), fetch("/metrics").then((r) => r.text())]);
  const metrics = parseMetrics(metricsText);
  const writes = metrics.filter((m) => m.name === "oncegate_requests_total" && m.labels.class === "write");
  const hourTotal = o.minutes.reduce((s, m) => s + KINDS.reduce((t, [k]) => t + m[k], 0), 0);
  const byUpstream = {};
  for (const m of writes) {
    const u = (byUpstream[m.labels.upstream] ||= {});
    u[m.labels.outcome] = (u[m.labels.outcome] || 0) + m.value;
  }
  const lookups = metrics.filter((m) => m.name === "oncegate_lookups_total");
  const states = ["unknown", "in_flight", "succeeded", "failed"];
  return [
    h("h1", {}, "Overview"),
    h(
      "div",
      { class: "tiles" },
      states.map((s) => h("a", { class: "tile", href: "#/actions?state=" + s }, stateTag(s), h("b", { "data-state": s }, o.actions[s] || 0))),
      h("div", { class: "tile" }, "writes, last hour", h("b", { "data-total": "writes" }, hourTotal)),
      h("div", { class: "tile" }, "write log entries", h("b", {}, o.log_head_seq ?? "—")),
    ),
    h(
      "section",
      { id: "activity" },
      h("h2", {}, "Writes per minute, the last hour"),
      barChart(o.minutes, KINDS, "Writes per minute by outcome over the last hour", 150, "a minute"),
      legend(KINDS, o.minutes),
      h("h2", {}, "Unknown actions waiting"),
      barChart(
        o.minutes.map((m) => ({ at: m.at, unknown_waiting: m.unknown_waiting })),
        [["unknown_waiting", "unknown waiting", "#e08a00"]],
        "Unknown actions waiting, by minute, over the last hour",
        80,
        "waiting",
      ),
      h("p", { class: "muted" }, "Counted by this proxy since it started; the most seen in each minute. Hover a bar for its counts."),
    ),
    h(
      "section",
      {},
      h("h2", {}, "Unknown, waiting longest"),
      table(
        ["action", "request", "upstream", "waiting"],
        o.unknown_oldest.map((a) => [h("a", { href: "#/actions/" + a.id, class: "mono" }, a.id), request(a), a.upstream, age(a.waiting_secs)]),
      ),
    ),
    h(
      "section",
      {},
      h("h2", {}, "Writes by upstream, since the proxy started"),
      table(
        ["upstream", "sent", "replayed", "unknown", "not applied", "refused"],
        Object.entries(byUpstream).map(([u, c]) => [
          u,
          c.sent || 0,
          c.replayed || 0,
          c.unknown || 0,
          c["not-applied"] || 0,
          Object.entries(c)
            .filter(([k]) => !["sent", "replayed", "unknown", "not-applied"].includes(k))
            .reduce((s, [, v]) => s + v, 0),
        ]),
      ),
      h("h2", {}, "Status lookups by result"),
      table(["result", "count"], lookups.map((m) => [m.labels.result, m.value])),
    ),
    h("p", {}, h("button", { type: "button", onclick: () => route() }, "Refresh")),
  ];
}

// ---------------------------------------------------------------- actions

async function actions(params) {
  const [o, page] = await Promise.all([api("/v1/overview"), api("/v1/actions?" + params.toString())]);
  const field = (name, label, el) => {
    el.name = name;
    el.value = params.get(name) || "";
    return h("label", {}, label, el);
  };
  const stateSel = h("select", {}, ["", "unknown", "in_flight", "succeeded", "failed"].map((s) => h("option", { value: s }, s || "any")));
  const filters = h(
    "form",
    {
      class: "card",
      id: "filters",
      onsubmit: (ev) => {
        ev.preventDefault();
        const p = new URLSearchParams();
        for (const [k, v] of new FormData(ev.target)) if (v) p.set(k, v);
        location.hash = "#/actions?" + p.toString();
      },
    },
    field("state", "State", stateSel),
    field("upstream", "Upstream", h("input", {})),
    field("task", "Task", h("input", {})),
    field("tool", "Tool", h("input", {})),
    h("label", {}, "\u00a0", h("button", { type: "submit" }, "Filter")),
  );
  const next = page.next;
  const nextParams = new URLSearchParams(params);
  if (next) nextParams.set("after", next);
  return [
    h("h1", {}, "Actions"),
    h(
      "section",
      { id: "unknown" },
      h("h2", {}, "Unknown: waiting to be settled (" + (o.actions.unknown || 0) + ")"),
      table(
        ["action", "request", "upstream", "task/step", "waiting"],
        o.unknown_oldest.map((a) => [
          h("a", { href: "#/actions/" + a.id, class: "mono" }, a.id),
          request(a),
          a.upstream,
          a.task ? a.task + "/" + (a.step || "-") : "-",
          age(a.waiting_secs),
        ]),
      ),
    ),
    filters,
    h(
      "section",
      {},
      h("h2", {}, "Newest first"),
      table(
        ["action", "state", "request", "upstream", "task/step", "attempts", "updated"],
        page.actions.map((a) => [
          h("a", { href: "#/actions/" + a.id, class: "mono" }, a.id),
          stateTag(a.state),
          request(a),
          a.upstream,
          a.task ? h("a", { href: "#/tasks/" + encodeURIComponent(a.task) }, a.task + "/" + (a.step || "-")) : "-",
          a.attempts,
          a.updated_at,
        ]),
      ),
      h(
        "p",
        {},
        params.get("after") ? h("a", { href: "#/actions" }, "First page") : null,
        " ",
        next ? h("a", { href: "#/actions?" + nextParams.toString(), id: "next" }, "Next page") : h("span", { class: "muted" }, "end of list"),
      ),
    ),
  ];
}

function kv(pairs) {
  return h(
    "dl",
    { class: "kv" },
    pairs.filter(([, v]) => v !== null && v !== undefined && v !== "").flatMap(([k, v]) => [h("dt", {}, k), h("dd", {}, v)]),
  );
}

// The request's kept body (JSON pretty, a form's fields decoded), the first lines of a long one
// with a way to see all. Shown as text: it came from a client.
const BODY_LINES = 30;
function bodyView(req) {
  if (req.body === null || req.body === undefined) {
    return h("p", { class: "muted", id: "request-body" }, "The body is not kept: only JSON and form bodies up to 16 KiB are, redacted.");
  }
  let text = req.body;
  const type = ((req.headers || []).find(([k]) => k.toLowerCase() === "content-type") || [, ""])[1];
  if (/json/i.test(type)) {
    try {
      text = JSON.stringify(JSON.parse(req.body), null, 2);
    } catch (_) {}
  } else if (/x-www-form-urlencoded/i.test(type)) {
    text = [...new URLSearchParams(req.body)].map(([k, v]) => k + " = " + v).join("\n");
  }
  const lines = text.split("\n");
  const pre = h("pre", { id: "request-body", class: "mono" }, lines.length > BODY_LINES ? lines.slice(0, BODY_LINES).join("\n") + "\n…" : text);
  if (lines.length <= BODY_LINES) return pre;
  const all = h("button", { type: "button", id: "request-body-all" }, "Show all " + lines.length + " lines");
  all.addEventListener("click", () => {
    pre.textContent = text;
    all.remove();
  });
  return h("div", {}, pre, all);
}

async function action(id) {
  const a = await api("/v1/actions/" + encodeURIComponent(id));
  const result = h("div", { id: "result", "aria-live": "polite" });
  const parts = [
    h("h1", {}, "Action ", h("span", { class: "mono" }, a.id), " ", stateTag(a.state)),
    h(
      "section",
      {},
      kv([
        ["request", request(a)],
        ["upstream", a.upstream],
        ["key", h("span", { class: "mono" }, a.key)],
        ["task / step", a.task ? h("a", { href: "#/tasks/" + encodeURIComponent(a.task) }, a.task + " / " + (a.step || "-")) : null],
        ["principal", a.principal],
        ["attempts", a.attempts],
        ["created", a.created_at],
        ["updated", a.updated_at],
        ["expires", a.expires_at],
        ["external id", a.external_id],
        ["fingerprint", h("span", { class: "mono" }, a.fingerprint)],
        ["needs a decision", a.needs_decision ? "yes: sending it again unchanged is not expected to work" : null],
        ["resolution", a.resolution ? a.resolution.outcome + " by " + a.resolution.actor + " at " + a.resolution.at + ": " + a.resolution.reason : null],
      ]),
    ),
    h(
      "section",
      {},
      h("h2", {}, "Request (redacted)"),
      kv([
        ["body", a.request.body_size + " bytes, digest " + a.request.body_sha256],
        ["not in the fingerprint", (a.request.fingerprint_ignore || []).join(", ") || null],
      ]),
      bodyView(a.request),
      table(["header", "value"], (a.request.headers || []).map(([k, v]) => [k, h("span", { class: "mono" }, v)])),
    ),
    h(
      "section",
      {},
      h("h2", {}, "Evidence"),
      table(
        ["attempt", "try at", "phase", "status", "error", "upstream's answer (excerpt)"],
        a.evidence.flatMap((at) =>
          (at.tries.length ? at.tries : [{}]).map((t, i) => [
            i === 0 ? at.attempt + " (" + (at.state || "running") + ")" : "",
            t.at || at.started_at,
            t.phase || "",
            t.status ?? "",
            t.error || "",
            t.body ? h("span", { class: "mono" }, t.body) : "",
          ]),
        ),
      ),
    ),
  ];
  if (a.response) {
    parts.push(
      h(
        "section",
        {},
        h("h2", {}, "Stored response"),
        kv([
          ["status", a.response.status],
          ["size", a.response.size + " bytes" + (a.response.stored ? "" : " (not kept for replay)")],
          ["source", a.response.source],
        ]),
        table(["header", "value"], a.response.headers.map(([k, v]) => [k, h("span", { class: "mono" }, v)])),
      ),
    );
  }
  if (a.state === "unknown") {
    const reason = h("textarea", { id: "reason", rows: 2, required: true, minlength: 3 });
    const outcome = h("select", { id: "outcome" }, h("option", { value: "applied" }, "applied: it happened"), h("option", { value: "not-applied" }, "not applied: it did not happen"));
    const ext = h("input", { id: "external", placeholder: "optional" });
    // The decision first: on a phone the evidence below runs long.
    parts.splice(
      1,
      0,
      h(
        "section",
        { id: "settle" },
        h("h2", {}, "Settle this action"),
        h("p", { class: "muted" }, "Nothing is sent for this action until it is settled. Ask the service first; settle by hand only with what the service says."),
        !a.lookup
          ? h("p", { class: "muted" }, "No status lookup is configured for this route: settle it with what the service says.")
          : h(
          "p",
          {},
          h(
            "button",
            {
              type: "button",
              id: "lookup",
              onclick: async () => {
                result.replaceChildren(h("p", { class: "muted" }, "asking the service…"));
                try {
                  const r = await api("/v1/actions/" + encodeURIComponent(a.id) + "/lookup", { method: "POST", body: {} });
                  result.replaceChildren(h("p", {}, "Lookup: " + (r.result || r.state || JSON.stringify(r))));
                  setTimeout(route, 800);
                } catch (e) {
                  result.replaceChildren(failure(e));
                }
              },
            },
            "Status lookup",
          ),
        ),
        h(
          "form",
          {
            id: "resolve",
            onsubmit: async (ev) => {
              ev.preventDefault();
              if (reason.value.trim().length < 3) {
                result.replaceChildren(h("p", { class: "error", role: "alert" }, "A reason is required."));
                return;
              }
              const at = navigations; // the operator may move on while this is sent
              const body = { outcome: outcome.value, reason: reason.value.trim() };
              if (ext.value.trim()) body.external_id = ext.value.trim();
              try {
                await api("/v1/actions/" + encodeURIComponent(a.id) + "/resolve", { method: "POST", body });
                const entries = await api("/v1/log?limit=10000&event=resolved&action=" + encodeURIComponent(a.id));
                const entry = entries[entries.length - 1];
                if (at !== navigations) return;
                show(
                  h("h1", {}, "Action ", h("span", { class: "mono" }, a.id), " settled"),
                  h("p", { class: "banner ok", id: "resolved" }, "Settled " + body.outcome + ". The write log recorded it:"),
                  entry ? h("pre", { id: "entry" }, JSON.stringify(entry, null, 2)) : h("p", { class: "error" }, "no write-log entry found"),
                  h("p", {}, h("a", { href: "#/actions/" + a.id }, "Back to the action"), " · ", h("a", { href: "#/log?action=" + a.id }, "Its write-log entries")),
                );
              } catch (e) {
                result.replaceChildren(failure(e));
              }
            },
          },
          h("label", {}, "Outcome", outcome),
          h("label", {}, "External id", ext),
          h("label", { class: "wide" }, "Reason (required, kept in the write log)", reason),
          h("button", { class: "primary", type: "submit" }, "Resolve"),
        ),
        result,
      ),
    );
  }
  parts.push(h("p", {}, h("a", { href: "#/log?action=" + a.id }, "This action's write-log entries")));
  return parts;
}

// ---------------------------------------------------------------- tasks

async function tasks(task) {
  const input = h("input", { name: "task", value: task || "", required: true });
  const form = h(
    "form",
    {
      class: "card",
      onsubmit: (ev) => {
        ev.preventDefault();
        location.hash = "#/tasks/" + encodeURIComponent(input.value.trim());
      },
    },
    h("label", {}, "Task", input),
    h("label", {}, "\u00a0", h("button", { type: "submit" }, "Show")),
  );
  if (!task) return [h("h1", {}, "Tasks"), form, h("p", { class: "muted" }, "A task's steps in order, as a resumed worker sees them.")];
  const t = await api("/v1/tasks/" + encodeURIComponent(task));
  const steps = [...t.actions].sort((a, b) => (a.created_at < b.created_at ? -1 : 1));
  return [
    h("h1", {}, "Task ", task),
    form,
    h(
      "section",
      {},
      table(
        ["#", "step", "state", "request", "status", "external id", "action"],
        steps.map((a, i) => [i + 1, a.step || "-", stateTag(a.state), request(a), a.status ?? "-", a.external_id || "-", h("a", { href: "#/actions/" + a.id, class: "mono" }, a.id)]),
      ),
    ),
  ];
}

// ---------------------------------------------------------------- write log

async function log(params) {
  const o = await api("/v1/overview");
  const head = o.log_head_seq || 0;
  const q = new URLSearchParams(params);
  if (!q.has("after")) q.set("after", String(Math.max(0, head - 50)));
  q.set("limit", q.get("limit") || "50");
  const r = await api("/v1/log?" + q.toString(), { raw: true });
  const nextSeq = r.headers.get("oncegate-log-next");
  const entries = (await r.text()).split("\n").filter(Boolean).map((l) => JSON.parse(l));
  const field = (name, label, el) => {
    el.name = name;
    el.value = q.get(name) || "";
    return h("label", {}, label, el);
  };
  const events = ["", "intent", "sent", "outcome", "replayed", "conflict", "rejected", "unknown", "lookup", "resolved", "expired"];
  const verdict = h("div", { id: "verify", "aria-live": "polite" });
  let bad = null;
  const rows = h("div", {});
  // An action's later entries name it only: their request is its intent's, when on this page.
  const described = (e) => (e.tool ? "tools/call " + e.tool : e.method ? e.method + " " + (e.path || "") : "");
  const requests = {};
  for (const e of entries) if (e.event === "intent" && e.action) requests[e.action] = described(e);
  const drawRows = () =>
    rows.replaceChildren(
      table(
        ["seq", "time", "event", "action", "request", "outcome", "actor", "detail"],
        entries.map((e) => [
          e.seq,
          e.ts,
          e.event,
          e.action ? h("a", { href: "#/actions/" + e.action, class: "mono" }, e.action.slice(0, 12) + "…") : "-",
          described(e) || (e.action && requests[e.action]) || "",
          e.outcome || "",
          e.actor,
          e.detail || "",
        ]),
        (i) => (bad !== null && entries[i].seq >= bad ? { class: "bad" } : {}),
      ),
    );
  drawRows();
  const from = h("input", { name: "from", type: "number", min: 0, value: Math.max(0, head - 1000) });
  const count = h("input", { name: "count", type: "number", min: 1, max: 10000, value: 1000 });
  const older = new URLSearchParams(q);
  older.set("after", String(Math.max(0, Number(q.get("after")) - 50)));
  const newer = new URLSearchParams(q);
  newer.set("after", nextSeq || q.get("after"));
  return [
    h("h1", {}, "Write log"),
    h(
      "section",
      {},
      h(
        "button",
        {
          type: "button",
          id: "verify-button",
          class: "primary",
          onclick: async () => {
            verdict.replaceChildren(h("p", { class: "muted" }, "verifying the whole chain…"));
            try {
              const v = await api("/v1/log/verify");
              bad = v.first_bad_seq ?? null;
              verdict.replaceChildren(
                v.ok
                  ? h("p", { class: "banner ok" }, "The chain verifies: " + v.entries + " entries, head seq " + v.head_seq + ".")
                  : h("p", { class: "banner bad", role: "alert" }, "The chain does NOT verify: the first bad entry is seq " + bad + ". Entries from there on cannot be trusted."),
                v.ok
                  ? h("p", {}, "Anchor line to keep outside this machine: ", h("span", { class: "mono", id: "anchor" }, v.head_seq + ":" + v.head))
                  : h("p", {}, "Compare with the last anchor kept outside this machine; entries before seq " + bad + " still verify."),
              );
              drawRows();
            } catch (e) {
              verdict.replaceChildren(failure(e));
            }
          },
        },
        "Verify the chain",
      ),
      verdict,
    ),
    h(
      "form",
      {
        class: "card",
        onsubmit: (ev) => {
          ev.preventDefault();
          const p = new URLSearchParams();
          for (const [k, v] of new FormData(ev.target)) if (v) p.set(k, v);
          location.hash = "#/log?" + p.toString();
        },
      },
      field("event", "Event", h("select", {}, events.map((e) => h("option", { value: e }, e || "any")))),
      field("action", "Action", h("input", {})),
      field("principal", "Principal", h("input", {})),
      field("since", "Since (RFC 3339)", h("input", { placeholder: "2026-12-01T08:00" })),
      field("until", "Until", h("input", {})),
      field("after", "After seq", h("input", { type: "number", min: 0 })),
      h("label", {}, "\u00a0", h("button", { type: "submit" }, "Show")),
    ),
    h(
      "section",
      {},
      h("p", { class: "muted" }, entries.length + " entries after seq " + q.get("after") + (nextSeq ? " (read up to seq " + nextSeq + ")" : "") + ", head seq " + head + "."),
      rows,
      h("p", {}, h("a", { href: "#/log?" + older.toString() }, "Older"), " · ", h("a", { href: "#/log?" + newer.toString() }, "Newer")),
    ),
    h(
      "form",
      {
        class: "card",
        onsubmit: async (ev) => {
          ev.preventDefault();
          const text = await api("/v1/log?after=" + Number(from.value) + "&limit=" + Number(count.value), { raw: true }).then((x) => x.text());
          download("oncegate-log-" + from.value + ".ndjson", text);
        },
      },
      h("h2", {}, "Export a range as NDJSON"),
      h("label", {}, "After seq", from),
      h("label", {}, "Entries", count),
      h("label", {}, "\u00a0", h("button", { type: "submit" }, "Export")),
      h("p", { class: "muted" }, "Verify an export offline: oncegate log verify --file FILE --expect-head SEQ:HASH"),
    ),
  ];
}

// ---------------------------------------------------------------- routing

// Every route() is a navigation. Each page function returns its nodes and route() shows them, unless
// a newer navigation began while they loaded (a click while the previous page still loads): then
// they are dropped, not shown over the newer page.
let navigations = 0;

async function route() {
  const mine = ++navigations;
  if (!token()) return login();
  nav.hidden = false;
  const [path, query] = (location.hash.slice(1) || "/actions").split("?");
  const params = new URLSearchParams(query || "");
  const parts = path.split("/").filter(Boolean);
  for (const a of nav.querySelectorAll("a")) a.classList.toggle("on", a.getAttribute("href") === "#/" + (parts[0] || "actions"));
  let page;
  try {
    if (parts[0] === "overview") page = await overview();
    else if (parts[0] === "actions" && parts[1]) page = await action(decodeURIComponent(parts[1]));
    else if (parts[0] === "tasks") page = await tasks(parts[1] ? decodeURIComponent(parts[1]) : "");
    else if (parts[0] === "log") page = await log(params);
    else page = await actions(params);
  } catch (e) {
    if (e instanceof ApiError && !token()) return;
    page = [failure(e)];
  }
  if (mine === navigations) show(...page);
}

document.getElementById("logout").addEventListener("click", () => {
  sessionStorage.removeItem(TOKEN);
  location.hash = "";
  route();
});
window.addEventListener("hashchange", route);
route();
