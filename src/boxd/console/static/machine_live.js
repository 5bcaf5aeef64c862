// A machine's page, live: its state, recent execs and processes over one event stream
// (/api/machines/ID/events, sent when one changes), and the chosen process's output
// (/api/machines/ID/processes/PID/output: what the node keeps, then each new bytes).
"use strict";

(function () {
  const facts = document.getElementById("facts");
  if (!facts) return;
  const machine = facts.dataset.machine;
  const enc = encodeURIComponent;
  const TAIL_CHARS = 64 * 1024;  // what the page holds of an output: its last characters
  const status = document.getElementById("live");
  const select = document.getElementById("tail-process");
  const pre = document.getElementById("tail");
  const tailStatus = document.getElementById("tail-status");
  let tail = null;

  function td(text, cls) {
    const cell = document.createElement("td");
    if (cls) cell.className = cls;
    cell.textContent = text;
    return cell;
  }

  function code(text) {
    const cell = document.createElement("td");
    const c = document.createElement("code");
    c.textContent = text;
    cell.append(c);
    return cell;
  }

  function setState(m) {
    const dd = document.getElementById("state");
    dd.textContent = m.state;
    dd.className = "state state-" + m.state;
    dd.dataset.state = m.state;
  }

  function renderExecs(rows) {
    const body = document.querySelector("#execs tbody");
    body.replaceChildren(...rows.map((e) => {
      const tr = document.createElement("tr");
      tr.dataset.exec = e.exec_id;
      tr.append(code(e.command), td(e.exit, "exit" + (e.ok ? "" : " exit-bad")),
                td(e.started), td(e.duration), code(e.exec_id));
      return tr;
    }));
    document.getElementById("execs-count").textContent = String(rows.length);
    document.getElementById("execs-empty").hidden = rows.length > 0;
  }

  // The newest running process, else the newest one.
  function pickDefault() {
    const options = [...select.options];
    const running = options.filter((o) => o.dataset.running);
    const chosen = running.length ? running[running.length - 1] : options[options.length - 1];
    return chosen ? chosen.value : "";
  }

  function renderProcesses(rows) {
    const current = tail ? select.value : "";
    select.replaceChildren(...rows.map((p) => {
      const o = document.createElement("option");
      o.value = p.id;
      o.dataset.running = p.running ? "1" : "";
      o.textContent = `${p.command}: ${p.state}, since ${p.started}`;
      return o;
    }));
    const any = rows.length > 0;
    document.getElementById("output-none").hidden = any;
    document.getElementById("output-pick").hidden = !any;
    pre.hidden = !any;
    if (current && rows.some((p) => p.id === current)) {
      select.value = current;
    } else if (any) {
      select.value = pickDefault();
      follow(select.value);
    }
  }

  function append(text) {
    const atBottom = pre.scrollTop + pre.clientHeight >= pre.scrollHeight - 4;
    let all = pre.textContent + text;
    if (all.length > TAIL_CHARS) all = all.slice(all.length - TAIL_CHARS);
    pre.textContent = all;
    if (atBottom) pre.scrollTop = pre.scrollHeight;
  }

  function follow(pid) {
    if (tail) tail.close();
    pre.textContent = "";
    pre.dataset.process = pid;
    tailStatus.textContent = "connecting…";
    const source = new EventSource(
      `/api/machines/${enc(machine)}/processes/${enc(pid)}/output`);
    tail = source;
    source.addEventListener("open", () => { tailStatus.textContent = "live"; });
    source.addEventListener("output", (e) => { append(JSON.parse(e.data)); });
    source.addEventListener("gap", (e) => {
      append(`\n[… ${JSON.parse(e.data)} bytes were dropped before they were shown …]\n`);
    });
    source.addEventListener("end", (e) => {
      const end = JSON.parse(e.data);
      tailStatus.textContent = end.error ? "ended: " + end.error : `exited (${end.exit_code})`;
      source.close();
    });
    source.onerror = () => {
      if (source.readyState !== EventSource.CLOSED) tailStatus.textContent = "reconnecting…";
    };
  }

  const events = new EventSource(`/api/machines/${enc(machine)}/events`);
  events.addEventListener("open", () => { status.textContent = "live"; });
  events.addEventListener("machine", (e) => {
    setState(JSON.parse(e.data));
    status.textContent = "live";
    status.dataset.updated = String(Date.now());
  });
  events.addEventListener("execs", (e) => renderExecs(JSON.parse(e.data)));
  events.addEventListener("processes", (e) => renderProcesses(JSON.parse(e.data)));
  events.addEventListener("gone", () => {
    setState({ state: "deleted" });
    status.textContent = "this machine was deleted";
    events.close();
    if (tail) tail.close();
  });
  events.onerror = () => {
    if (events.readyState !== EventSource.CLOSED) status.textContent = "reconnecting…";
  };

  select.addEventListener("change", () => follow(select.value));
  if (select.options.length) {
    select.value = pickDefault();
    follow(select.value);
  }
  window.addEventListener("pagehide", () => {
    events.close();
    if (tail) tail.close();
  });
})();
