// A machine's page: its fork tree drawn with cytoscape.js (vendored, static/vendor/).
"use strict";

(async function () {
  const box = document.getElementById("graph");
  const machine = box.dataset.machine;
  const r = await fetch(`/api/machines/${encodeURIComponent(machine)}/graph`);
  if (!r.ok) { box.textContent = "The fork tree could not be loaded."; return; }
  const { elements } = await r.json();
  const cy = cytoscape({
    container: box,
    elements,
    boxSelectionEnabled: false,
    autoungrabify: true,
    style: [
      { selector: "node", style: {
        label: "data(label)", "font-size": 11, "text-valign": "bottom", "text-margin-y": 4,
        "background-color": "#4a78c2", width: 22, height: 22, color: "#111" } },
      { selector: "node[kind = 'snapshot']", style: { shape: "diamond", "background-color": "#8a5cc2" } },
      { selector: "node[kind = 'checkpoint']", style: { shape: "round-rectangle", "background-color": "#c28a2a", width: 16, height: 16 } },
      { selector: "node[?focus]", style: { "border-width": 4, "border-color": "#111", width: 30, height: 30 } },
      { selector: "node[state = 'suspended'], node[state = 'hibernated']", style: { "background-color": "#8a8f98" } },
      { selector: "node[state = 'failed'], node[state = 'lost']", style: { "background-color": "#c23a3a" } },
      { selector: "edge", style: { width: 2, "line-color": "#9aa3ad", "target-arrow-color": "#9aa3ad",
        "target-arrow-shape": "triangle", "curve-style": "bezier" } },
    ],
  });
  // Each fork under its source: the tree's roots (no incoming edge) at the top.
  cy.layout({ name: "breadthfirst", directed: true, roots: cy.nodes().roots(),
              spacingFactor: 1.1, padding: 20 }).run();
  cy.on("tap", "node", (e) => {
    const href = e.target.data("href");
    if (href) window.location.assign(href);
  });
  window.boxdGraph = cy;  // the browser tests read positions from it
  box.dataset.ready = "1";
  document.addEventListener("boxd:acted", (e) => {
    const { action, result } = e.detail;
    if (action === "delete" && result === null) window.location.assign("/");
    else window.location.reload();
  });
})();
