// Helpers both pages use: building elements (text only, never HTML from
// data), formatting times, polling the API, and the retry/cancel buttons.
"use strict";

const sas = (() => {
  const SVG_NS = "http://www.w3.org/2000/svg";
  const REFRESH_MS = 2000;

  /** An element with attributes and children (strings become text nodes). */
  function el(tag, attrs, ...children) {
    const node = document.createElement(tag);
    setAttrs(node, attrs);
    for (const child of children) {
      if (child === null || child === undefined) continue;
      node.append(child instanceof Node ? child : document.createTextNode(String(child)));
    }
    return node;
  }

  /** An SVG element with attributes. */
  function svg(tag, attrs, text) {
    const node = document.createElementNS(SVG_NS, tag);
    setAttrs(node, attrs);
    if (text !== undefined) node.textContent = text;
    return node;
  }

  function setAttrs(node, attrs) {
    for (const [key, value] of Object.entries(attrs || {})) {
      if (value === null || value === undefined || value === false) continue;
      if (key === "text") node.textContent = value;
      else node.setAttribute(key, value === true ? "" : String(value));
    }
  }

  /** Sets a node's text only when it changed (keeps selections and focus). */
  function setText(node, text) {
    const value = text === null || text === undefined ? "" : String(text);
    if (node.textContent !== value) node.textContent = value;
  }

  /** "850 ms", "3.2 s", "4m 05s", "2h 03m". */
  function duration(ms) {
    if (ms === null || ms === undefined || Number.isNaN(ms)) return "–";
    const abs = Math.abs(ms);
    if (abs < 1000) return `${Math.round(ms)} ms`;
    if (abs < 60000) return `${(ms / 1000).toFixed(abs < 10000 ? 2 : 1)} s`;
    const s = Math.round(abs / 1000);
    const sign = ms < 0 ? "-" : "";
    if (s < 3600) return `${sign}${Math.floor(s / 60)}m ${String(s % 60).padStart(2, "0")}s`;
    if (s < 86400) return `${sign}${Math.floor(s / 3600)}h ${String(Math.floor((s % 3600) / 60)).padStart(2, "0")}m`;
    return `${sign}${Math.floor(s / 86400)}d ${Math.floor((s % 86400) / 3600)}h`;
  }

  /** A time as local `HH:MM:SS` (with the date when not today). */
  function time(iso) {
    if (!iso) return "–";
    const t = new Date(iso);
    const now = new Date();
    const clock = t.toLocaleTimeString([], { hour12: false });
    return t.toDateString() === now.toDateString() ? clock : `${t.toLocaleDateString()} ${clock}`;
  }

  /** "in 4m 05s" or "12.0 s ago", against the server's clock `nowIso`. */
  function relative(iso, nowIso) {
    if (!iso) return "–";
    const ms = new Date(iso) - new Date(nowIso);
    if (Math.abs(ms) < 500) return "now";
    return ms > 0 ? `in ${duration(ms)}` : `${duration(-ms)} ago`;
  }

  function shortId(id) {
    return String(id).slice(0, 8);
  }

  function badge(text, cls) {
    return el("span", { class: `badge ${cls || text}` }, text);
  }

  /** A link to an order's page, showing the start of its id. */
  function orderLink(id) {
    return el("a", { href: `/orders/${id}`, class: "mono", title: id, "data-order-link": id }, shortId(id));
  }

  /** The header's connection indicator. */
  function setStatus(ok, text) {
    const node = document.getElementById("status");
    if (!node) return;
    node.dataset.ok = ok ? "true" : "false";
    setText(node, text);
  }

  /** Shows the outcome of an action above the tables. */
  function showMessage(kind, text) {
    const node = document.getElementById("message");
    if (!node) return;
    node.dataset.kind = kind;
    setText(node, text);
    node.hidden = false;
  }

  async function getJson(url) {
    const response = await fetch(url, { headers: { Accept: "application/json" }, cache: "no-store" });
    const body = await response.json().catch(() => ({}));
    // The session ended (expired, logged out elsewhere, dashboard restarted).
    if (response.status === 401 && me && me.auth === "token") location.assign("/login");
    if (!response.ok) {
      const error = new Error(body.error || `${response.status} ${response.statusText}`);
      error.status = response.status;
      throw error;
    }
    return body;
  }

  /**
   * POSTs an action (`retry` or `cancel`) on an order; the answer is shown in
   * the page: the new state, or the server's reason (404 unknown order, 409
   * not allowed in its state).
   */
  async function act(action, id) {
    try {
      const response = await fetch(`/api/orders/${id}/${action}`, {
        method: "POST",
        headers: { "Content-Type": "application/json", Accept: "application/json" },
        body: "{}",
      });
      const body = await response.json().catch(() => ({}));
      if (response.ok) {
        const done = action === "retry" ? "retried" : "cancelled";
        showMessage("ok", `Order ${id} ${done}: now ${body.state}.`);
      } else {
        showMessage("error", `${response.status}: ${body.error || response.statusText}`);
      }
      return { ok: response.ok, status: response.status, body };
    } catch (e) {
      showMessage("error", `The ${action} did not reach the dashboard: ${e.message}`);
      return { ok: false, status: 0, body: {} };
    }
  }

  /**
   * The Retry and Cancel buttons of an order, kept across refreshes. Cancel
   * undoes work, so it asks for a second click within 4 s.
   */
  function actionButtons(id, onDone) {
    const retry = el("button", { type: "button", class: "retry", "data-action": "retry", "data-order-id": id }, "Retry");
    const cancel = el("button", { type: "button", class: "cancel", "data-action": "cancel", "data-order-id": id }, "Cancel");
    retry.addEventListener("click", async () => {
      retry.disabled = true;
      await act("retry", id);
      onDone();
    });
    let disarm = null;
    cancel.addEventListener("click", async () => {
      if (!cancel.classList.contains("armed")) {
        cancel.classList.add("armed");
        cancel.textContent = "Confirm cancel";
        disarm = setTimeout(() => {
          cancel.classList.remove("armed");
          cancel.textContent = "Cancel";
        }, 4000);
        return;
      }
      clearTimeout(disarm);
      cancel.classList.remove("armed");
      cancel.textContent = "Cancel";
      cancel.disabled = true;
      await act("cancel", id);
      onDone();
    });
    return { retry, cancel };
  }

  /** Enables a button or greys it out with the reason as its tooltip. */
  function allow(button, allowed, why) {
    if (button.disabled === allowed) button.disabled = !allowed;
    const title = allowed ? "" : why;
    if (button.title !== title) button.title = title;
  }

  /**
   * Makes `tbody` show one row per item, keyed by `key(item)`: existing rows
   * (and their buttons) are updated in place by `update(row, item)`, new ones
   * made by `create(item)`, gone ones removed, and the order follows `items`.
   */
  function reconcile(tbody, items, key, create, update) {
    const existing = new Map();
    for (const row of Array.from(tbody.rows)) existing.set(row.dataset.key, row);
    let previous = null;
    for (const item of items) {
      const k = String(key(item));
      let row = existing.get(k);
      if (row) existing.delete(k);
      else {
        row = create(item);
        row.dataset.key = k;
      }
      update(row, item);
      const expected = previous ? previous.nextSibling : tbody.firstChild;
      if (row !== expected) tbody.insertBefore(row, expected);
      previous = row;
    }
    for (const row of existing.values()) row.remove();
  }

  /** Who is looking (`/api/me`): `{name, role, auth}`, once known. */
  let me = null;

  /**
   * Asks who is looking, shows it in the header (with a log-out link when
   * logged in with a token) and marks the page with the role, so a viewer's
   * page has no action buttons.
   */
  async function whoami() {
    if (me) return me;
    me = await getJson("/api/me");
    document.body.dataset.role = me.role;
    // What the deployment leaves open to anyone (no [applications] beyond loopback).
    for (const warning of me.warnings || []) {
      const banner = el("div", { class: "message exposure", "data-kind": "error", role: "alert" }, warning);
      document.body.prepend(banner);
    }
    const node = document.getElementById("me");
    if (node) {
      const who = el("span", { id: "me-name", "data-role": me.role }, `${me.name} (${me.role})`);
      const out = me.auth === "token" ? el("a", { href: "/logout", id: "logout" }, "Log out") : null;
      node.replaceChildren(who, out ? " · " : "", out || "");
    }
    return me;
  }

  /** Whether the page may offer retry and cancel: only to operators. */
  function canAct() {
    return me !== null && me.role === "operator";
  }

  /** Runs `refresh` now and every 2 s after each run ends; `refresh()` forces one now. */
  function poll(refresh) {
    let timer = null;
    let running = false;
    async function tick() {
      clearTimeout(timer);
      if (running) return;
      running = true;
      try {
        await whoami();
        await refresh();
        setStatus(true, "live");
        const updated = document.getElementById("updated");
        if (updated) setText(updated, new Date().toLocaleTimeString([], { hour12: false }));
      } catch (e) {
        setStatus(false, `not updating: ${e.message}`);
      } finally {
        running = false;
        timer = setTimeout(tick, REFRESH_MS);
      }
    }
    tick();
    return tick;
  }

  return {
    el, svg, setText, duration, time, relative, shortId, badge, orderLink,
    setStatus, showMessage, getJson, act, actionButtons, allow, reconcile, poll,
    whoami, canAct,
  };
})();
