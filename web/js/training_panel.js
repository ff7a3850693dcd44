// Kontext Trainer: a live panel on every TrainLoRA node: status, progress bar, step / total,
// loss and smoothed loss with a chart (and the held-out validation loss when the run computes
// one), learning rate, s/step, ETA and the preview history.
// It follows the one training event (training_events.js) and ComfyUI's queue (a queued run
// shows "queued" before it starts); after a page reload it redraws itself from
// GET /kontext_trainer/progress. Runs are keyed by prompt id and node and shown only in their
// own workflow (training_runs.js). When a training prompt leaves the queue, the file lists on
// the canvas are refreshed (combo_lists.js), so the checkpoint or LoRA it wrote is listed.
// Tests reach the state and the pure helpers through window.KontextTrainer.
import { refreshComboLists } from "./combo_lists.js";
import { drawChart } from "./training_chart.js";
import { PROGRESS_EVENT } from "./training_events.js";
import { chartEnvelope, smoothLosses, validationShown, valueRange } from "./training_math.js";
import { PREVIEW_ROW_PX, renderPreviews } from "./training_previews.js";
import { ENDED, RunStore, workflowKey } from "./training_runs.js";

const { app } = window.comfyAPI.app;
const { api } = window.comfyAPI.api;

const NODE_CLASS = "KontextTrainer_TrainLoRA";
const ROUTE = "/kontext_trainer/progress";
const STATUS_COLORS = { idle: "#888", queued: "#a0a0ff", running: "#ffaa3c", finished: "#5fd068" };
const PROBLEM_COLOR = "#e05050"; // error, cancelled
const MIN_NODE_WIDTH = 460; // room for three preview thumbnails side by side
// The panel's height: status (14), bar (6), loss and speed (13 each), chart (84), a row of
// previews and two lines of message (26; a longer one scrolls), 4 px apart (7 gaps), 4 px of
// padding and 9 spare: 326 px. With the node's basic widgets, a fresh TrainLoRA at 100 % fits a
// 1920 x 937 page (issue 45).
const PANEL_PX = 14 + 6 + 13 + 13 + 84 + PREVIEW_ROW_PX + 26 + 7 * 4 + 4 + 9;
const store = new RunStore();

function shownWorkflowId() {
  return workflowKey((app.rootGraph ?? app.graph)?.id);
}

function runShown(nodeId) {
  return store.runFor(String(nodeId), shownWorkflowId());
}

function formatSeconds(seconds) {
  if (seconds == null) return "–";
  const s = Math.round(seconds);
  if (s >= 3600) return `${Math.floor(s / 3600)} h ${Math.floor((s % 3600) / 60)} min`;
  return s >= 60 ? `${Math.floor(s / 60)} min ${s % 60} s` : `${s} s`;
}

const count = (n) => Number(n).toLocaleString("en-US");

function texts(run) {
  const p = run?.progress;
  const status = run?.status ?? "idle";
  const speed = p?.seconds_per_step
    ? `lr ${p.lr?.toExponential(2) ?? "–"} · ${p.seconds_per_step.toFixed(2)} s/step` +
      (ENDED.includes(status) ? "" : ` · ETA ${formatSeconds(p.eta_seconds)}`)
    : "";
  return {
    status,
    name: p?.lora_name ?? "",
    step: p?.total ? `step ${count(p.step)} / ${count(p.total)}` : "",
    loss:
      p?.loss != null
        ? `loss ${p.loss.toFixed(4)} · smoothed ${p.smoothed_loss?.toFixed(4) ?? "–"}` +
          (p.validation_loss != null ? ` · validation ${p.validation_loss.toFixed(4)}` : "")
        : "",
    speed,
    message: [run?.cachedNote, p?.message].filter(Boolean).join("\n"),
  };
}

// What the panel says when ComfyUI ran TrainLoRA from its cache (Run with nothing changed).
function cachedNote(node, run) {
  const widget = node.widgets?.find((w) => w.name === "lora_name")?.value;
  const name = run?.progress?.lora_name || (widget ? `${widget}.safetensors` : "");
  const where = name ? `: the LoRA is models/loras/${name}` : "";
  return `nothing changed since the last run${where} (change a setting or the dataset to train again)`;
}

// ComfyUI's cache answered the prompt: the TrainLoRA nodes it lists did not run.
function onCached(detail) {
  const cached = new Set((detail?.nodes ?? []).map(String));
  for (const node of trainNodes()) {
    if (!cached.has(String(node.id))) continue;
    const before = runShown(node.id);
    const shown = before && !before.queued ? before : null;
    store.applyCached(detail.prompt_id, node.id, shownWorkflowId(), cachedNote(node, shown));
    render(node);
  }
}

function render(node) {
  const element = node?.ktTrainingPanel;
  if (!element) return;
  const run = runShown(node.id);
  const p = run?.progress;
  const field = (name) => element.querySelector(`.kt-${name}`);
  for (const [name, text] of Object.entries(texts(run))) field(name).textContent = text;
  field("status").style.background = STATUS_COLORS[run?.status ?? "idle"] ?? PROBLEM_COLOR;
  field("message").style.color = STATUS_COLORS[run?.status ?? "idle"] ? "#999" : "#f0a0a0";
  field("status").title = run ? `prompt ${run.promptId}` : "this node has not trained in this workflow";
  const fraction = p?.total ? Math.min(p.step / p.total, 1) : 0;
  field("bar-fill").style.width = `${(100 * fraction).toFixed(1)}%`;
  drawChart(element.querySelector("canvas"), run?.losses ?? [], run?.validation ?? []);
  renderPreviews(field("previews"), p?.previews ?? []);
  field("no-previews").style.display = p?.previews?.length ? "none" : "flex";
  renderNoPreviewsText(node);
}

// What the empty preview area says: with a PreviewSampler connected, when its previews come
// (its every_n_steps, read from the canvas); without one, how to get previews.
function noPreviewsText(node) {
  const slot = (node.inputs ?? []).findIndex((input) => input.name === "preview");
  if (slot < 0 || node.inputs[slot].link == null) {
    return "previews appear here while it trains (connect a PreviewSampler)";
  }
  const every = node.getInputNode?.(slot)?.widgets?.find((w) => w.name === "every_n_steps")?.value;
  const when = every ? `every ${count(every)} steps and at the end` : "while it trains and at the end";
  const ended = ENDED.includes(runShown(node.id)?.status);
  return `${ended ? "no previews in this run" : "no previews yet"}: the PreviewSampler samples ${when}`;
}

function renderNoPreviewsText(node) {
  const element = node.ktTrainingPanel?.querySelector(".kt-no-previews");
  const text = noPreviewsText(node);
  if (element && element.textContent !== text) element.textContent = text;
}

function trainNodes() {
  return (app.graph?.nodes ?? []).filter((node) => node.comfyClass === NODE_CLASS);
}

function renderNode(nodeId) {
  for (const node of trainNodes()) if (String(node.id) === String(nodeId)) render(node);
}

function renderAll() {
  for (const node of trainNodes()) render(node);
}

async function fetchState(since = 0) {
  const response = await api.fetchApi(`${ROUTE}?since=${since}`);
  return response.json();
}

// Losses of the steps between two throttled events (and the last ones when a run ends): only
// the missing tail is fetched, one request at a time per run. The validation points (few)
// come whole with it.
async function fetchLosses(run) {
  if (run.fetching) return void (run.fetchAgain = true);
  run.fetching = true;
  run.validationStale = false; // this fetch brings every point recorded so far
  try {
    const state = await fetchState(run.losses.length);
    if (state.prompt_id === run.promptId && String(state.node) === run.node) {
      store.setLosses(run, state.losses_from, state.losses);
      store.addValidation(run, state.validation);
      renderNode(run.node);
    }
  } finally {
    run.fetching = false;
  }
  if (run.fetchAgain) {
    run.fetchAgain = false;
    if (run.missing || run.validationStale) await fetchLosses(run);
  }
}

function onProgress(payload) {
  const run = store.applyProgress(payload);
  renderNode(run.node);
  if (run.missing || run.validationStale || ENDED.includes(run.status)) fetchLosses(run).catch(() => {});
}

// Every TrainLoRA of a queued or running prompt (from any client) becomes a "queued" run. A
// training prompt that left the queue has ended (finished, cancelled or failed) with its files
// written: the file lists on the canvas are refreshed to show them.
let queueRequests = 0;
let queueAnswered = 0;
let trainingPrompts = new Set();
async function followQueue() {
  const request = ++queueRequests;
  const queue = await (await api.fetchApi("/queue")).json();
  if (request < queueAnswered) return; // a newer answer came first
  queueAnswered = request;
  const inQueue = new Set();
  const training = new Set();
  for (const [, promptId, prompt, extra] of [...queue.queue_running, ...queue.queue_pending]) {
    inQueue.add(promptId);
    const workflowId = extra?.extra_pnginfo?.workflow?.id;
    for (const [nodeId, node] of Object.entries(prompt ?? {})) {
      if (node.class_type !== NODE_CLASS) continue;
      store.addQueued(promptId, nodeId, workflowId, node.inputs?.lora_name);
      training.add(promptId);
    }
  }
  store.dropQueuedExcept(inQueue);
  renderAll();
  const ended = [...trainingPrompts].some((promptId) => !training.has(promptId));
  trainingPrompts = training;
  if (ended) {
    await refreshComboLists();
    moveResumeChoices();
  }
}

// keep_last counts the run a resume continues, so it can prune the checkpoint the run resumed
// from: the run's last event names the choice that takes its place (`resume_next`: the run's
// newest checkpoint, or "none"). A TrainLoRA whose resume_from still holds a choice the fresh
// list no longer has takes it; left as it was, the next Run was refused ("Value not in list").
function moveResumeChoices() {
  const root = app.rootGraph ?? app.graph;
  for (const node of root?.nodes ?? []) {
    if ((node.comfyClass ?? node.type) !== NODE_CLASS) continue;
    const next = runShown(node.id)?.progress?.resume_next;
    const widget = node.widgets?.find((w) => w.name === "resume_from");
    const values = widget?.options?.values ?? [];
    if (next && !values.includes(widget.value) && values.includes(next)) widget.value = next;
  }
  app.graph?.setDirtyCanvas?.(true, true);
}

function panelElement() {
  const element = document.createElement("div");
  element.className = "kt-training-panel";
  element.style.cssText =
    "display:flex;flex-direction:column;gap:4px;font:11px sans-serif;color:#ddd;padding:2px 6px 2px 2px;" +
    "box-sizing:border-box;overflow:hidden";
  element.innerHTML = `
    <div style="display:flex;align-items:center;gap:6px;white-space:nowrap">
      <span class="kt-status" style="padding:1px 6px;border-radius:8px;color:#111;font-weight:600">idle</span>
      <span class="kt-name" style="overflow:hidden;text-overflow:ellipsis"></span>
      <span class="kt-step" style="margin-left:auto"></span></div>
    <div style="height:6px;background:#333;border-radius:3px;overflow:hidden">
      <div class="kt-bar-fill" style="height:100%;width:0;background:#ffaa3c"></div></div>
    <div class="kt-loss"></div><div class="kt-speed" style="opacity:.8"></div>
    <canvas style="width:100%;height:84px;border-radius:4px;flex:none"></canvas>
    <div class="kt-previews" style="display:none;flex:none;gap:6px;overflow-x:auto;padding-bottom:2px"></div>
    <div class="kt-no-previews" style="height:${PREVIEW_ROW_PX}px;flex:none;display:flex;align-items:center;justify-content:center;
      border:1px dashed #444;border-radius:4px;color:#777;text-align:center;padding:0 12px"></div>
    <div class="kt-message" style="white-space:pre-wrap;overflow-wrap:anywhere;flex:1 1 0;min-height:26px;overflow-y:auto"></div>`;
  return element;
}

window.KontextTrainer = Object.assign(window.KontextTrainer ?? {}, {
  runs: store,
  runShown,
  shownWorkflowId,
  redraw: renderAll,
  smoothLosses,
  chartEnvelope,
  valueRange,
  validationShown,
  drawChart,
});

app.registerExtension({
  name: "KontextTrainer.TrainingPanel",
  async setup() {
    api.addEventListener(PROGRESS_EVENT, ({ detail }) => onProgress(detail));
    api.addEventListener("status", () => followQueue().catch(() => {}));
    api.addEventListener("execution_start", () => followQueue().catch(() => {}));
    api.addEventListener("execution_cached", ({ detail }) => onCached(detail));
    api.addEventListener("execution_error", ({ detail }) => {
      const run = store.applyError(detail.prompt_id, detail.node_id, detail.exception_message);
      if (run) renderNode(run.node);
    });
    const state = await fetchState();
    if (state.node != null) {
      const run = store.applyProgress(state);
      store.setLosses(run, state.losses_from ?? 0, state.losses);
      store.addValidation(run, state.validation);
    }
    await followQueue();
  },
  nodeCreated(node) {
    if (node.comfyClass !== NODE_CLASS) return;
    node.ktTrainingPanel = panelElement();
    node.addDOMWidget("training_panel", "div", node.ktTrainingPanel, {
      serialize: false,
      hideOnZoom: false,
      getMinHeight: () => PANEL_PX,
    });
    // fit the panel in from the start (else the canvas grows the node while it draws it, and
    // the first frame shows the panel below the node); a saved size wins later
    node.setSize([Math.max(node.size[0], MIN_NODE_WIDTH), node.computeSize()[1]]);
    // the placeholder follows the preview link and the PreviewSampler's every_n_steps as they
    // change on the canvas (a text compare per frame drawn)
    const onDrawForeground = node.onDrawForeground;
    node.onDrawForeground = function () {
      renderNoPreviewsText(this);
      return onDrawForeground?.apply(this, arguments);
    };
    // the node id and the workflow (graph id) are final once the graph has added the node
    setTimeout(() => render(node));
    // the chart is drawn at its canvas's size: again once the frontend has laid the panel out
    // (drawn before, at another width, the browser stretched it and squeezed its text)
    const chart = node.ktTrainingPanel.querySelector("canvas");
    let drawnAt = "";
    new ResizeObserver(() => {
      const size = `${chart.clientWidth}x${chart.clientHeight}`;
      if (size !== drawnAt && chart.clientWidth > 0) {
        drawnAt = size;
        render(node);
      }
    }).observe(chart);
  },
});
