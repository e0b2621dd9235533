// The order page: polls /api/orders/{id} and shows the order, a bar per step
// over time, the steps table and the event log with who did what and when.
"use strict";

(() => {
  const { el, svg, setText, duration, time, relative, badge } = sas;
  const byId = (id) => document.getElementById(id);
  const id = decodeURIComponent(location.pathname.split("/").filter(Boolean).pop() || "");

  let buttons = null;
  let redrive = null;
  let refresh = () => {};

  /**
   * Redrives the order (contract §9) with the JSON merge patch typed in
   * (none when empty); the answer is shown in the page.
   */
  async function sendRedrive(patchText) {
    let body = {};
    if (patchText.trim()) {
      try {
        body = { patch: JSON.parse(patchText) };
      } catch (e) {
        sas.showMessage("error", `The patch is not JSON: ${e.message}`);
        return false;
      }
    }
    try {
      const response = await fetch(`/api/orders/${encodeURIComponent(id)}/redrive`, {
        method: "POST",
        headers: { "Content-Type": "application/json", Accept: "application/json" },
        body: JSON.stringify(body),
      });
      const answer = await response.json().catch(() => ({}));
      if (response.ok) sas.showMessage("ok", `Order ${id} redriven: now ${answer.state}.`);
      else sas.showMessage("error", `${response.status}: ${answer.error || response.statusText}`);
      return response.ok;
    } catch (e) {
      sas.showMessage("error", `The redrive did not reach the dashboard: ${e.message}`);
      return false;
    }
  }

  /** Sends the signal `name` a step waits for (contract §4d), with the data typed in ({} when empty). */
  async function sendSignal(name, dataText) {
    let body = {};
    if (dataText.trim()) {
      try {
        body = { data: JSON.parse(dataText) };
      } catch (e) {
        sas.showMessage("error", `The signal's data is not JSON: ${e.message}`);
        return false;
      }
    }
    try {
      const response = await fetch(`/api/orders/${encodeURIComponent(id)}/signals/${encodeURIComponent(name)}`, {
        method: "POST",
        headers: { "Content-Type": "application/json", Accept: "application/json" },
        body: JSON.stringify(body),
      });
      const answer = await response.json().catch(() => ({}));
      if (response.ok) sas.showMessage("ok", `Signal ${name} sent to order ${id}: now ${answer.state}.`);
      else sas.showMessage("error", `${response.status}: ${answer.error || response.statusText}`);
      return response.ok;
    } catch (e) {
      sas.showMessage("error", `The signal did not reach the dashboard: ${e.message}`);
      return false;
    }
  }

  /** The controls of a step that waits for signal `name`: its data and a Send button. */
  function signalControls(name) {
    const data = el("textarea", { class: "signal-data", rows: 2, spellcheck: "false", placeholder: '{"approved": true}' });
    const go = el("button", { type: "button", class: "signal", "data-action": "signal", "data-signal": name }, `Send ${name}`);
    go.addEventListener("click", async () => {
      go.disabled = true;
      if (await sendSignal(name, data.value)) data.value = "";
      go.disabled = false;
      refresh();
    });
    return el("div", { class: "signal-form" }, data, go);
  }

  /** The Redrive button and the form it opens: an optional merge patch and a confirming button. */
  function redriveControls() {
    const button = el("button", { type: "button", class: "redrive", "data-action": "redrive", "data-order-id": id }, "Redrive…");
    const patch = el("textarea", { id: "redrive-patch", rows: 5, spellcheck: "false", placeholder: '{"field": "corrected value", "wrong_field": null}' });
    const go = el("button", { type: "button", id: "redrive-go", class: "redrive" }, "Redrive");
    const form = el(
      "div",
      { id: "redrive-form", class: "redrive-form", hidden: true },
      el("label", { for: "redrive-patch" }, "JSON merge patch (RFC 7386) for the payload, or empty to run it as it is; null removes a field. Completed steps that were not undone are kept; the others run again under new idempotency keys."),
      patch,
      go,
    );
    button.addEventListener("click", () => {
      form.hidden = !form.hidden;
      if (!form.hidden) patch.focus();
    });
    go.addEventListener("click", async () => {
      go.disabled = true;
      if (await sendRedrive(patch.value)) {
        form.hidden = true;
        patch.value = "";
      }
      go.disabled = false;
      refresh();
    });
    return { button, form };
  }

  function fields(data) {
    const o = data.order;
    const list = [
      ["workflow", o.workflow],
      ["version", o.version || "–"],
      ["attempt", `${o.attempt} (failures ${o.failure_count}, undo failures ${o.compensation_failures})`],
      ["locked by", o.locked_by || "–"],
      ["complete-by", o.complete_by ? `${time(o.complete_by)} (${relative(o.complete_by, data.now)})` : "–"],
      ["not before", o.not_before ? `${time(o.not_before)} (${relative(o.not_before, data.now)})` : "–"],
      ["priority", o.priority],
      ["redrives", o.redrives || 0],
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
      redrive = redriveControls();
      byId("order-actions").append(redrive.button);
      byId("order-fields").after(redrive.form);
    }
    if (buttons) {
      sas.allow(buttons.retry, data.actions.retry, o.state === "error"
        ? "some steps were undone: cancel it to finish the undo"
        : `a ${o.state} order cannot be retried`);
      sas.allow(buttons.cancel, data.actions.cancel, `a ${o.state} order cannot be cancelled`);
    }
    if (redrive) {
      sas.allow(redrive.button, data.actions.redrive, `a ${o.state} order cannot be redriven: only error and compensated ones`);
      if (!data.actions.redrive) redrive.form.hidden = true;
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
        if (!c[5].firstChild || c[5].firstChild.textContent !== s.state) c[5].replaceChildren(badge(s.state, s.state === "completed" ? "processed" : s.state === "failed" ? "error" : s.state === "skipped" ? "quiet" : s.state));
        setText(c[6], s.dispatches);
        c[6].className = "num";
        setText(c[7], time(s.started_at));
        setText(c[8], time(s.finished_at));
        const waiting = s.state === "running" && s.kind !== "agent";
        // A wait's or a signal's time left (§4d), against the server's clock.
        const left = waiting && s.complete_by ? `${s.kind === "wait" ? "ends" : "times out"} ${relative(s.complete_by, data.now)}` : null;
        setText(c[9], left || (s.duration_ms === null ? (s.started_at ? "running" : "–") : duration(s.duration_ms)));
        c[9].className = "num";
        const signalling = waiting && s.kind === "signal";
        if (signalling && !c[10].querySelector(".signal-form")) c[10].replaceChildren(signalControls(s.signal));
        else if (!signalling) setText(c[10], s.error || "");
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
    if (d.redrive) parts.push(`redrive ${d.redrive}`);
    return parts.join(" · ");
  }

  /** The payload paths that differ, as `path: before → after`. */
  function changes(before, after, path = "") {
    const object = (v) => v !== null && typeof v === "object" && !Array.isArray(v);
    if (object(before) && object(after)) {
      const keys = [...new Set([...Object.keys(before), ...Object.keys(after)])].sort();
      return keys.flatMap((k) => changes(before[k], after[k], path ? `${path}.${k}` : k));
    }
    if (JSON.stringify(before) === JSON.stringify(after)) return [];
    const show = (v) => (v === undefined ? "(absent)" : clip(JSON.stringify(v), 80));
    return [`${path || "payload"}: ${show(before)} → ${show(after)}`];
  }

  /** A redrive's payload change: the paths changed, and both payloads whole. */
  function redriveDetail(e) {
    const d = e.detail || {};
    const changed = changes(d.before, d.after);
    const whole = (which, value) =>
      el("div", {}, el("h4", {}, which), el("pre", { "data-payload": which }, JSON.stringify(value, null, 2)));
    return el(
      "div",
      { class: "redrive-detail" },
      el("ul", { class: "changes" }, ...(changed.length ? changed : ["payload unchanged"]).map((t) => el("li", {}, t))),
      el("details", {}, el("summary", {}, "payload before and after"), el("div", { class: "before-after" }, whole("before", d.before), whole("after", d.after))),
    );
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
        // A logged event never changes: a redrive's detail is built once.
        if (e.event !== "redriven") setText(c[8], why(e));
        else if (!c[8].querySelector(".redrive-detail")) c[8].replaceChildren(el("span", {}, why(e)), redriveDetail(e));
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
