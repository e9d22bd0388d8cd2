// tierd's dashboard: reads the REST API every few seconds and draws it. No framework, no build.
// Every value from the server goes into the page through textContent or an SVG attribute,
// never as HTML: file paths and error messages are not ours.
"use strict";

(() => {
  const TOKEN_KEY = "tierd.token";
  const REFRESH_MS = 5000;
  const HOT_TOP = 12;
  const RECENT_MOVES = 12;
  const TIER_COLORS = ["#6d4bd8", "#1a9c8c", "#d98b1e", "#3d63dd", "#c2417a", "#5b8c2a"];
  const PATH_COLORS = { gds: "#2f9e44", compat: "#3d63dd", host: "#e8590c", remote: "#ae3ec9" };
  const OTHER_COLOR = "#98a1b3";
  const SVG_NS = "http://www.w3.org/2000/svg";

  const state = {
    role: null, // null (unknown), "admin", "data" or "open" (no tokens configured)
    paused: false,
    timer: null,
    running: false,
    tick: 0,
    view: "tier",
    skewMs: 0, // server clock minus ours
    tierOrder: [],
    data: {},
  };

  // -- small helpers -----------------------------------------------------------------------------
  const $ = (id) => document.getElementById(id);

  function h(tag, attrs, ...children) {
    const el = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (v === null || v === undefined || v === false) continue;
      if (k === "class") el.className = v;
      else if (k === "text") el.textContent = v;
      else if (k.startsWith("on")) el.addEventListener(k.slice(2), v);
      else el.setAttribute(k, v === true ? "" : String(v));
    }
    for (const c of children.flat()) {
      if (c === null || c === undefined || c === false) continue;
      el.append(c instanceof Node ? c : document.createTextNode(String(c)));
    }
    return el;
  }

  function s(tag, attrs, ...children) {
    const el = document.createElementNS(SVG_NS, tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (v === null || v === undefined) continue;
      if (k === "text") el.textContent = v;
      else el.setAttribute(k, String(v));
    }
    for (const c of children.flat()) if (c) el.append(c);
    return el;
  }

  function fill(el, ...children) {
    el.replaceChildren(...children.flat().filter((c) => c !== null && c !== undefined && c !== false));
  }

  function sig(x) {
    if (x >= 100) return x.toFixed(0);
    if (x >= 10) return x.toFixed(1);
    return x.toFixed(2);
  }

  function fmtBytes(n) {
    if (n === null || n === undefined) return "—";
    const units = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];
    let i = 0;
    let x = Number(n);
    while (Math.abs(x) >= 1024 && i < units.length - 1) { x /= 1024; i += 1; }
    return i === 0 ? `${x} B` : `${sig(x)} ${units[i]}`;
  }

  function fmtRate(bps) {
    const units = ["B/s", "kB/s", "MB/s", "GB/s", "TB/s"];
    let i = 0;
    let x = Number(bps);
    while (Math.abs(x) >= 1000 && i < units.length - 1) { x /= 1000; i += 1; }
    return i === 0 ? `${Math.round(x)} B/s` : `${sig(x)} ${units[i]}`;
  }

  function fmtUs(us) {
    if (us < 1000) return `${sig(us)} µs`;
    if (us < 1e6) return `${sig(us / 1000)} ms`;
    return `${sig(us / 1e6)} s`;
  }

  function fmtDur(sec) {
    if (sec === null || sec === undefined) return "—";
    if (sec < 1) return `${Math.round(sec * 1000)} ms`;
    if (sec < 60) return `${sec.toFixed(sec < 10 ? 1 : 0)} s`;
    const m = Math.floor(sec / 60);
    if (m < 60) return `${m} min ${Math.round(sec % 60)} s`;
    return `${Math.floor(m / 60)} h ${m % 60} min`;
  }

  function ms(ts) {
    if (ts === null || ts === undefined) return null;
    return typeof ts === "number" ? ts * 1000 : Date.parse(ts);
  }

  const serverNow = () => Date.now() + state.skewMs;

  function ago(ts) {
    const t = ms(ts);
    if (t === null || Number.isNaN(t)) return "never";
    const d = Math.max(0, (serverNow() - t) / 1000);
    if (d < 2) return "just now";
    if (d < 90) return `${Math.round(d)} s ago`;
    if (d < 5400) return `${Math.round(d / 60)} min ago`;
    if (d < 172800) return `${Math.round(d / 3600)} h ago`;
    return `${Math.round(d / 86400)} d ago`;
  }

  function shortPath(p, max) {
    // Keep the file name: "models/llama/…/model-00001-of-00002.safetensors".
    if (p.length <= max) return p;
    const keep = max - 1;
    const tail = Math.max(Math.ceil(keep * 0.65), Math.min(keep, p.length - p.lastIndexOf("/")));
    return `${p.slice(0, Math.max(0, keep - tail))}…${p.slice(p.length - tail)}`;
  }

  function pathCell(path, title, flag) {
    // The file name on top, its directory under it: both stay readable in a narrow column.
    const cut = path.lastIndexOf("/");
    return h("td", { class: "path", title: title || path },
      h("div", { class: "fname mono" },
        flag ? h("span", { class: "badge warn flag", text: flag }) : null,
        cut >= 0 ? path.slice(cut + 1) : path),
      cut >= 0 ? h("div", { class: "dname mono", text: `${path.slice(0, cut)}/` }) : null);
  }

  function fmtHeat(x) {
    if (x >= 1000) return x.toFixed(0);
    if (x >= 10) return x.toFixed(1);
    return x.toFixed(2);
  }

  function fmtEdge(x) {
    return x >= 1000 ? `${x / 1000}k` : String(x);
  }

  function clock(t) {
    const d = new Date(t);
    return `${String(d.getHours()).padStart(2, "0")}:${String(d.getMinutes()).padStart(2, "0")}`;
  }

  function tierColor(name) {
    const i = state.tierOrder.indexOf(name);
    return i >= 0 ? TIER_COLORS[i % TIER_COLORS.length] : OTHER_COLOR;
  }

  function tierBadge(name) {
    const b = h("span", { class: "badge tb", text: name });
    b.style.background = tierColor(name);
    return b;
  }

  function seriesColor(key) {
    return state.view === "tier" ? tierColor(key) : PATH_COLORS[key] || OTHER_COLOR;
  }

  function bar(parts, { thin = false, marks = [] } = {}) {
    // parts: [{frac, color, title}] laid side by side from the left; marks: [{frac, title}]
    const el = h("div", { class: thin ? "bar thin" : "bar" });
    let left = 0;
    for (const p of parts) {
      const w = Math.max(0, Math.min(1 - left, p.frac));
      if (w <= 0) continue;
      const seg = h("div", { class: `seg ${p.cls || ""}`, title: p.title });
      seg.style.left = `${left * 100}%`;
      seg.style.width = `${w * 100}%`;
      if (p.color) seg.style.background = p.color;
      el.append(seg);
      left += w;
    }
    for (const m of marks) {
      const mk = h("div", { class: "mark", title: m.title });
      mk.style.left = `calc(${Math.min(1, Math.max(0, m.frac)) * 100}% - 1px)`;
      el.append(mk);
    }
    return el;
  }

  function toast(text, isError) {
    const t = $("toast");
    t.textContent = text;
    t.style.background = isError ? "#8f2a24" : "";
    t.hidden = false;
    clearTimeout(toast.timer);
    toast.timer = setTimeout(() => { t.hidden = true; }, 5000);
  }

  // -- the API -----------------------------------------------------------------------------------
  class AuthError extends Error {}

  function token() {
    return sessionStorage.getItem(TOKEN_KEY);
  }

  async function api(path, { method = "GET", body } = {}) {
    const headers = { Accept: "application/json" };
    const t = token();
    if (t) headers.Authorization = `Bearer ${t}`;
    const init = { method, headers, cache: "no-store", credentials: "omit" };
    if (body !== undefined) {
      headers["Content-Type"] = "application/json";
      init.body = JSON.stringify(body);
    }
    const r = await fetch(path, init);
    let data = null;
    try { data = await r.json(); } catch (e) { data = null; }
    if (r.status === 401) throw new AuthError((data && data.error && data.error.message) || "unauthorized");
    return { ok: r.ok, status: r.status, body: data };
  }

  function errText(res) {
    const e = res && res.body && res.body.error;
    return e ? `${res.status} ${e.code}: ${e.message}` : `HTTP ${res ? res.status : "?"}`;
  }

  async function probeRole() {
    // The dry-run plan is admin-only and changes nothing; a body that is not a policy makes it
    // fail fast (422) after the auth check, which refuses the data token with 403.
    if (!token()) { state.role = "open"; return; }
    const r = await api("/v1/policy/plan", { method: "POST", body: "role-probe" });
    state.role = r.status === 403 ? "data" : (r.status === 422 || r.ok ? "admin" : "data");
  }

  const isAdmin = () => state.role === "admin" || state.role === "open";

  // -- refresh loop ------------------------------------------------------------------------------
  async function refresh() {
    if (state.running) return;
    state.running = true;
    clearTimeout(state.timer);
    let again = true;
    try {
      const files = state.data.ready && state.data.ready.body && state.data.ready.body.checks &&
        state.data.ready.body.checks.catalog ? state.data.ready.body.checks.catalog.files || 0 : 0;
      const heatEvery = files > 50000 ? 6 : 1; // /v1/heat reads the whole catalog
      const wantHeat = state.tick % heatEvery === 0 || !state.data.heat;
      const wantPolicy = state.tick % 12 === 0 || !state.data.policy;
      const [ready, tiers, inflight, recent, buffers, stats, history, heat, policy] = await Promise.all([
        api("/readyz"),
        api("/v1/tiers"),
        api("/v1/migrations?state=in_flight&limit=50"),
        api(`/v1/migrations?limit=${RECENT_MOVES + 10}`),
        api("/v1/buffers"),
        api("/v1/stats"),
        api("/v1/stats/history"),
        wantHeat ? api(`/v1/heat?top=${HOT_TOP}`) : Promise.resolve(state.data.heat),
        wantPolicy ? api("/v1/policy") : Promise.resolve(state.data.policy),
      ]);
      state.data = { ready, tiers, inflight, recent, buffers, stats, history, heat, policy };
      if (history.ok) state.skewMs = Date.parse(history.body.now) - Date.now();
      if (state.role === null) await probeRole();
      state.tick += 1;
      render();
      $("banner").hidden = true;
      document.body.dataset.loaded = "1";
    } catch (err) {
      if (err instanceof AuthError) {
        again = false;
        showLogin(token() ? "The server refused this token." : null);
      } else {
        $("banner").textContent = `Cannot reach tierd: ${err.message || err}. Retrying…`;
        $("banner").hidden = false;
      }
    } finally {
      state.running = false;
      if (again && !state.paused) state.timer = setTimeout(refresh, REFRESH_MS);
    }
  }

  function render() {
    const d = state.data;
    const steps = [
      () => renderHeader(d.ready),
      () => renderTiers(d.tiers),
      () => renderLeases(d.buffers),
      () => renderLoads(d.history, d.stats),
      () => renderMoves(d.inflight, d.recent),
      () => renderHot(d.heat),
      () => renderHeat(d.heat, d.policy),
    ];
    for (const step of steps) {
      try { step(); } catch (e) { console.error(e); }
    }
    for (const el of document.querySelectorAll(".admin-only")) el.hidden = !isAdmin();
    const role = $("role");
    role.textContent = { admin: "admin token", data: "data token (read only)", open: "no auth · loopback" }[state.role] || "";
    role.hidden = !state.role;
    document.body.dataset.role = state.role || "";
    $("signout").hidden = !token();
    $("updated").textContent = `updated ${new Date().toLocaleTimeString()}`;
    document.body.dataset.width = String(window.innerWidth);
  }

  // -- header ------------------------------------------------------------------------------------
  function renderHeader(ready) {
    const pill = $("ready");
    const body = ready && ready.body;
    if (!body || !body.status) {
      pill.className = "pill bad";
      pill.textContent = "readiness unknown";
      return;
    }
    const ok = body.status === "ready";
    const degraded = body.status === "degraded";
    pill.className = ok ? "pill ok" : degraded ? "pill warn" : "pill bad";
    pill.textContent = ok ? "ready" : degraded ? "degraded" : "not ready";
    const checks = body.checks || {};
    const bad = Object.entries(checks.tiers || {}).filter(([, c]) => !c.ok).map(([n]) => `tier ${n}`);
    if (checks.catalog && !checks.catalog.ok) bad.unshift(`catalog: ${checks.catalog.error}`);
    // Degraded still serves: say what is down and what still works (fleet peers off, damaged
    // files, a bucket that does not answer).
    const why = (body.degraded || []).map((d) => `${d.component}: ${d.reason} (${d.still_works})`);
    pill.title = ok ? `ready since ${body.started_at}`
      : degraded ? `degraded:\n${why.join("\n")}` : `not ready: ${bad.join(", ")}`;

    const w = checks.watcher || {};
    const wp = $("watcher");
    if (w.healthy) {
      wp.className = "pill ok";
      wp.textContent = `watcher: ${w.backend}${w.pending ? ` · ${w.pending} pending` : ""}`;
    } else {
      wp.className = w.reason === "disabled" ? "pill warn" : "pill bad";
      wp.textContent = `watcher: ${w.backend && w.backend !== "none" ? w.backend : "off"}${w.reason ? ` (${w.reason})` : ""}`;
    }
    const lines = [
      `events ${w.events || 0}, overflows ${w.overflows || 0}, restarts ${w.restarts || 0}`,
      `last event ${ago(w.last_event_at)}`,
      `last reconcile ${ago(w.last_reconcile_at)}`,
    ];
    if (w.last_full_reconcile_at) {
      lines.push(`last full reconcile ${ago(w.last_full_reconcile_at)} (${w.last_full_reconcile_reason || "?"}, ${fmtDur(w.last_full_reconcile_seconds)})`);
    }
    if (checks.last_scan) lines.push(`start scan ${ago(checks.last_scan.finished_at)}: ${checks.last_scan.adopted} adopted, ${checks.last_scan.missing} missing, ${checks.last_scan.conflicts} conflicts`);
    wp.title = lines.join("\n");
    const cat = $("catalog");
    cat.textContent = checks.catalog && checks.catalog.ok ? `${checks.catalog.files} files` : "catalog down";
    cat.className = checks.catalog && checks.catalog.ok ? "pill muted-pill" : "pill bad";
  }

  // -- tiers -------------------------------------------------------------------------------------
  function renderTiers(res) {
    const box = $("tiers");
    if (!res.ok) { fill(box, h("p", { class: "error", text: errText(res) })); return; }
    state.tierOrder = res.body.map((t) => t.name);
    const pct = (x) => `${x > 0 && x < 0.01 ? "<1" : Math.round(x * 100)} %`;
    const rows = res.body.map((t) => {
      const cap = t.capacity_bytes || 1;
      const color = tierColor(t.name);
      // The memory tier caches copies in pinned host memory: its capacity is its quota.
      const mem = t.kind === "memory";
      const what = mem ? "copies" : "tierd's files";
      const other = Math.max(0, t.used_bytes - t.file_bytes);
      const hasQuota = t.quota_bytes !== null && t.quota_bytes !== undefined;
      // The quota's place on the disk, where it is far enough from the left to be seen.
      const marks = hasQuota && t.quota_bytes / cap >= 0.02
        ? [{ frac: t.quota_bytes / cap, title: `quota ${fmtBytes(t.quota_bytes)}` }] : [];
      // An object store has no capacity: its line says so instead of drawing a bar.
      const meters = t.capacity_bytes === null ? [
        h("span", { class: "meter-label", text: "store" }),
        h("span", { class: "meter-none muted", text: "capacity unknown" }),
        h("span", { class: "meter-text" },
          h("b", { text: fmtBytes(t.file_bytes) }), ` in ${t.files} objects`),
      ] : [
        h("span", { class: "meter-label", text: mem ? "memory" : "disk" }),
        bar([
          { frac: t.file_bytes / cap, color, title: `${what}: ${fmtBytes(t.file_bytes)}` },
          { frac: other / cap, color: "var(--other)", title: `other data: ${fmtBytes(other)}` },
        ], { marks }),
        h("span", { class: "meter-text" },
          h("b", { text: fmtBytes(t.used_bytes) }), ` of ${fmtBytes(t.capacity_bytes)} used (${pct(t.used_bytes / cap)}) · `,
          h("b", { text: fmtBytes(t.free_bytes) }), " free"),
      ];
      if (hasQuota) {
        const q = t.quota_bytes > 0 ? t.file_bytes / t.quota_bytes : 1;
        meters.push(
          h("span", { class: "meter-label", text: "quota" }),
          bar([{ frac: q, color: q > 0.9 ? "var(--bad)" : color, title: `quota used: ${pct(q)}` }]),
          h("span", { class: "meter-text" },
            h("b", { text: fmtBytes(t.file_bytes) }), ` of ${fmtBytes(t.quota_bytes)} (${pct(q)})`));
      } else {
        meters.push(
          h("span", { class: "meter-label", text: "quota" }),
          h("span", { class: "meter-none muted", text: "none" }),
          h("span", { class: "meter-text" }, h("b", { text: fmtBytes(t.file_bytes) }), " in tierd's files"));
      }
      return h("div", { class: "tier-row", "data-tier": t.name },
        h("div", { class: "tier-head" },
          tierBadge(t.name),
          h("span", { class: "badge kind", title: "tier backend", text: t.kind || t.backend || "directory" }),
          t.gds ? h("span", { class: "badge ok", title: "loads take GPUDirect Storage", text: "GDS" }) : null,
          h("span", { class: "path mono", title: t.path, text: t.path }),
          h("span", { class: "files", text: `${t.files} ${mem ? (t.files === 1 ? "copy" : "copies") : (t.files === 1 ? "file" : "files")} · ${fmtBytes(t.file_bytes)}` })),
        h("div", { class: "meters" }, meters));
    });
    fill(box, rows.length ? rows : [h("p", { class: "empty", text: "No tiers configured." })]);
    fill($("tiers-legend"),
      h("span", { class: "key" }, h("span", { class: "swatch", style: null }), "tierd's files"),
      h("span", { class: "key" }, h("span", { class: "swatch other" }), "other data"),
      h("span", { class: "key" }, h("span", { class: "swatch free" }), "free"),
      h("span", { class: "key" }, h("span", { class: "swatch quota" }), "quota"));
    const sw = $("tiers-legend").querySelectorAll(".swatch");
    sw[0].style.background = `linear-gradient(90deg, ${TIER_COLORS.slice(0, Math.max(1, state.tierOrder.length)).join(", ")})`;
    sw[1].style.background = "var(--other)";
    sw[2].style.background = "var(--track)";
  }

  // -- leases ------------------------------------------------------------------------------------
  function renderLeases(res) {
    const box = $("leases");
    if (!res.ok) { fill(box, h("p", { class: "error", text: errText(res) })); fill($("budgets")); return; }
    const b = res.body;
    const devices = [...new Set([...Object.keys(b.budget_bytes || {}), ...Object.keys(b.leased_bytes || {})])].sort();
    fill($("budgets"), devices.map((dev) => {
      const used = (b.leased_bytes || {})[dev] || 0;
      const budget = (b.budget_bytes || {})[dev];
      const frac = budget ? used / budget : 0;
      return h("div", { class: "budget", "data-device": dev },
        h("div", { class: "budget-head" },
          h("span", {}, h("b", { text: dev }), ` · ${b.items.filter((l) => l.device === dev).length} live`),
          h("span", { class: "num", text: budget ? `${fmtBytes(used)} of ${fmtBytes(budget)} budget (${Math.round(frac * 100)} %)` : `${fmtBytes(used)} leased` })),
        bar([{ frac, cls: frac > 0.9 ? "hi" : "", title: `${fmtBytes(used)} leased` }]));
    }));
    const total = b.items.reduce((a, l) => a + l.alloc_bytes, 0);
    $("leases-summary").textContent = b.items.length ? `${b.items.length} live · ${fmtBytes(total)}` : "";
    if (!b.items.length) {
      fill(box, h("p", { class: "empty", text: devices.length ? "No live leases." : "No live leases; the budget of a device shows once it is used." }));
      return;
    }
    const now = serverNow();
    const rows = b.items.map((l) => h("tr", { "data-buffer-id": l.buffer_id },
      h("td", { class: "nowrap" }, h("span", { class: "mono", title: l.buffer_id, text: l.buffer_id.slice(0, 8) }),
        h("span", { class: "muted small", text: ` ${l.kind}` })),
      h("td", { text: l.device }),
      h("td", { class: "num", title: `${l.nbytes} bytes of data`, text: fmtBytes(l.alloc_bytes) }),
      // A deleted file's lease lives on (its buffer is the client's): say the file is gone.
      h("td", { class: "mono" }, l.file_ids.map((i) => (l.deleted_file_ids || []).includes(i)
        ? h("span", { class: "deleted", "data-deleted": "true", title: `file #${i} was deleted; this buffer still holds its bytes`, text: `#${i} deleted ` })
        : `#${i} `)),
      h("td", { class: "nowrap" }, l.tier ? tierBadge(l.tier) : "—",
        h("span", { class: "muted small", text: [l.io_path, l.gbps ? `${sig(l.gbps)} GB/s` : null].filter(Boolean).map((x) => ` ${x}`).join(" ·") })),
      h("td", { class: "num", title: l.expires_at, text: `in ${fmtDur(Math.max(0, (Date.parse(l.expires_at) - now) / 1000))}` })));
    fill(box, h("div", { class: "scroll" }, h("table", {},
      h("thead", {}, h("tr", {}, ["lease", "device", "size", "files", "read from", "expires"]
        .map((c, i) => h("th", { class: [2, 5].includes(i) ? "num" : "", text: c })))),
      h("tbody", {}, rows))));
  }

  // -- loads over the last hour -----------------------------------------------------------------
  function niceStep(x) {
    if (x <= 0) return 1;
    const p = 10 ** Math.floor(Math.log10(x));
    const f = x / p;
    return (f <= 1 ? 1 : f <= 2 ? 2 : f <= 5 ? 5 : 10) * p;
  }

  function timeChart(box, { points, keys, value, fmt, kind, start, end, emptyText }) {
    const W = Math.max(240, box.clientWidth || 480);
    const H = box.clientHeight || 190;
    const m = { l: 62, r: 10, t: 10, b: 22 };
    const pw = W - m.l - m.r;
    const ph = H - m.t - m.b;
    const x = (t) => m.l + ((t - start) / (end - start)) * pw;
    let max = 0;
    for (const p of points) {
      if (kind === "stack") max = Math.max(max, keys.reduce((a, k) => a + (value(p, k) || 0), 0));
      else for (const k of keys) max = Math.max(max, value(p, k) || 0);
    }
    const step = niceStep(max / 4);
    const top = max > 0 ? Math.ceil(max / step) * step : 1;
    const y = (v) => m.t + ph - (v / top) * ph;
    const svg = s("svg", { width: W, height: H, viewBox: `0 0 ${W} ${H}`, role: "img" });
    if (max > 0) {
      for (let v = 0; v <= top + step / 2; v += step) {
        svg.append(s("line", { class: "grid-line", x1: m.l, x2: W - m.r, y1: y(v), y2: y(v) }));
        svg.append(s("text", { x: m.l - 6, y: y(v) + 4, "text-anchor": "end", text: v === 0 ? "0" : fmt(v) }));
      }
    }
    svg.append(s("line", { class: "axis-line", x1: m.l, x2: W - m.r, y1: m.t + ph, y2: m.t + ph }));
    const tenMin = 600000;
    for (let t = Math.ceil(start / tenMin) * tenMin; t <= end; t += tenMin) {
      svg.append(s("line", { class: "axis-line", x1: x(t), x2: x(t), y1: m.t + ph, y2: m.t + ph + 4 }));
      svg.append(s("text", { x: x(t), y: H - 6, "text-anchor": "middle", text: clock(t) }));
    }
    if (max <= 0) {
      svg.append(s("text", { class: "nodata", x: m.l + pw / 2, y: m.t + ph / 2, "text-anchor": "middle", text: emptyText }));
      fill(box, svg);
      return;
    }
    if (kind === "stack") {
      for (const p of points) {
        const x0 = x(Math.max(start, ms(p.start)));
        const x1 = x(ms(p.end));
        const w = Math.max(2, x1 - x0 - 1);
        let acc = 0;
        for (const k of keys) {
          const v = value(p, k) || 0;
          if (v <= 0) continue;
          const r = s("rect", { x: x0, y: y(acc + v), width: w, height: Math.max(1, y(acc) - y(acc + v)), fill: seriesColor(k), rx: 1 });
          r.append(s("title", { text: `${clock(ms(p.start))}–${clock(ms(p.end))}${p.partial ? " (so far)" : ""} · ${k}: ${fmt(v)}` }));
          svg.append(r);
          acc += v;
        }
      }
    } else {
      for (const k of keys) {
        let d = "";
        let pen = "M";
        const dots = [];
        for (const p of points) {
          const v = value(p, k);
          if (!v) { pen = "M"; continue; }
          const px = x((ms(p.start) + ms(p.end)) / 2);
          d += `${pen}${px.toFixed(1)},${y(v).toFixed(1)} `;
          pen = "L";
          const dot = s("circle", { cx: px, cy: y(v), r: 2.6, fill: seriesColor(k) });
          dot.append(s("title", { text: `${clock(ms(p.start))}–${clock(ms(p.end))} · ${k}: ${fmt(v)}` }));
          dots.push(dot);
        }
        if (d) svg.append(s("path", { d, fill: "none", stroke: seriesColor(k), "stroke-width": 1.8, "stroke-linejoin": "round" }));
        for (const dot of dots) svg.append(dot);
      }
    }
    fill(box, svg);
  }

  function renderLoads(res, statsRes) {
    if (!res.ok) { fill($("chart-throughput"), h("p", { class: "error", text: errText(res) })); return; }
    const hist = res.body;
    const field = state.view === "tier" ? "by_tier" : "by_path";
    const seen = new Set();
    for (const p of hist.points) for (const k of Object.keys(p[field])) seen.add(k);
    const order = state.view === "tier" ? state.tierOrder : Object.keys(PATH_COLORS);
    const keys = [...order.filter((k) => seen.has(k)), ...[...seen].filter((k) => !order.includes(k)).sort()];
    const end = Date.parse(hist.now);
    const start = end - 3600 * 1000;
    const pts = hist.points.filter((p) => ms(p.end) > start);
    timeChart($("chart-throughput"), {
      points: pts, keys, kind: "stack", start, end, fmt: fmtRate,
      value: (p, k) => (p[field][k] ? p[field][k].throughput_bps : 0),
      emptyText: "No loads in the last hour",
    });
    timeChart($("chart-latency"), {
      points: pts, keys, kind: "line", start, end, fmt: fmtUs,
      value: (p, k) => (p[field][k] && p[field][k].operations ? p[field][k].avg_latency_us : 0),
      emptyText: "No loads in the last hour",
    });
    fill($("loads-legend"), keys.map((k) => {
      const sw = h("span", { class: "swatch" });
      sw.style.background = seriesColor(k);
      return h("span", { class: "key" }, sw, k);
    }));
    let bytes = 0; let ops = 0; let failed = 0;
    for (const p of pts) { bytes += p.total.bytes; ops += p.total.operations; failed += p.total.failed; }
    const parts = [`last hour: ${fmtBytes(bytes)} in ${ops} ${ops === 1 ? "load" : "loads"}${failed ? `, ${failed} failed` : ""}`];
    if (statsRes && statsRes.ok) {
      const st = statsRes.body;
      parts.push(`since start: ${fmtBytes(st.bytes_transferred)}, ${st.operations_completed} loads, peak ${sig(st.peak_bandwidth_gbps)} GB/s`);
    }
    $("loads-summary").textContent = parts.join(" · ");
  }

  // -- moves -------------------------------------------------------------------------------------
  function stateBadge(m) {
    const cls = { done: "ok", failed: "bad", aborted: "warn" }[m.state] || "";
    return h("span", { class: `badge ${cls}`, text: m.state });
  }

  function fromTo(m) {
    return h("span", { class: "nowrap" }, tierBadge(m.from_tier), h("span", { class: "arrow", text: "→" }), tierBadge(m.to_tier));
  }

  function renderMoves(inflight, recent) {
    if (!inflight.ok) { fill($("moves-inflight"), h("p", { class: "error", text: errText(inflight) })); return; }
    const now = serverNow();
    const flying = inflight.body.items;
    fill($("moves-inflight"), flying.length ? flying.map((m) => {
      const frac = m.size ? m.bytes_copied / m.size : 1;
      const secs = Math.max(0.001, (now - Date.parse(m.started_at)) / 1000);
      const rate = m.bytes_copied / secs;
      const eta = rate > 0 ? (m.size - m.bytes_copied) / rate : null;
      return h("div", { class: "move", "data-migration-id": m.id },
        h("div", { class: "move-head" },
          h("span", { class: "path mono", title: m.path, text: shortPath(m.path, 60) }),
          fromTo(m),
          h("span", { class: "badge", text: m.state })),
        bar([{ frac, title: `${Math.round(frac * 100)} %` }]),
        h("div", { class: "move-facts" },
          h("span", { text: `${fmtBytes(m.bytes_copied)} of ${fmtBytes(m.size)} (${Math.round(frac * 100)} %)` }),
          h("span", { text: `${fmtRate(rate)}` }),
          h("span", { text: `running ${fmtDur(secs)}` }),
          eta !== null ? h("span", { text: `about ${fmtDur(eta)} left` }) : null,
          m.reason ? h("span", { title: m.reason, text: m.reason }) : null));
    }) : h("p", { class: "empty", text: "No moves in flight." }));

    if (!recent.ok) { fill($("moves-recent"), h("p", { class: "error", text: errText(recent) })); return; }
    const done = recent.body.items.filter((m) => !m.in_flight).slice(0, RECENT_MOVES);
    const failed = done.filter((m) => m.state === "failed" || m.error).length;
    $("moves-summary").textContent = `${flying.length} in flight · ${done.length} recent${failed ? `, ${failed} with errors` : ""}`;
    if (!done.length) { fill($("moves-recent"), h("p", { class: "empty", text: "No moves yet." })); return; }
    const rows = [];
    for (const m of done) {
      rows.push(h("tr", { "data-migration-id": m.id, class: m.error ? "has-error" : "" },
        h("td", {}, stateBadge(m)),
        pathCell(m.path, m.reason ? `${m.path}\n${m.reason}` : m.path),
        h("td", { class: "nowrap" }, fromTo(m)),
        h("td", { class: "num", text: fmtBytes(m.size) }),
        h("td", { class: "num", text: fmtDur(m.duration_s) }),
        h("td", { class: "small muted nowrap", title: m.finished_at || "", text: ago(m.finished_at) })));
      if (m.error) rows.push(h("tr", { class: "error-row" }, h("td", { colspan: 6, class: "err", title: m.error, text: m.error })));
    }
    fill($("moves-recent"), h("table", {},
      h("thead", {}, h("tr", {}, ["state", "file", "move", "size", "took", "finished"]
        .map((c, i) => h("th", { class: [3, 4].includes(i) ? "num" : "", text: c })))),
      h("tbody", {}, rows)));
  }

  // -- hottest files -----------------------------------------------------------------------------
  async function pinAction(file, pin) {
    try {
      const r = await api(`/v1/files/${file.id}/pin`, { method: pin ? "POST" : "DELETE" });
      if (r.ok) toast(pin ? `Pinned ${file.path} to ${r.body.pinned_tier}` : `Unpinned ${file.path}`);
      else toast(`Could not ${pin ? "pin" : "unpin"} ${file.path}: ${errText(r)}`, true);
    } catch (e) {
      if (e instanceof AuthError) { showLogin("The server refused this token."); return; }
      toast(`Could not reach tierd: ${e.message || e}`, true);
    }
    state.data.heat = null;
    refresh();
  }

  function renderHot(res) {
    const box = $("hot");
    if (!res || !res.ok) { fill(box, h("p", { class: "error", text: res ? errText(res) : "" })); return; }
    const files = res.body.hottest;
    const total = Object.values(res.body.tiers).reduce((a, t) => a + t.files, 0);
    $("hot-summary").textContent = `top ${files.length} of ${total} · heat halves every ${fmtDur(res.body.half_life_s)}`;
    if (!files.length) { fill(box, h("p", { class: "empty", text: "No files yet." })); return; }
    const admin = isAdmin();
    const pinCell = (f) => {
      const td = h("td", { class: "nowrap pin-cell" });
      if (f.pinned_tier) td.append(tierBadge(f.pinned_tier));
      else if (!admin) td.append(h("span", { class: "muted", text: "—" }));
      if (admin) {
        td.append(h("button", {
          type: "button", class: "ghost small pin-action",
          title: f.pinned_tier ? "DELETE /v1/files/{id}/pin" : "POST /v1/files/{id}/pin: keep it on its tier",
          text: f.pinned_tier ? "unpin" : "pin",
          onclick: () => pinAction(f, !f.pinned_tier),
        }));
      }
      return td;
    };
    fill(box, h("table", {},
      h("thead", {}, h("tr", {}, ["file", "tier", "size", "heat", "reads", "last read", "pin"]
        .map((c, i) => h("th", { class: [2, 3, 4].includes(i) ? "num" : "", text: c })))),
      h("tbody", {}, files.map((f) => h("tr", { "data-file-id": f.id },
        pathCell(f.path, `${f.path} (id ${f.id}, ${f.state})`, f.state !== "stable" ? f.state : null),
        h("td", {}, tierBadge(f.tier)),
        h("td", { class: "num", text: fmtBytes(f.size) }),
        h("td", { class: "num", text: fmtHeat(f.heat) }),
        h("td", { class: "num", text: String(f.access_count) }),
        h("td", { class: "small muted nowrap", title: f.last_access || "", text: ago(f.last_access) }),
        pinCell(f))))));
  }

  // -- heat histograms ---------------------------------------------------------------------------
  function heatX(v, edges, x0, bw) {
    let i = edges.length - 1;
    while (i > 0 && v < edges[i]) i -= 1;
    const lo = edges[i];
    const hi = edges[i + 1];
    const frac = hi === undefined ? 0 : (v - lo) / (hi - lo);
    return x0 + (i + frac) * bw;
  }

  function renderHeat(res, policyRes) {
    const box = $("heat");
    if (!res || !res.ok) { fill(box, h("p", { class: "error", text: res ? errText(res) : "" })); return; }
    const { edges, tiers } = res.body;
    const pol = policyRes && policyRes.ok ? policyRes.body.policy.tiers || {} : {};
    const names = Object.keys(tiers);
    // The heat band each tier's files belong in by policy: [its min_heat, the next faster's).
    const band = {};
    names.forEach((n, i) => {
      const lo = pol[n] ? pol[n].min_heat : null;
      const hi = i > 0 && pol[names[i - 1]] ? pol[names[i - 1]].min_heat : Infinity;
      band[n] = lo === null || lo === undefined ? null : [lo, hi];
    });
    const thresholds = names.filter((n) => pol[n] && pol[n].min_heat > 0).map((n) => [n, pol[n].min_heat]);
    const W = Math.max(260, Math.floor((box.clientWidth - 18 * (Math.min(names.length, 3) - 1)) / Math.min(Math.max(names.length, 1), 3)));
    const H = 130;
    const m = { l: 8, r: 8, t: 30, b: 20 };
    const bw = (W - m.l - m.r) / edges.length;
    const ph = H - m.t - m.b;
    fill(box, names.map((n) => {
      const t = tiers[n];
      const max = Math.max(1, ...t.counts);
      const svg = s("svg", { width: W, height: H, viewBox: `0 0 ${W} ${H}`, role: "img" });
      svg.append(s("line", { class: "axis-line", x1: m.l, x2: W - m.r, y1: m.t + ph, y2: m.t + ph }));
      t.counts.forEach((c, i) => {
        const hgt = c ? Math.max(2, (c / max) * ph) : 0;
        const lo = edges[i];
        const hi = edges[i + 1] === undefined ? Infinity : edges[i + 1];
        const inBand = !band[n] || (hi > band[n][0] && lo < band[n][1]);
        const r = s("rect", { x: m.l + i * bw + 2, y: m.t + ph - hgt, width: Math.max(1, bw - 4), height: hgt, rx: 2, fill: tierColor(n), "fill-opacity": inBand ? 1 : 0.35 });
        r.append(s("title", { text: `${c} ${c === 1 ? "file" : "files"} with heat ${fmtEdge(lo)}${hi === Infinity ? "+" : `–${fmtEdge(hi)}`}${inBand ? "" : " (outside this tier's band)"}` }));
        svg.append(r);
        if (c) svg.append(s("text", { class: "bar-label", x: m.l + i * bw + bw / 2, y: m.t + ph - hgt - 3, "text-anchor": "middle", text: c }));
        svg.append(s("text", { x: m.l + i * bw, y: H - 5, "text-anchor": i === 0 ? "start" : "middle", text: fmtEdge(lo) }));
      });
      for (const [tn, v] of thresholds) {
        const tx = heatX(v, edges, m.l, bw);
        svg.append(s("line", { class: "threshold", x1: tx, x2: tx, y1: 4, y2: m.t + ph }));
        svg.append(s("text", { class: "threshold-label", x: tx + 4, y: 12, text: `${tn} ≥ ${fmtEdge(v)}` }));
      }
      return h("div", { class: "heat-tier", "data-tier": n },
        h("h4", {}, tierBadge(n), h("span", { class: "muted", text: `${t.files} ${t.files === 1 ? "file" : "files"}${band[n] ? ` · belongs at heat ${fmtEdge(band[n][0])}${band[n][1] === Infinity ? "+" : `–${fmtEdge(band[n][1])}`}` : ""}` })),
        svg);
    }));
    $("heat-summary").textContent = "files per heat bucket; faded bars are outside the tier's band (the policy would move them, give or take hysteresis, pins and minimum age)";
  }

  // -- auth UI and actions -----------------------------------------------------------------------
  function showLogin(error) {
    clearTimeout(state.timer);
    const err = $("login-error");
    err.textContent = error || "";
    err.hidden = !error;
    if (error) sessionStorage.removeItem(TOKEN_KEY);
    $("login").hidden = false;
    $("token").value = "";
    $("token").focus();
  }

  function init() {
    $("host").textContent = location.host;
    $("login-form").addEventListener("submit", (ev) => {
      ev.preventDefault();
      const t = $("token").value.trim();
      if (!t) return;
      sessionStorage.setItem(TOKEN_KEY, t);
      state.role = null;
      $("login").hidden = true;
      refresh();
    });
    $("signout").addEventListener("click", () => {
      sessionStorage.removeItem(TOKEN_KEY);
      state.role = null;
      state.data = {};
      refresh();
    });
    $("pause").addEventListener("click", () => {
      state.paused = !state.paused;
      $("pause").textContent = state.paused ? "Resume" : "Pause";
      if (state.paused) clearTimeout(state.timer);
      else refresh();
    });
    $("run-plan").addEventListener("click", async () => {
      if (!window.confirm("Run the policy's plan now? Files move between tiers.")) return;
      try {
        const r = await api("/v1/migrations", { method: "POST" });
        if (r.ok) toast(`Plan: ${r.body.planned} planned, ${r.body.migrations.length} started, ${r.body.skipped.length} skipped`);
        else toast(`Could not run the plan: ${errText(r)}`, true);
      } catch (e) {
        if (e instanceof AuthError) { showLogin("The server refused this token."); return; }
        toast(`Could not reach tierd: ${e.message || e}`, true);
      }
      refresh();
    });
    for (const b of $("series-view").querySelectorAll("button")) {
      b.addEventListener("click", () => {
        state.view = b.dataset.view;
        for (const o of $("series-view").querySelectorAll("button")) o.classList.toggle("on", o === b);
        render();
      });
    }
    let resizeTimer = null;
    window.addEventListener("resize", () => {
      clearTimeout(resizeTimer);
      resizeTimer = setTimeout(() => { if (state.data.tiers) render(); }, 150);
    });
    refresh();
  }

  document.addEventListener("DOMContentLoaded", init);
})();
