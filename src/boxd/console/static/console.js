// The boxd console: the machines table (live over server-sent events), its filters,
// and actions that ask first. No framework: the page is rendered by the daemon.
"use strict";

const ACTIONS = ["suspend", "resume", "hibernate", "fork", "checkpoint", "snapshot", "delete"];
const NEEDS_NAME = { fork: "optional", checkpoint: "optional", snapshot: "required" };
const QUESTIONS = {
  suspend: "Suspend {m}? Its vCPUs stop; its memory stays.",
  resume: "Resume {m}?",
  hibernate: "Hibernate {m}? Its memory goes to disk and its VM process ends.",
  delete: "Delete {m}? It is gone for good, with its checkpoints.",
  fork: "Fork {m}? A child starts from its current state.",
  checkpoint: "Save a checkpoint of {m}?",
  snapshot: "Save a snapshot of {m}?",
};

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === "class") node.className = v;
    else if (k.startsWith("data-") || k.startsWith("aria-") || k === "href" || k === "type")
      node.setAttribute(k, v);
    else node[k] = v;
  }
  for (const c of children) node.append(c);
  return node;
}

function actionButtons(row) {
  const span = el("span", { class: "actions" });
  for (const a of ACTIONS) {
    span.append(el("button", {
      type: "button", class: "action" + (a === "delete" ? " danger" : ""),
      "data-action": a, "data-machine": row.id, "data-name": row.name,
      "aria-label": a.charAt(0).toUpperCase() + a.slice(1) + " " + row.name,
    }, a));
  }
  return span;
}

function rowElement(row) {
  const labels = el("td");
  for (const [k, v] of Object.entries(row.labels)) {
    labels.append(el("span", { class: "label" }, k + "=" + v), " ");
  }
  const parent = el("td");
  if (row.parent_id) parent.append(el("a", { href: "/machines/" + row.parent_id }, row.parent));
  const tr = el("tr", { "data-id": row.id, "data-state": row.state },
    el("td", {}, el("a", { href: "/machines/" + row.id }, row.name)),
    el("td", { class: "state state-" + row.state }, row.state),
    el("td", {}, row.engine), el("td", {}, row.source), labels, parent,
    el("td", {}, row.age), el("td", {}, row.idle), el("td", {}, row.memory),
    el("td", {}, actionButtons(row)));
  tr.dataset.labels = JSON.stringify(row.labels);
  return tr;
}

function matches(tr) {
  const state = document.getElementById("filter-state").value;
  const label = document.getElementById("filter-label").value.trim();
  if (state && tr.dataset.state !== state) return false;
  if (!label) return true;
  const labels = JSON.parse(tr.dataset.labels || "{}");
  const [key, value] = label.split("=", 2);
  if (!(key in labels)) return false;
  return value === undefined || labels[key] === value;
}

function applyFilters() {
  const rows = document.querySelectorAll("#machines tbody tr");
  let shown = 0;
  for (const tr of rows) {
    tr.hidden = !matches(tr);
    if (!tr.hidden) shown += 1;
  }
  document.getElementById("count").textContent = String(shown);
  document.getElementById("empty").hidden = shown > 0;
}

function render(rows) {
  const body = document.querySelector("#machines tbody");
  // Keep focus on the same button across a re-render (keyboard users).
  const focused = document.activeElement;
  const key = focused && focused.dataset ? [focused.dataset.machine, focused.dataset.action] : null;
  body.replaceChildren(...rows.map(rowElement));
  if (key && key[0]) {
    const again = body.querySelector(`button[data-machine="${CSS.escape(key[0])}"][data-action="${CSS.escape(key[1])}"]`);
    if (again) again.focus();
  }
  applyFilters();
}

function live() {
  const status = document.getElementById("live");
  const source = new EventSource("/api/events");
  source.addEventListener("machines", (e) => {
    render(JSON.parse(e.data));
    status.textContent = "live";
    status.dataset.updated = String(Date.now());
  });
  source.onerror = () => { status.textContent = "reconnecting…"; };
}

async function act(action, machine, name) {
  const r = await fetch(`/api/machines/${encodeURIComponent(machine)}/actions/${action}`, {
    method: "POST",
    headers: { "Content-Type": "application/json", "X-Boxd-Console": "1" },
    body: JSON.stringify(name ? { name } : {}),
  });
  const body = await r.json().catch(() => ({}));
  if (!r.ok) {
    const e = body.error || {};
    throw new Error((e.message || r.statusText) + (e.hint ? ` (${e.hint})` : ""));
  }
  return body.result;
}

function confirmAction(button) {
  const dialog = document.getElementById("confirm");
  const action = button.dataset.action;
  const mname = button.dataset.name;
  const need = NEEDS_NAME[action];
  document.getElementById("confirm-title").textContent = action.charAt(0).toUpperCase() + action.slice(1) + " " + mname;
  document.getElementById("confirm-text").textContent = QUESTIONS[action].replace("{m}", mname);
  const nameRow = document.getElementById("confirm-name-row");
  const input = document.getElementById("confirm-name");
  nameRow.hidden = !need;
  input.value = "";
  input.required = need === "required";
  input.placeholder = need === "optional" ? "optional: generated if empty" : "";
  const error = document.getElementById("confirm-error");
  error.textContent = "";
  const ok = document.getElementById("confirm-ok");
  ok.disabled = false;
  ok.onclick = async (e) => {
    e.preventDefault();
    if (input.required && !input.value.trim()) { error.textContent = "A name is needed."; input.focus(); return; }
    ok.disabled = true;
    error.textContent = "working…";
    try {
      const result = await act(action, button.dataset.machine, input.value.trim());
      dialog.close("done");
      document.dispatchEvent(new CustomEvent("boxd:acted", { detail: { action, result } }));
    } catch (err) {
      error.textContent = String(err.message || err);
      ok.disabled = false;
    }
  };
  document.getElementById("confirm-cancel").onclick = () => dialog.close("cancel");
  dialog.returnValue = "";
  dialog.addEventListener("close", () => button.isConnected && button.focus(), { once: true });
  dialog.showModal();
  (need ? input : ok).focus();
}

document.addEventListener("click", (e) => {
  const button = e.target.closest("button.action");
  if (button) confirmAction(button);
});

if (document.getElementById("machines")) {
  for (const tr of document.querySelectorAll("#machines tbody tr")) {
    tr.dataset.labels = JSON.stringify(Object.fromEntries(
      [...tr.querySelectorAll(".label")].map((s) => s.textContent.split("=", 2))));
  }
  document.getElementById("filter-state").addEventListener("change", applyFilters);
  document.getElementById("filter-label").addEventListener("input", applyFilters);
  document.getElementById("filters").addEventListener("submit", (e) => e.preventDefault());
  applyFilters();
  live();
}
