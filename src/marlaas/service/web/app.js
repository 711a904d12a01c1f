// The marlaas tenant dashboard: signs in with an API key (kept in localStorage until
// "Sign out"), then polls the /v1 API every few seconds and draws what it finds.
// Plain DOM and inline SVG: nothing is loaded from outside the service, and text from
// the API only ever reaches the page through textContent (never as HTML).
"use strict";

(() => {
  const STORAGE_KEY = "marlaas.apiKey";
  const REFRESH_MS = 4000;
  // Metric names the backends report: the pipeline writes reward_mean, simpler
  // backends write reward; the first one a job has is the one shown.
  const REWARD_NAMES = ["reward_mean", "reward"];
  const LOSS_NAMES = ["loss"]; // a supervised job's per-step figure (it has no reward)
  const EVAL_NAMES = ["eval_accuracy"];
  const METRICS_PAGE = 10000;
  const DEVICE_WINDOW_S = 600;
  const DEVICE_BIN_S = 10;
  const ACTIVE = new Set(["queued", "running", "paused"]);
  const SVG_NS = "http://www.w3.org/2000/svg";

  const $ = (id) => document.getElementById(id);

  // -- state ---------------------------------------------------------------------

  const state = {
    key: null,
    jobs: [],
    metrics: new Map(), // job id -> {updatedAt, lastStep, values: Map(name -> Map(step -> value))}
    checkpoints: new Map(), // job id -> {updatedAt, list}
    selected: null,
    timer: null,
    // Bumped on sign-in and sign-out, so that answers to an old session are dropped.
    generation: 0,
  };

  // -- the API -------------------------------------------------------------------

  class ApiError extends Error {
    constructor(status, message) {
      super(message);
      this.status = status;
    }
  }

  async function errorText(response) {
    let detail = null;
    try {
      const body = await response.json();
      detail = body.detail;
    } catch (_) {
      // not JSON: fall through to the status line
    }
    if (Array.isArray(detail)) {
      detail = detail.map((d) => `${(d.loc || []).join(".")}: ${d.msg}`).join("; ");
    }
    return typeof detail === "string" && detail
      ? detail
      : `${response.status} ${response.statusText || "error"}`;
  }

  async function request(path, key) {
    let response;
    try {
      response = await fetch(path, {
        headers: { Authorization: `Bearer ${key}`, Accept: "application/json" },
        cache: "no-store",
      });
    } catch (err) {
      throw new ApiError(0, `cannot reach the service at ${location.origin} (${err.message})`);
    }
    if (!response.ok) {
      throw new ApiError(response.status, await errorText(response));
    }
    return response;
  }

  async function api(path, key = state.key) {
    return (await request(path, key)).json();
  }

  // -- small helpers -------------------------------------------------------------

  function el(tag, attrs = {}, ...children) {
    const node = document.createElement(tag);
    for (const [name, value] of Object.entries(attrs)) {
      if (name === "text") node.textContent = value;
      else if (name === "className") node.className = value;
      else node.setAttribute(name, value);
    }
    for (const child of children) node.append(child);
    return node;
  }

  function svg(tag, attrs = {}, text = null) {
    const node = document.createElementNS(SVG_NS, tag);
    for (const [name, value] of Object.entries(attrs)) node.setAttribute(name, String(value));
    if (text !== null) node.textContent = text;
    return node;
  }

  function show(node, visible) {
    node.hidden = !visible;
  }

  function formatNumber(v) {
    if (v === null || v === undefined || !Number.isFinite(v)) return "—";
    const a = Math.abs(v);
    if (a !== 0 && (a >= 1e4 || a < 1e-3)) return v.toExponential(2);
    return a >= 100 ? v.toFixed(0) : v.toFixed(3);
  }

  function formatPercent(v) {
    return v === null || v === undefined || !Number.isFinite(v) ? "—" : `${(v * 100).toFixed(1)}%`;
  }

  function formatAgo(iso) {
    const seconds = Math.max(0, (Date.now() - Date.parse(iso)) / 1000);
    if (seconds < 60) return `${Math.round(seconds)} s ago`;
    if (seconds < 3600) return `${Math.round(seconds / 60)} min ago`;
    if (seconds < 86400) return `${Math.round(seconds / 3600)} h ago`;
    return new Date(iso).toLocaleDateString();
  }

  function formatClock(ms, seconds = true) {
    const parts = { hour: "2-digit", minute: "2-digit" };
    if (seconds) parts.second = "2-digit";
    return new Date(ms).toLocaleTimeString([], parts);
  }

  function formatBytes(n) {
    const units = ["B", "kB", "MB", "GB", "TB"];
    let i = 0;
    while (n >= 1000 && i < units.length - 1) {
      n /= 1000;
      i += 1;
    }
    return `${i === 0 ? n : n.toFixed(1)} ${units[i]}`;
  }

  // -- messages ------------------------------------------------------------------

  function showError(message) {
    $("error").textContent = message;
    show($("error"), Boolean(message));
  }

  function setRefreshState(text) {
    $("refresh-state").textContent = text;
  }

  // -- charts --------------------------------------------------------------------

  // Round tick values covering [lo, hi]: steps of 1, 2 or 5 times a power of ten.
  function niceTicks(lo, hi, count = 5) {
    if (!(hi > lo)) return [lo];
    const raw = (hi - lo) / count;
    const power = 10 ** Math.floor(Math.log10(raw));
    const step = [1, 2, 5, 10].map((m) => m * power).find((s) => raw <= s);
    const ticks = [];
    for (let t = Math.ceil(lo / step) * step; t <= hi + step * 1e-9; t += step) {
      ticks.push(Number(t.toPrecision(12)));
    }
    return ticks;
  }

  const TIME_STEPS_S = [1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 21600, 43200, 86400];

  // Round clock times covering [lo, hi] (ms); `minutes`: whole minutes apart.
  function timeTicks(lo, hi, count = 5) {
    const raw = (hi - lo) / 1000 / count;
    const step = 1000 * (TIME_STEPS_S.find((s) => raw <= s) || 86400);
    const ticks = [];
    for (let t = Math.ceil(lo / step) * step; t <= hi; t += step) ticks.push(t);
    return { ticks, minutes: step % 60000 === 0 };
  }

  // Draws `series` ([{name, color, kind: "line"|"area"|"bar", points: [[x, y], ...]}])
  // into `container` as an inline SVG with axes; `empty` is shown when there are no
  // points at all. Options: yMin/yMax (fixed bounds), yFormat, xTime (x in ms since
  // the epoch), xLabel, barWidth (in x units).
  function drawChart(container, series, options) {
    const opts = { yFormat: formatNumber, xLabel: "", ...options };
    container.replaceChildren();
    const total = series.reduce((n, s) => n + s.points.length, 0);
    if (total === 0) {
      container.append(el("p", { className: "no-data", text: opts.empty || "No data yet." }));
      return;
    }
    const W = 520;
    const H = 220;
    const M = { left: 52, right: 14, top: 12, bottom: 34 };
    const xs = series.flatMap((s) => s.points.map((p) => p[0]));
    const ys = series.flatMap((s) => s.points.map((p) => p[1]));
    let [x0, x1] = [Math.min(...xs), Math.max(...xs)];
    if (opts.barWidth) x1 += opts.barWidth;
    if (opts.xMin !== undefined) x0 = Math.min(x0, opts.xMin);
    if (opts.xMax !== undefined) x1 = Math.max(x1, opts.xMax);
    if (x1 === x0) {
      x0 -= 1;
      x1 += 1;
    }
    let y0 = opts.yMin !== undefined ? opts.yMin : Math.min(...ys);
    let y1 = opts.yMax !== undefined ? Math.max(opts.yMax, Math.max(...ys)) : Math.max(...ys);
    if (y1 === y0) {
      const pad = Math.abs(y0) * 0.1 || 1;
      y0 -= opts.yMin !== undefined ? 0 : pad;
      y1 += pad;
    }
    const px = (x) => M.left + ((x - x0) / (x1 - x0)) * (W - M.left - M.right);
    const py = (y) => H - M.bottom - ((y - y0) / (y1 - y0)) * (H - M.top - M.bottom);

    const root = svg("svg", {
      viewBox: `0 0 ${W} ${H}`,
      role: "img",
      "aria-label": opts.label || series.map((s) => s.name).join(", "),
      "data-points": total,
      "data-series": series.length,
      preserveAspectRatio: "xMidYMid meet",
    });

    const yTicks = niceTicks(y0, y1, 4);
    const time = opts.xTime ? timeTicks(x0, x1, 4) : null;
    const xTicks = time ? time.ticks : niceTicks(x0, x1, 5).filter((t) => !opts.integerX || Number.isInteger(t));
    const grid = svg("g", { class: "grid" });
    for (const t of yTicks) {
      grid.append(svg("line", { x1: M.left, x2: W - M.right, y1: py(t), y2: py(t) }));
      grid.append(svg("text", { x: M.left - 6, y: py(t) + 4, "text-anchor": "end" }, opts.yFormat(t)));
    }
    for (const t of xTicks) {
      const label = time ? formatClock(t, !time.minutes) : String(t);
      grid.append(svg("text", { x: px(t), y: H - M.bottom + 16, "text-anchor": "middle" }, label));
    }
    if (opts.xLabel) {
      grid.append(svg("text", { x: W - M.right, y: H - 4, "text-anchor": "end", class: "axis-label" }, opts.xLabel));
    }
    grid.append(svg("line", { class: "axis", x1: M.left, x2: W - M.right, y1: H - M.bottom, y2: H - M.bottom }));
    root.append(grid);

    for (const s of series) {
      const g = svg("g", { class: `series series-${s.kind || "line"}`, "data-name": s.name });
      const pts = s.points;
      if (s.kind === "bar") {
        const width = Math.max(1, px(x0 + opts.barWidth) - px(x0) - 1);
        for (const [x, y] of pts) {
          const top = py(Math.max(y, y0));
          const bar = svg("rect", { x: px(x), y: top, width, height: Math.max(0, py(y0) - top), fill: s.color });
          bar.append(svg("title", {}, `${opts.xTime ? formatClock(x) : x}: ${opts.yFormat(y)}`));
          g.append(bar);
        }
      } else {
        const d = pts.map(([x, y], i) => `${i ? "L" : "M"}${px(x).toFixed(1)},${py(y).toFixed(1)}`).join("");
        if (s.kind === "area" && pts.length > 1) {
          const base = py(y0).toFixed(1);
          const area = `${d}L${px(pts[pts.length - 1][0]).toFixed(1)},${base}L${px(pts[0][0]).toFixed(1)},${base}Z`;
          g.append(svg("path", { d: area, fill: s.color, "fill-opacity": 0.15, stroke: "none" }));
        }
        g.append(svg("path", { d, fill: "none", stroke: s.color, "stroke-width": 2, "stroke-linejoin": "round" }));
        if (pts.length <= 80) {
          for (const [x, y] of pts) {
            const dot = svg("circle", { cx: px(x), cy: py(y), r: 3, fill: s.color });
            dot.append(svg("title", {}, `${opts.xTime ? formatClock(x) : `step ${x}`}: ${opts.yFormat(y)}`));
            g.append(dot);
          }
        }
      }
      root.append(g);
    }
    container.append(root);
  }

  // -- metrics cache -------------------------------------------------------------

  function metricEntry(cache, jobId) {
    let entry = cache.get(jobId);
    if (!entry) {
      entry = { updatedAt: null, lastStep: 0, values: new Map() };
      cache.set(jobId, entry);
    }
    return entry;
  }

  // Fetches the new points of a job whose `updated_at` changed since the last time;
  // points at the last step seen are fetched again (an eval may land after the step).
  async function refreshMetrics(cache, job) {
    const entry = metricEntry(cache, job.id);
    if (entry.updatedAt === job.updated_at) return;
    const names = [...REWARD_NAMES, ...LOSS_NAMES, ...EVAL_NAMES].map((n) => `name=${encodeURIComponent(n)}`).join("&");
    for (let page = 0; page < 100; page += 1) {
      const url = `v1/jobs/${encodeURIComponent(job.id)}/metrics?${names}&since_step=${entry.lastStep}&limit=${METRICS_PAGE}`;
      const body = await api(url);
      for (const p of body.points) {
        if (!entry.values.has(p.name)) entry.values.set(p.name, new Map());
        entry.values.get(p.name).set(p.step, p.value);
        entry.lastStep = Math.max(entry.lastStep, p.step);
      }
      if (body.points.length < METRICS_PAGE) break;
      entry.lastStep += 1; // a full page: go on past it
    }
    entry.updatedAt = job.updated_at;
  }

  function curve(jobId, names) {
    const entry = state.metrics.get(jobId);
    if (!entry) return { name: null, points: [] };
    for (const name of names) {
      const values = entry.values.get(name);
      if (values && values.size) {
        const points = [...values.entries()]
          .filter(([, v]) => v !== null && Number.isFinite(v))
          .sort((a, b) => a[0] - b[0]);
        return { name, points };
      }
    }
    return { name: null, points: [] };
  }

  function latest(jobId, names) {
    const { points } = curve(jobId, names);
    return points.length ? points[points.length - 1][1] : null;
  }

  // -- rendering -----------------------------------------------------------------

  function renderQuotas(me) {
    const q = me.tenant.quotas;
    const u = me.usage;
    const rows = [
      ["Active jobs", `${u.active_jobs} / ${q.max_concurrent_jobs}`],
      ["Steps used", `${u.total_steps} / ${q.max_total_steps}`],
      ["Datasets", `${formatBytes(u.dataset_bytes)} / ${formatBytes(q.max_dataset_bytes)}`],
    ];
    $("quotas").replaceChildren(
      ...rows.flatMap(([k, v]) => [el("dt", { text: k }), el("dd", { text: v })]),
    );
    $("tenant-name").textContent = me.tenant.name;
  }

  function statusBadge(status) {
    return el("span", { className: `status status-${status}`, text: status });
  }

  function renderJobs() {
    const body = $("jobs").tBodies[0];
    const rows = state.jobs.map((job) => {
      const progress = el("progress", { max: String(Math.max(job.steps, 1)), value: String(job.steps_done) });
      const updated = el("td", { text: formatAgo(job.updated_at), title: new Date(job.updated_at).toLocaleString() });
      const row = el(
        "tr",
        { "data-job-id": job.id, "data-status": job.status, tabindex: "0", "aria-selected": String(job.id === state.selected) },
        el("td", { className: "name", text: job.name }),
        el("td", {}, statusBadge(job.status)),
        el("td", { className: "steps" }, progress, el("span", { text: ` ${job.steps_done} / ${job.steps}` })),
        el("td", { className: "num reward", text: formatNumber(latest(job.id, REWARD_NAMES)) }),
        el("td", { className: "num eval", text: formatPercent(latest(job.id, EVAL_NAMES)) }),
        updated,
      );
      if (job.failure_reason) row.title = job.failure_reason;
      row.addEventListener("click", () => select(job.id));
      row.addEventListener("keydown", (e) => {
        if (e.key === "Enter" || e.key === " ") {
          e.preventDefault();
          select(job.id);
        }
      });
      return row;
    });
    const focused = document.activeElement && document.activeElement.dataset ? document.activeElement.dataset.jobId : null;
    body.replaceChildren(...rows);
    show($("jobs-empty"), state.jobs.length === 0);
    if (focused) {
      const row = rows.find((r) => r.dataset.jobId === focused);
      if (row) row.focus(); // keep keyboard users where they were across refreshes
    }
  }

  // Runs of the Tinker-compatible API (`tinker` SDK clients); the card shows only when
  // the tenant has some.
  function renderTinker(runs) {
    const rows = runs.map((run) => {
      const path = (c) => (c ? c.tinker_path.split("/").slice(-2).join("/") : "–");
      return el(
        "tr",
        { "data-run-id": run.training_run_id },
        el("td", { className: "name", text: run.training_run_id }),
        el("td", { className: "num", text: String(run.lora_rank) }),
        el("td", { text: path(run.last_checkpoint), title: run.last_checkpoint ? run.last_checkpoint.tinker_path : "" }),
        el("td", { text: path(run.last_sampler_checkpoint), title: run.last_sampler_checkpoint ? run.last_sampler_checkpoint.tinker_path : "" }),
        el("td", { text: formatAgo(run.last_request_time), title: new Date(run.last_request_time).toLocaleString() }),
      );
    });
    $("tinker-runs").tBodies[0].replaceChildren(...rows);
    show($("tinker-card"), runs.length > 0);
  }

  function renderDetail() {
    const job = state.jobs.find((j) => j.id === state.selected);
    show($("job-detail"), Boolean(job));
    if (!job) return;
    $("detail-name").textContent = job.name;
    $("detail-status").replaceWith(Object.assign(statusBadge(job.status), { id: "detail-status" }));
    $("detail-id").textContent = job.id;
    const task = job.spec && job.spec.task ? job.spec.task.family || job.spec.task.dataset || "" : "";
    $("detail-task").textContent = `${task ? `task ${task} · ` : ""}${job.steps_done} of ${job.steps} steps`;
    $("detail-reason").textContent = job.failure_reason || "";
    show($("detail-reason"), Boolean(job.failure_reason));

    // Both charts over the same steps, so that they line up. A supervised job has a
    // training loss per step where an RL job has a reward, and token accuracy as its eval.
    const supervised = Boolean(job.spec && job.spec.algorithm && job.spec.algorithm.type === "sft");
    const what = supervised ? "training loss" : "reward";
    const reward = curve(job.id, supervised ? LOSS_NAMES : REWARD_NAMES);
    const evals = curve(job.id, EVAL_NAMES);
    const steps = [...reward.points, ...evals.points].map((p) => p[0]);
    const xRange = steps.length ? { xMin: Math.min(...steps), xMax: Math.max(...steps) } : {};
    $("caption-reward").textContent = supervised ? "Training loss per step" : "Reward per step";
    $("caption-eval").textContent = supervised ? "Eval token accuracy" : "Eval accuracy";
    drawChart($("chart-reward"), [{ name: reward.name || what, color: "#2563eb", points: reward.points }], {
      xLabel: "step",
      integerX: true,
      ...xRange,
      label: `${job.name}: ${what} per step`,
      empty: `No ${what} reported yet.`,
    });
    drawChart($("chart-eval"), [{ name: "eval accuracy", color: "#059669", points: evals.points }], {
      xLabel: "step",
      integerX: true,
      ...xRange,
      yMin: 0,
      yMax: 1,
      yFormat: (v) => `${Math.round(v * 100)}%`,
      label: `${job.name}: eval accuracy`,
      empty: "No evaluation reported yet.",
    });
    renderCheckpoints(job);
  }

  function renderCheckpoints(job) {
    const entry = state.checkpoints.get(job.id);
    const list = entry ? entry.list : [];
    const rows = list.map((c) => {
      const href = `v1/jobs/${encodeURIComponent(job.id)}/checkpoints/${c.step}/adapter`;
      const link = el("a", { href, className: "download", "data-step": String(c.step), text: "Download adapter" });
      link.addEventListener("click", (e) => {
        e.preventDefault();
        download(job, c.step, href, link);
      });
      const metrics = Object.entries(c.metrics || {})
        .map(([k, v]) => `${k} ${formatNumber(v)}`)
        .join(", ");
      return el(
        "tr",
        { "data-step": String(c.step) },
        el("td", { text: String(c.step) }),
        el("td", { text: metrics || "—" }),
        el("td", { text: formatAgo(c.created_at), title: new Date(c.created_at).toLocaleString() }),
        el("td", {}, link),
      );
    });
    $("checkpoints").tBodies[0].replaceChildren(...rows);
    show($("checkpoints"), rows.length > 0);
    show($("checkpoints-empty"), rows.length === 0);
  }

  function renderDevice(usage) {
    const device = usage.device.map((p) => [Date.parse(p.time), p.busy]);
    $("device-source").textContent = usage.source ? `(reported by ${usage.source})` : "";
    const now = Date.now();
    const xMin = now - usage.window_s * 1000;
    drawChart($("chart-device"), [{ name: "device busy", color: "#7c3aed", kind: "area", points: device }], {
      xTime: true,
      xMin,
      xMax: now,
      yMin: 0,
      yMax: 1,
      yFormat: (v) => `${Math.round(v * 100)}%`,
      label: "device utilization over time",
      empty: `No data: ${usage.device_note || "nothing reported yet"}.`,
    });
    const steps = usage.steps.filter((p) => p.steps > 0).map((p) => [Date.parse(p.time), p.steps]);
    drawChart($("chart-steps"), [{ name: "steps", color: "#0ea5e9", kind: "bar", points: steps }], {
      xTime: true,
      xMin,
      xMax: now,
      yMin: 0,
      barWidth: usage.bin_s * 1000,
      yFormat: (v) => (Number.isInteger(v) ? String(v) : ""),
      label: "your finished steps over time",
      empty: `No data: none of your jobs finished a step in the last ${Math.round(usage.window_s / 60)} min.`,
    });
  }

  // -- actions -------------------------------------------------------------------

  function filenameOf(response, fallback) {
    const header = response.headers.get("Content-Disposition") || "";
    const star = /filename\*\s*=\s*UTF-8''([^;]+)/i.exec(header);
    if (star) return decodeURIComponent(star[1]);
    const plain = /filename\s*=\s*"?([^";]+)"?/i.exec(header);
    if (plain) return plain[1];
    const type = response.headers.get("Content-Type") || "";
    if (type.includes("zip")) return `${fallback}.zip`;
    if (type.includes("gzip") || type.includes("tar")) return `${fallback}.tar.gz`;
    return fallback;
  }

  async function download(job, step, href, link) {
    const label = link.textContent;
    link.textContent = "Downloading…";
    link.setAttribute("aria-busy", "true");
    try {
      const response = await request(href, state.key);
      const blob = await response.blob();
      const url = URL.createObjectURL(blob);
      const save = el("a", { href: url, download: filenameOf(response, `${job.name}-step-${step}-adapter`) });
      document.body.append(save);
      save.click();
      save.remove();
      setTimeout(() => URL.revokeObjectURL(url), 10000);
    } catch (err) {
      showError(`Download of the step-${step} adapter of ${job.name} failed: ${err.message}`);
    } finally {
      link.textContent = label;
      link.removeAttribute("aria-busy");
    }
  }

  function select(jobId) {
    state.selected = jobId;
    for (const row of $("jobs").tBodies[0].rows) {
      row.setAttribute("aria-selected", String(row.dataset.jobId === jobId));
    }
    renderDetail();
    refresh(); // fetch the newly selected job's checkpoints now, not at the next tick
  }

  // -- the refresh loop ----------------------------------------------------------

  async function refreshCheckpoints(cache, job) {
    const entry = cache.get(job.id);
    // A checkpoint does not touch the job's updated_at, so active jobs are always asked.
    if (entry && entry.updatedAt === job.updated_at && !ACTIVE.has(job.status)) return;
    const body = await api(`v1/jobs/${encodeURIComponent(job.id)}/checkpoints`);
    cache.set(job.id, { updatedAt: job.updated_at, list: body.checkpoints });
  }

  // One refresh at a time; a refresh asked for meanwhile runs right after it.
  let running = null;
  let again = false;

  function refresh() {
    if (running) {
      again = true;
      return;
    }
    running = refreshOnce().finally(() => {
      running = null;
      if (again) {
        again = false;
        refresh();
      }
    });
  }

  async function refreshOnce() {
    // The caches of this session: a sign-out replaces them, so late answers land nowhere.
    const { generation, metrics, checkpoints } = state;
    clearTimeout(state.timer);
    setRefreshState("Refreshing…");
    try {
      const [me, list, usage, tinker] = await Promise.all([
        api("v1/me"),
        api("v1/jobs?limit=200"),
        api(`v1/usage/device?window_s=${DEVICE_WINDOW_S}&bin_s=${DEVICE_BIN_S}`),
        api("api/v1/training_runs?limit=100"),
      ]);
      await Promise.all(list.jobs.map((job) => refreshMetrics(metrics, job)));
      if (!state.selected || !list.jobs.some((j) => j.id === state.selected)) {
        state.selected = list.jobs.length ? list.jobs[0].id : null;
      }
      const selected = list.jobs.find((j) => j.id === state.selected);
      if (selected) await refreshCheckpoints(checkpoints, selected);
      if (generation !== state.generation) return;
      state.jobs = list.jobs;
      renderQuotas(me);
      renderJobs();
      renderDetail();
      renderDevice(usage);
      renderTinker(tinker.training_runs);
      showError("");
      setRefreshState(`Updated ${formatClock(Date.now())}`);
    } catch (err) {
      if (generation !== state.generation) return;
      if (err.status === 401 || err.status === 403) {
        signOut(`Signed out: ${err.message}`);
        return;
      }
      showError(`Could not refresh: ${err.message}. Retrying every ${REFRESH_MS / 1000} s.`);
      setRefreshState("Offline");
    }
    if (generation === state.generation && !document.hidden) {
      state.timer = setTimeout(refresh, REFRESH_MS);
    }
  }

  // -- signing in and out --------------------------------------------------------

  function resetData() {
    state.jobs = [];
    state.metrics = new Map();
    state.checkpoints = new Map();
    state.selected = null;
  }

  function showSignIn(message) {
    show($("sign-in"), true);
    show($("dashboard"), false);
    show($("session"), false);
    $("sign-in-error").textContent = message || "";
    show($("sign-in-error"), Boolean(message));
    $("api-key").focus();
  }

  function signOut(message) {
    state.generation += 1;
    clearTimeout(state.timer);
    state.key = null;
    localStorage.removeItem(STORAGE_KEY);
    resetData();
    showError("");
    $("api-key").value = "";
    showSignIn(message);
  }

  function startSession(key) {
    state.generation += 1;
    state.key = key;
    resetData();
    show($("sign-in"), false);
    show($("dashboard"), true);
    show($("session"), true);
    refresh();
  }

  function explain(err) {
    if (err.status === 401) return `This API key was not accepted: ${err.message}`;
    if (err.status === 403) return `This key cannot open the dashboard: ${err.message}`;
    return `Could not sign in: ${err.message}`;
  }

  async function signIn(event) {
    event.preventDefault();
    const key = $("api-key").value.trim();
    if (!key) {
      showSignIn("Enter an API key.");
      return;
    }
    const button = $("sign-in-button");
    button.disabled = true;
    try {
      await api("v1/me", key); // check the key before keeping it
      localStorage.setItem(STORAGE_KEY, key);
      $("api-key").value = "";
      startSession(key);
    } catch (err) {
      showSignIn(explain(err));
    } finally {
      button.disabled = false;
    }
  }

  function init() {
    $("sign-in-form").addEventListener("submit", signIn);
    $("sign-out").addEventListener("click", () => signOut(""));
    document.addEventListener("visibilitychange", () => {
      if (!document.hidden && state.key) refresh();
    });
    const saved = localStorage.getItem(STORAGE_KEY);
    if (saved) startSession(saved);
    else showSignIn("");
  }

  init();
})();
