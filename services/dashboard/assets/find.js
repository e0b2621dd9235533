// The overview's search form (GET /api/orders, a page at a time) and the
// dead-letter panel (GET /api/dead-letters, replay and purge for operators).
// Text from the server only ever becomes text nodes, never HTML.
"use strict";

(() => {
  const { el, setText, time, badge, orderLink } = sas;
  const byId = (id) => document.getElementById(id);
  const DEAD_LETTERS_EVERY_MS = 5000;

  // ---- search -------------------------------------------------------------

  /** The current search's parameters and the cursor of its next page. */
  let query = null;
  let next = null;
  let shown = 0;

  function searchMessage(text) {
    const node = byId("search-message");
    setText(node, text || "");
    node.hidden = !text;
  }

  /** The form's filters as query parameters (times sent as UTC instants). */
  function formParams(form) {
    const params = new URLSearchParams();
    for (const [key, value] of new FormData(form)) {
      // A payload value is compared as typed: only the other fields are trimmed.
      const text = key === "value" ? String(value) : String(value).trim();
      if (text === "") continue;
      if (key === "from" || key === "to") {
        const at = new Date(text);
        if (Number.isNaN(at.getTime())) throw new Error(`${key}: not a time`);
        params.set(key, at.toISOString());
      } else params.set(key, text);
    }
    return params;
  }

  function resultRow(o) {
    const tr = el("tr", { "data-order-id": o.order_id, "data-state": o.process_state });
    const why = o.held_reason ? `held: ${o.held_reason}` : o.last_error || "–";
    tr.append(
      el("td", {}, orderLink(o.order_id)),
      el("td", {}, badge(o.process_state)),
      el("td", { class: "nowrap" }, o.workflow),
      el("td", { class: "num" }, o.failure_count),
      el("td", { class: "time" }, time(o.created_at)),
      el("td", { class: "time" }, time(o.updated_at)),
      el("td", { class: "wrap" }, why),
    );
    return tr;
  }

  /** Fetches the next page of the current search and appends it. */
  async function page(first) {
    const params = new URLSearchParams(query);
    if (!first && next) params.set("after", next);
    const tbody = byId("search-results").tBodies[0];
    const more = byId("search-more");
    more.disabled = true;
    try {
      const data = await sas.getJson(`/api/orders?${params}`);
      if (first) {
        tbody.replaceChildren();
        shown = 0;
      }
      for (const o of data.orders) tbody.append(resultRow(o));
      shown += data.orders.length;
      next = data.next;
      searchMessage("");
      byId("search-results").hidden = shown === 0;
      byId("search-empty").hidden = shown > 0;
      more.hidden = !next;
      setText(byId("search-count"), `(${shown}${next ? "+" : ""} found)`);
      document.body.dataset.searched = String(shown);
    } catch (e) {
      searchMessage(e.message);
    } finally {
      more.disabled = false;
    }
  }

  function setUpSearch() {
    const form = byId("search");
    form.addEventListener("submit", (event) => {
      // The page's policy forbids form submissions: the search runs here.
      event.preventDefault();
      try {
        query = formParams(form).toString();
      } catch (e) {
        searchMessage(e.message);
        return;
      }
      next = null;
      page(true);
    });
    form.addEventListener("reset", () => {
      query = null;
      next = null;
      shown = 0;
      byId("search-results").tBodies[0].replaceChildren();
      byId("search-results").hidden = true;
      byId("search-empty").hidden = true;
      byId("search-more").hidden = true;
      setText(byId("search-count"), "");
      searchMessage("");
    });
    byId("search-more").addEventListener("click", () => page(false));
  }

  // ---- dead letters -------------------------------------------------------

  function deadMessage(kind, text) {
    const node = byId("dead-letters-message");
    node.dataset.kind = kind;
    setText(node, text || "");
    node.hidden = !text;
  }

  function queueOf(q) {
    if (q.kind === "orders") return "orders";
    if (q.kind === "requests") return `requests to ${q.agent}`;
    return "replies";
  }

  async function post(url) {
    const response = await fetch(url, {
      method: "POST",
      headers: { "Content-Type": "application/json", Accept: "application/json" },
      body: "{}",
    });
    const body = await response.json().catch(() => ({}));
    return { ok: response.ok, status: response.status, body };
  }

  /** Shows the oldest messages of a queue below the table. */
  async function showLetters(queue) {
    try {
      const data = await sas.getJson(`/api/dead-letters/${encodeURIComponent(queue)}?limit=20`);
      setText(byId("dead-letters-queue"), `${queue} (${data.letters.length} of ${data.total})`);
      const tbody = byId("dead-letter-list").tBodies[0];
      tbody.replaceChildren(
        ...data.letters.map((l) => {
          const body = l.body.length > 160 ? `${l.body.slice(0, 159)}…` : l.body;
          return el(
            "tr",
            { "data-message-id": l.message_id || "" },
            el("td", { class: "wrap" }, l.reason || "–"),
            el("td", { class: "mono" }, l.message_id || "–"),
            el("td", { class: "mono" }, l.reply_to || "–"),
            el("td", { class: "num" }, l.tries),
            el("td", { class: "mono wrap", title: l.body }, body),
          );
        }),
      );
      byId("dead-letters-shown").hidden = false;
      byId("dead-letters-shown").dataset.queue = queue;
    } catch (e) {
      deadMessage("error", `${queue}: ${e.message}`);
    }
  }

  function buttons(q) {
    const show = el("button", { type: "button", class: "show", "data-action": "show" }, "Show");
    show.addEventListener("click", () => showLetters(q.queue));
    if (!sas.canAct()) return [show];
    const replay = el("button", { type: "button", class: "replay", "data-action": "replay" }, "Replay");
    const purge = el("button", { type: "button", class: "purge", "data-action": "purge" }, "Purge");
    replay.addEventListener("click", async () => {
      replay.disabled = true;
      const r = await post(`/api/dead-letters/${encodeURIComponent(q.queue)}/replay`);
      if (r.ok) deadMessage("ok", `Replayed ${r.body.replayed} from ${q.queue} to ${q.origin}.`);
      else deadMessage("error", `${r.status}: ${r.body.error || "replay failed"}`);
      replay.disabled = false;
      refreshDeadLetters();
    });
    // Purge deletes for good: a second click within 4 s confirms.
    let disarm = null;
    purge.addEventListener("click", async () => {
      if (!purge.classList.contains("armed")) {
        purge.classList.add("armed");
        purge.textContent = "Confirm purge";
        disarm = setTimeout(() => {
          purge.classList.remove("armed");
          purge.textContent = "Purge";
        }, 4000);
        return;
      }
      clearTimeout(disarm);
      purge.classList.remove("armed");
      purge.textContent = "Purge";
      purge.disabled = true;
      const r = await post(`/api/dead-letters/${encodeURIComponent(q.queue)}/purge`);
      if (r.ok) deadMessage("ok", `Purged ${r.body.purged} from ${q.queue}.`);
      else deadMessage("error", `${r.status}: ${r.body.error || "purge failed"}`);
      purge.disabled = false;
      refreshDeadLetters();
    });
    return [show, replay, purge];
  }

  async function loadDeadLetters() {
    const data = await sas.getJson("/api/dead-letters");
    sas.reconcile(
      byId("dead-letters").tBodies[0],
      data.queues,
      (q) => q.queue,
      (q) => {
        const tr = el("tr", { "data-queue": q.queue });
        for (let i = 0; i < 5; i++) tr.append(el("td"));
        // Not "actions": a viewer, whose page hides those, may still look.
        tr.cells[4].className = "dl-actions";
        tr.cells[4].append(...buttons(q));
        return tr;
      },
      (tr, q) => {
        tr.dataset.total = q.total === null ? "" : String(q.total);
        setText(tr.cells[0], q.queue);
        tr.cells[0].className = "mono";
        setText(tr.cells[1], queueOf(q));
        setText(tr.cells[2], q.total === null ? q.error || "?" : q.total);
        tr.cells[2].className = q.total === null ? "wrap" : "num";
        setText(tr.cells[3], q.origin);
        tr.cells[3].className = "mono";
      },
    );
    const total = data.queues.reduce((n, q) => n + (q.total || 0), 0);
    setText(byId("dead-letters-count"), `(${total})`);
    const shownQueue = byId("dead-letters-shown").dataset.queue;
    if (shownQueue && !byId("dead-letters-shown").hidden) await showLetters(shownQueue);
  }

  let timer = null;
  async function refreshDeadLetters() {
    clearTimeout(timer);
    try {
      await sas.whoami();
      await loadDeadLetters();
      if (byId("dead-letters-message").dataset.kind === "unreachable") deadMessage("", "");
    } catch (e) {
      // RabbitMQ down does not stop the rest of the page.
      deadMessage("unreachable", `Dead letters not shown: ${e.message}`);
    } finally {
      timer = setTimeout(refreshDeadLetters, DEAD_LETTERS_EVERY_MS);
    }
  }

  setUpSearch();
  refreshDeadLetters();
})();
