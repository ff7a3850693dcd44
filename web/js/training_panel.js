// Kontext Trainer: a live panel on every TrainLoRA node: progress bar, step / total, loss and
// smoothed loss as a small chart, learning rate, seconds per step, ETA, status and the latest
// PreviewSampler images. It listens
// to the one training event (training_events.js) and, after a page reload, redraws itself from
// GET /kontext_trainer/progress. State per node id lives in window.KontextTrainer.panels.
import { PROGRESS_EVENT } from "./training_events.js";

const { app } = window.comfyAPI.app;
const { api } = window.comfyAPI.api;

const panels = (window.KontextTrainer ??= {}).panels ??= {};

function stateFor(nodeId) {
  return (panels[nodeId] ??= { progress: null, losses: [] });
}

function formatSeconds(seconds) {
  if (seconds == null) return "–";
  const s = Math.round(seconds);
  return s >= 60 ? `${Math.floor(s / 60)} min ${s % 60} s` : `${s} s`;
}

function drawChart(canvas, losses) {
  const ctx = canvas.getContext("2d");
  const { width, height } = canvas;
  ctx.fillStyle = "#18181b";
  ctx.fillRect(0, 0, width, height);
  if (losses.length < 2) return;
  const low = Math.min(...losses);
  const span = Math.max(...losses) - low || 1;
  const point = (i, v) => [4 + (i / (losses.length - 1)) * (width - 8), 4 + (1 - (v - low) / span) * (height - 8)];
  const line = (values, color, widthPx) => {
    ctx.strokeStyle = color;
    ctx.lineWidth = widthPx;
    ctx.beginPath();
    values.forEach((v, i) => (i ? ctx.lineTo(...point(i, v)) : ctx.moveTo(...point(i, v))));
    ctx.stroke();
  };
  let ema = losses[0];
  const smooth = losses.map((v) => (ema = 0.9 * ema + 0.1 * v));
  line(losses, "#6e8cbe", 1);
  line(smooth, "#ffaa3c", 2);
}

function render(nodeId) {
  const state = stateFor(nodeId);
  const p = state.progress;
  const node = app.graph?.getNodeById(Number(nodeId)) ?? app.graph?.getNodeById(nodeId);
  const element = node?.ktTrainingPanel;
  if (element) {
    const fraction = p && p.total ? p.step / p.total : 0;
    element.querySelector(".kt-bar-fill").style.width = `${(100 * fraction).toFixed(1)}%`;
    element.querySelector(".kt-status").textContent = p ? p.status : "idle";
    element.querySelector(".kt-step").textContent = p ? `step ${p.step} / ${p.total}` : "";
    element.querySelector(".kt-loss").textContent =
      p && p.loss != null ? `loss ${p.loss.toFixed(4)} (smoothed ${p.smoothed_loss.toFixed(4)})` : "";
    element.querySelector(".kt-speed").textContent =
      p && p.seconds_per_step ? `lr ${p.lr.toExponential(2)} · ${p.seconds_per_step.toFixed(2)} s/step · ETA ${formatSeconds(p.eta_seconds)}` : "";
    element.querySelector(".kt-message").textContent = p?.message ?? "";
    drawChart(element.querySelector("canvas"), state.losses);
    renderPreviews(element.querySelector(".kt-previews"), p?.previews ?? []);
  }
}

const ENDED = ["finished", "cancelled", "error"];

async function fetchState() {
  const response = await api.fetchApi("/kontext_trainer/progress");
  return response.json();
}

function renderPreviews(container, previews) {
  const key = previews.map((p) => p.filename).join("|");
  if (container.dataset.key === key) return; // unchanged: keep the loaded images
  container.dataset.key = key;
  container.replaceChildren(
    ...previews.map((p) => {
      const image = document.createElement("img");
      const query = new URLSearchParams({ filename: p.filename, subfolder: p.subfolder, type: p.type });
      image.src = api.apiURL(`/view?${query}`);
      image.title = `step ${p.step}`;
      image.style.cssText = "width:64px;height:64px;object-fit:cover;border-radius:3px";
      return image;
    }),
  );
}

function update(payload, losses) {
  const state = stateFor(String(payload.node));
  if (losses) {
    state.losses = [...losses];
  } else if (payload.loss != null && payload.step > state.losses.length) {
    state.losses.push(payload.loss); // events are throttled: some steps arrive only at the end
  }
  state.progress = payload;
  render(String(payload.node));
  if (!losses && ENDED.includes(payload.status)) {
    // the run is over: take every step's loss from the server for the final chart
    fetchState().then((full) => full.node === payload.node && update(full, full.losses));
  }
}

function panelElement() {
  const element = document.createElement("div");
  element.className = "kt-training-panel";
  element.style.cssText = "display:flex;flex-direction:column;gap:2px;font:11px sans-serif;color:#ddd;";
  element.innerHTML = `
    <div style="height:6px;background:#333;border-radius:3px;overflow:hidden">
      <div class="kt-bar-fill" style="height:100%;width:0;background:#ffaa3c"></div></div>
    <div><span class="kt-status">idle</span> · <span class="kt-step"></span></div>
    <div class="kt-loss"></div><div class="kt-speed"></div>
    <canvas width="240" height="80" style="width:100%;height:80px"></canvas>
    <div class="kt-previews" style="display:flex;gap:4px;flex-wrap:wrap"></div>
    <div class="kt-message" style="opacity:.7"></div>`;
  return element;
}

app.registerExtension({
  name: "KontextTrainer.TrainingPanel",
  async setup() {
    api.addEventListener(PROGRESS_EVENT, ({ detail }) => update(detail));
    const state = await fetchState();
    if (state.node != null) update(state, state.losses);
  },
  nodeCreated(node) {
    if (node.comfyClass !== "KontextTrainer_TrainLoRA") return;
    node.ktTrainingPanel = panelElement();
    node.addDOMWidget("training_panel", "div", node.ktTrainingPanel, {
      serialize: false,
      hideOnZoom: false,
      getMinHeight: () => 240,
    });
    setTimeout(() => render(String(node.id))); // the id is final once the graph has added the node
  },
});
