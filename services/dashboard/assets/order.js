// The order page: polls /api/orders/{id} and shows the order, a bar per step
// over time, the steps table and the event log with who did what and when.
"use strict";

(() => {
  const { el, svg, setText, duration, time, relative, badge } = sas;
  const byId = (id) => document.getElementById(id);
  const id = decodeURIComponent(location.pathname.split("/").filter(Boolean).pop() || "");

  let buttons = null;
  let refresh = () => {};

  function fields(data) {
    const o = data.order;
    const list = [
      ["workflow", o.workflow],
      ["attempt", `${o.attempt} (failures ${o.failure_count}, undo failures ${o.compensation_failures})`],
      ["locked by", o.locked_by || "–"],
      ["complete-by", o.complete_by ? `${time(o.complete_by)} (${relative(o.complete_by, data.now)})` : "–"],
      ["not before", o.not_before ? `${time(o.not_before)} (${relative(o.not_before, data.now)})` : "–"],
      ["priority", o.priority],
      ["created", time(o.created_at)],
      ["updated", `${time(o.updated_at)} (${relative(o.updated_at, data.now)})`],
      ["stuck", stuck(data)],
      ["reply to", o.reply_to || "–"],
      ["last error", o.last_error || "–"],
      ["trace id", o.trace_id || "–"],
    ];
    const dl = byId("order-fields");
    if (dl.children.length !== list.length * 2) {
      dl.replaceChildren(...list.flatMap(([k]) => [el("dt", {}, k), el("dd", { "data-field": k })]));
    }
    list.forEach(([, v], i) => setText(dl.children[i * 2 + 1], v));
  }

  /** Why the order waits (held for a breaker, or late with a step), or a dash. */
  function stuck(data) {
    const s = data.stuck;
    if (!s) return "–";
    const d = s.detail || {};
    const what = [d.agent && `agent ${d.agent}`, d.ahead !== undefined && `${d.ahead} ahead`, d.locked_by && `held by ${d.locked_by}`]
      .filter(Boolean)
      .join(", ");
    return `${s.reason}${what ? ` (${what})` : ""} since ${time(s.since)} (${relative(s.since, data.now)})`;
  }

  function head(data) {
    const o = data.order;
    setText(byId("order-id"), o.order_id);
    document.title = `sas · order ${sas.shortId(o.order_id)} · ${o.state}`;
    const state = byId("order-state");
    state.className = `badge ${o.state}`;
    state.dataset.state = o.state;
    setText(state, o.state);
    // A viewer gets no buttons at all (the server would refuse them anyway).
    if (!buttons && sas.canAct()) {
      buttons = sas.actionButtons(o.order_id, () => refresh());
      byId("order-actions").append(buttons.retry, buttons.cancel);
    }
    if (buttons) {
      sas.allow(buttons.retry, data.actions.retry, o.state === "error"
        ? "some steps were undone: cancel it to finish the undo"
        : `a ${o.state} order cannot be retried`);
      sas.allow(buttons.cancel, data.actions.cancel, `a ${o.state} order cannot be cancelled`);
    }
    fields(data);
    setText(byId("payload"), JSON.stringify(o.payload, null, 2));
  }

  /** One bar per step from its start to its end (or now), on the order's lifetime. */
  function stepsChart(data) {
    const node = byId("steps-chart");
    node.replaceChildren();
    const steps = data.steps;
    const start = new Date(data.order.created_at).getTime();
    const times = data.events.map((e) => new Date(e.at).getTime());
    // A live order's axis runs to now; an ended one's to its last event.
    const live = ["pending", "processing", "compensating"].includes(data.order.state);
    const end = Math.max(start + 1, ...times, live ? new Date(data.now).getTime() : 0);
    // Drawn in the element's own pixels, so text is not stretched.
    const width = Math.max(200, node.clientWidth || 1000);
    const rowH = 16;
    const height = Math.max(1, steps.length) * rowH;
    node.setAttribute("viewBox", `0 0 ${width} ${height}`);
    node.style.height = `${height}px`;
    const at = (t) => ((width - 80) * (t - start)) / (end - start);
    steps.forEach((s, i) => {
      const y = i * rowH + 1;
      const h = rowH - 2;
      node.append(svg("rect", { class: "track", x: 0, y, width, height: h }));
      if (!s.started_at) return;
      const a = new Date(s.started_at).getTime();
      const b = s.finished_at ? new Date(s.finished_at).getTime() : end;
      const x = at(a);
      const w = Math.max(3, at(b) - x);
      const bar = svg("rect", { class: `span ${s.state}`, x, y, width: w, height: h });
      bar.append(svg("title", {}, `${s.name}: ${s.state}, ${duration(b - a)}`));
      node.append(bar);
      node.append(svg("text", { x: x + w + 4, y: y + h - 3, class: "label" }, s.name));
    });
  }

  function stepsTable(data) {
    sas.reconcile(
      byId("steps").tBodies[0],
      data.steps,
      (s) => s.idx,
      () => {
        const tr = el("tr");
        for (let i = 0; i < 11; i++) tr.append(el("td"));
        return tr;
      },
      (tr, s) => {
        tr.dataset.step = s.name;
        tr.dataset.state = s.state;
        const c = tr.cells;
        setText(c[0], s.idx);
        setText(c[1], s.name);
        setText(c[2], (s.after || []).join(", ") || "–");
        setText(c[3], s.agent);
        setText(c[4], s.compensate || "–");
        if (!c[5].firstChild || c[5].firstChild.textContent !== s.state) c[5].replaceChildren(badge(s.state, s.state === "completed" ? "processed" : s.state === "failed" ? "error" : s.state));
        setText(c[6], s.dispatches);
        c[6].className = "num";
        setText(c[7], time(s.started_at));
        setText(c[8], time(s.finished_at));
        setText(c[9], s.duration_ms === null ? (s.started_at ? "running" : "–") : duration(s.duration_ms));
        c[9].className = "num";
        setText(c[10], s.error || "");
        c[10].className = "wrap";
      },
    );
  }

  function clip(text, n) {
    return text.length > n ? `${text.slice(0, n)}…` : text;
  }

  /** What an event's detail adds to its reason: an error, a next attempt, a result. */
  function why(e) {
    const parts = [];
    if (e.reason) parts.push(e.reason);
    const d = e.detail || {};
    if (d.error && d.error !== e.reason) parts.push(d.error);
    if (d.next_attempt_at) parts.push(`next attempt ${time(d.next_attempt_at)}`);
    if (d.result !== undefined) parts.push(`result ${clip(JSON.stringify(d.result), 160)}`);
    return parts.join(" · ");
  }

  function timeline(data) {
    sas.reconcile(
      byId("timeline").tBodies[0],
      data.events,
      (e) => e.seq,
      (e) => {
        const tr = el("tr");
        for (let i = 0; i < 9; i++) tr.append(el("td"));
        tr.dataset.event = e.event;
        return tr;
      },
      (tr, e) => {
        const c = tr.cells;
        setText(c[0], e.seq);
        setText(c[1], time(e.at));
        c[1].className = "time";
        setText(c[2], e.since_previous_ms === null ? "–" : `+${duration(e.since_previous_ms)}`);
        c[2].className = "num";
        setText(c[3], e.event);
        setText(c[4], `${e.from_state || "–"} → ${e.to_state}`);
        c[4].className = "nowrap";
        setText(c[5], e.step || "");
        setText(c[6], e.attempt);
        c[6].className = "num";
        setText(c[7], e.actor);
        c[7].className = "mono";
        setText(c[8], why(e));
        c[8].className = "wrap";
      },
    );
    const last = data.events[data.events.length - 1];
    const total = last ? duration(last.since_created_ms) : "";
    setText(byId("timeline-count"), `(${data.events.length} events${total ? `, ${total} from submission to the last` : ""})`);
  }

  async function load() {
    let data;
    try {
      data = await sas.getJson(`/api/orders/${encodeURIComponent(id)}`);
    } catch (e) {
      if (e.status === 404 || e.status === 400) {
        sas.showMessage("error", e.message);
        document.body.dataset.loaded = "missing";
        return;
      }
      throw e;
    }
    head(data);
    // The branches: steps side by side run at the same time.
    setText(byId("steps-flow"), (data.stages || []).map((st) => st.join(" ∥ ")).join(" → "));
    stepsChart(data);
    stepsTable(data);
    timeline(data);
    document.body.dataset.loaded = "true";
  }

  refresh = sas.poll(load);
})();
