// The overview page: polls /api/overview and /api/schedules and draws
// counters, two charts and the tables. Rows are updated in place, so buttons survive refreshes.
"use strict";

(() => {
  const { el, svg, setText, duration, time, relative, badge, orderLink } = sas;
  const STATES = ["pending", "processing", "processed", "error", "compensating", "compensated"];
  const byId = (id) => document.getElementById(id);

  // Chart geometry in viewBox units (the SVGs are 640 × 170).
  const W = 640, H = 170, LEFT = 46, RIGHT = 8, TOP = 8, BOTTOM = 20;
  const PLOT_W = W - LEFT - RIGHT, PLOT_H = H - TOP - BOTTOM;

  let refresh = () => {};

  function counters(data) {
    for (const state of STATES) {
      const node = byId(`count-${state}`);
      const n = data.by_state[state] ?? 0;
      setText(node, n);
      node.dataset.count = String(n);
    }
    const alerts = byId("count-alerts");
    setText(alerts, data.open_alerts);
    alerts.dataset.count = String(data.open_alerts);
    alerts.parentElement.classList.toggle("hot", data.open_alerts > 0);
  }

  /** A scale's top: a round number at or above `max`. */
  function niceMax(max) {
    if (!(max > 0)) return 1;
    const step = 10 ** Math.floor(Math.log10(max));
    for (const m of [1, 2, 2.5, 5, 10]) if (m * step >= max) return m * step;
    return 10 * step;
  }

  /** Axes, grid lines and labels shared by both charts. */
  function frame(node, top, label, buckets) {
    node.replaceChildren();
    for (const f of [0, 0.5, 1]) {
      const y = TOP + PLOT_H * (1 - f);
      node.append(svg("line", { class: f === 0 ? "axis" : "grid", x1: LEFT, x2: W - RIGHT, y1: y, y2: y }));
      node.append(svg("text", { x: LEFT - 4, y: y + 3, "text-anchor": "end" }, label(top * f)));
    }
    const n = buckets.length;
    for (const [i, text] of [[0, "-15m"], [n / 3, "-10m"], [(2 * n) / 3, "-5m"], [n, "now"]]) {
      const x = LEFT + (PLOT_W * i) / n;
      node.append(svg("text", { x, y: H - 5, "text-anchor": i === 0 ? "start" : i === n ? "end" : "middle" }, text));
    }
  }

  function throughputChart(buckets) {
    const node = byId("throughput-chart");
    const totals = buckets.map((b) => b.processed + b.compensated + b.failed);
    const top = niceMax(Math.max(0, ...totals));
    frame(node, top, (v) => (Number.isInteger(v) ? String(v) : v.toFixed(1)), buckets);
    const slot = PLOT_W / buckets.length;
    buckets.forEach((b, i) => {
      let y = TOP + PLOT_H;
      for (const [cls, n] of [["processed", b.processed], ["compensated", b.compensated], ["error", b.failed]]) {
        if (!n) continue;
        const h = (PLOT_H * n) / top;
        y -= h;
        const bar = svg("rect", { class: `bar ${cls}`, x: LEFT + i * slot + 0.5, y, width: Math.max(slot - 1, 1), height: h });
        bar.append(svg("title", {}, `${time(b.start)}: ${n} ${cls === "error" ? "failed" : cls}`));
        node.append(bar);
      }
    });
    const total = totals.reduce((a, b) => a + b, 0);
    setText(byId("throughput-total"), `${total} in 15 min`);
  }

  function latencyChart(buckets) {
    const node = byId("latency-chart");
    const values = buckets.flatMap((b) => [b.p50_ms, b.p99_ms]).filter((v) => v !== null && v !== undefined);
    const top = niceMax(Math.max(0, ...values));
    frame(node, top, (v) => duration(v), buckets);
    const slot = PLOT_W / buckets.length;
    for (const key of ["p50", "p99"]) {
      let path = "";
      let joined = false;
      buckets.forEach((b, i) => {
        const v = b[`${key}_ms`];
        if (v === null || v === undefined) {
          joined = false;
          return;
        }
        const x = LEFT + (i + 0.5) * slot;
        const y = TOP + PLOT_H * (1 - v / top);
        path += `${joined ? "L" : "M"}${x.toFixed(1)},${y.toFixed(1)}`;
        joined = true;
        const dot = svg("circle", { class: `dot ${key}`, cx: x, cy: y, r: 2.2 });
        dot.append(svg("title", {}, `${time(b.start)}: ${key} ${duration(v)}`));
        node.append(dot);
      });
      if (path) node.prepend(svg("path", { class: `line ${key}`, d: path }));
    }
    const last = [...buckets].reverse().find((b) => b.p50_ms !== null && b.p50_ms !== undefined);
    setText(byId("latency-last"), last ? `latest: p50 ${duration(last.p50_ms)}, p99 ${duration(last.p99_ms)}` : "nothing ended");
  }

  /** Rows of cells; `cells` are filled by each table's update function. */
  function row(n, cls) {
    const tr = el("tr", { class: cls });
    for (let i = 0; i < n; i++) tr.append(el("td"));
    return tr;
  }

  function fill(td, content, cls) {
    if (cls !== undefined && td.className !== cls) td.className = cls;
    if (content instanceof Node) {
      if (td.firstChild === null || !td.firstChild.isEqualNode(content)) td.replaceChildren(content);
    } else setText(td, content);
  }

  function failedTable(data) {
    const tbody = byId("failed").tBodies[0];
    sas.reconcile(
      tbody,
      data.failed,
      (o) => o.order_id,
      (o) => {
        const tr = row(8);
        tr.dataset.orderId = o.order_id;
        tr.cells[7].className = "actions";
        // A viewer gets no buttons at all (the server would refuse them anyway).
        if (sas.canAct()) {
          const { retry, cancel } = sas.actionButtons(o.order_id, () => refresh());
          tr.cells[7].append(retry, cancel);
        }
        return tr;
      },
      (tr, o) => {
        tr.dataset.state = o.process_state;
        fill(tr.cells[0], orderLink(o.order_id));
        fill(tr.cells[1], badge(o.process_state));
        fill(tr.cells[2], o.workflow);
        fill(tr.cells[3], o.failure_count, "num");
        fill(tr.cells[4], o.reason || "–", "wrap");
        fill(tr.cells[5], relative(o.updated_at, data.now), "time");
        fill(tr.cells[6], o.alert_open ? badge("open", "alert") : badge("none", "quiet"));
        const [retry, cancel] = tr.cells[7].querySelectorAll("button");
        if (retry && cancel) {
          sas.allow(retry, o.retryable, o.process_state === "error"
            ? "some steps were undone: cancel it to finish the undo"
            : `a ${o.process_state} order cannot be retried`);
          sas.allow(cancel, o.cancellable, `a ${o.process_state} order cannot be cancelled`);
        }
      },
    );
    const shown = data.failed.length;
    const total = (data.by_state.error ?? 0) + (data.by_state.compensated ?? 0);
    setText(byId("failed-count"), shown < total ? `(latest ${shown} of ${total})` : `(${total})`);
    byId("failed-empty").hidden = shown > 0;
  }

  function waitingTable(data) {
    sas.reconcile(
      byId("waiting").tBodies[0],
      data.waiting,
      (o) => o.order_id,
      (o) => {
        const tr = row(6);
        tr.dataset.orderId = o.order_id;
        return tr;
      },
      (tr, o) => {
        fill(tr.cells[0], orderLink(o.order_id));
        fill(tr.cells[1], badge(o.process_state));
        fill(tr.cells[2], o.workflow);
        fill(tr.cells[3], `${o.attempt} (${o.kind})`, "nowrap");
        const next = o.not_before ? `${relative(o.not_before, data.now)} · ${time(o.not_before)}` : "next poll";
        fill(tr.cells[4], next, "time");
        fill(tr.cells[5], o.reason || "–", "wrap");
      },
    );
    const shown = data.waiting.length;
    setText(byId("waiting-count"), shown < data.waiting_total ? `(first ${shown} of ${data.waiting_total})` : `(${data.waiting_total})`);
    byId("waiting-empty").hidden = shown > 0;
  }

  function breakersTable(data) {
    sas.reconcile(
      byId("breakers").tBodies[0],
      data.breakers,
      (b) => `${b.agent}|${b.instance}|${b.endpoint}`,
      (b) => {
        const tr = row(7);
        tr.dataset.agent = b.agent;
        return tr;
      },
      (tr, b) => {
        tr.classList.toggle("stale", b.stale);
        tr.dataset.state = b.state;
        tr.title = b.stale ? "this instance stopped reporting: its state is the last it reported" : "";
        fill(tr.cells[0], b.agent, "nowrap");
        fill(tr.cells[1], b.stale ? badge(`${b.state} · not reporting`, b.state) : badge(b.state));
        fill(tr.cells[2], b.consecutive_failures, "num");
        fill(tr.cells[3], relative(b.changed_at, data.now), "time");
        fill(tr.cells[4], b.instance, "mono");
        fill(tr.cells[5], b.endpoint, "mono wrap");
        fill(tr.cells[6], relative(b.seen_at, data.now), "time");
      },
    );
    const open = data.breakers.filter((b) => b.state !== "closed" && !b.stale).length;
    setText(byId("breakers-count"), `(${data.breakers.length}${open ? `, ${open} not closed` : ""})`);
    byId("breakers-empty").hidden = data.breakers.length > 0;
  }

  /** Each agent's breaker shared by its instances, with the orders it holds. */
  function sharedBreakersTable(data) {
    const list = data.shared_breakers;
    sas.reconcile(
      byId("shared-breakers").tBodies[0],
      list,
      (b) => b.agent,
      (b) => {
        const tr = row(8);
        tr.dataset.agent = b.agent;
        return tr;
      },
      (tr, b) => {
        tr.dataset.state = b.state;
        tr.dataset.held = b.held;
        fill(tr.cells[0], b.agent, "nowrap");
        fill(tr.cells[1], badge(b.forced ? `${b.state} · forced ${b.forced}` : b.state, b.state));
        fill(tr.cells[2], b.failures, "num");
        fill(tr.cells[3], b.state !== "closed" && b.opened_at ? relative(b.opened_at, data.now) : "–", "time");
        fill(tr.cells[4], b.held, "num");
        fill(tr.cells[5], b.oldest_held_since ? relative(b.oldest_held_since, data.now) : "–", "time");
        fill(tr.cells[6], b.forced_by || "–", "mono");
        const flow = [
          b.max_in_flight != null ? `${b.in_flight ?? 0}/${b.max_in_flight} in flight` : null,
          b.rate_per_sec != null ? `${b.rate_per_sec}/s` : null,
        ].filter(Boolean);
        fill(tr.cells[7], flow.length ? flow.join(", ") : "–", "nowrap");
      },
    );
    const open = list.filter((b) => b.state !== "closed").length;
    const held = list.reduce((n, b) => n + b.held, 0);
    setText(byId("shared-breakers-count"), `(${list.length}${open ? `, ${open} not closed, ${held} orders held` : ""})`);
    byId("shared-breakers-empty").hidden = list.length > 0;
  }

  /** Each recurring order's schedule: its next tick and its last order. */
  function schedulesTable(data) {
    const list = data.schedules;
    sas.reconcile(
      byId("schedules").tBodies[0],
      list,
      (s) => s.name,
      (s) => {
        const tr = row(8);
        tr.dataset.schedule = s.name;
        return tr;
      },
      (tr, s) => {
        tr.dataset.lastOrder = s.last_order_id || "";
        fill(tr.cells[0], s.name, "nowrap");
        fill(tr.cells[1], s.workflow, "nowrap");
        fill(tr.cells[2], s.cron, "mono nowrap");
        fill(tr.cells[3], s.timezone, "nowrap");
        fill(tr.cells[4], s.next_tick ? `${relative(s.next_tick, data.now)} · ${time(s.next_tick)}` : "never", "time");
        fill(tr.cells[5], s.last_tick ? relative(s.last_tick, data.now) : "–", "time");
        fill(tr.cells[6], s.last_order_id ? orderLink(s.last_order_id) : "–");
        fill(tr.cells[7], s.last_order_state ? badge(s.last_order_state) : "–");
      },
    );
    setText(byId("schedules-count"), `(${list.length})`);
    byId("schedules-empty").hidden = list.length > 0;
  }

  async function load() {
    const [data, schedules] = await Promise.all([sas.getJson("/api/overview"), sas.getJson("/api/schedules")]);
    counters(data);
    throughputChart(data.buckets);
    latencyChart(data.buckets);
    failedTable(data);
    waitingTable(data);
    sharedBreakersTable(data);
    schedulesTable(schedules);
    breakersTable(data);
    document.body.dataset.loaded = "true";
  }

  refresh = sas.poll(load);
})();
