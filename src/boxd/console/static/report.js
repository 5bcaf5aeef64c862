// Draws a reproducibility report's charts with Chart.js; inlined into the HTML page
// by boxd/console/report.py (with the report's data as #report-data).
"use strict";
const R = JSON.parse(document.getElementById("report-data").textContent);
const pairs = R.pairs || [];
const diverged = pairs.filter(p => !p.identical && p.first_divergence);
const charts = {};
Chart.defaults.animation = false;
charts.pairs = new Chart(document.getElementById("chart-pairs"), {
  type: "bar",
  data: { labels: ["identical", "diverged"], datasets: [{ label: "seeds",
    data: [R.seeds - R.diverged, R.diverged], backgroundColor: ["#2e8b57", "#c0392b"] }] },
  options: { indexAxis: "y", plugins: { legend: { display: false } } },
});
// At most 20 bins over steps 0..R.steps, each `width` steps wide.
const width = Math.max(1, Math.ceil((R.steps + 1) / 20));
const bins = Math.ceil((R.steps + 1) / width);
const counts = new Array(bins).fill(0);
for (const p of diverged) counts[Math.min(bins - 1, Math.floor(p.first_divergence.step / width))] += 1;
charts.steps = new Chart(document.getElementById("chart-steps"), {
  type: "bar",
  data: { labels: counts.map((_, i) => width === 1 ? String(i) :
    `${i * width}-${Math.min(R.steps, (i + 1) * width - 1)}`),
    datasets: [{ label: "diverged pairs", data: counts, backgroundColor: "#c0392b" }] },
  options: { scales: { x: { title: { display: true, text: "first divergent step" } },
    y: { beginAtZero: true, ticks: { precision: 0 }, title: { display: true, text: "pairs" } } } },
});
const same = pairs.filter(p => p.identical).map(p => ({ x: p.seed, y: R.steps }));
charts.seeds = new Chart(document.getElementById("chart-seeds"), {
  type: "scatter",
  data: { datasets: [
    { label: "first divergent step", data: diverged.map(p => ({ x: p.seed, y: p.first_divergence.step })),
      backgroundColor: "#c0392b" },
    { label: "identical (drawn at the last step)", data: same, backgroundColor: "#2e8b57" } ] },
  options: { scales: { x: { title: { display: true, text: "seed" } },
    y: { min: 0, max: R.steps, title: { display: true, text: "step" } } } },
});
window.boxdCharts = charts;
document.body.dataset.ready = "1";
