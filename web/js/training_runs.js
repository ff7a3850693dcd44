// Kontext Trainer: the training runs this page knows about and which one a TrainLoRA panel
// shows. A run is one prompt (prompt id) for one TrainLoRA node (node id) queued from one
// workflow (the frontend workflow's id, sent in the prompt's extra_pnginfo; see
// nodes/train_lora.py). Node ids repeat across workflows, so a panel shows a run only when
// its node id matches and the run belongs to the workflow on the canvas:
// - a run with a workflow id is shown only in that workflow;
// - a run without one (queued through the bare HTTP API, or from a graph whose id is the
//   zero uuid: the frontend gives an opened API-format graph no id) is "unclaimed": it is shown
//   on a node with its node id in any workflow that has no run of its own for that node.
// Among a panel's runs it shows the running one, else the next queued one, else the latest.

export const ZERO_UUID = "00000000-0000-0000-0000-000000000000";
export const ENDED = ["finished", "cancelled", "error"];

// The workflow id runs are matched on: null for none and for the zero uuid.
export function workflowKey(id) {
  return id && String(id) !== ZERO_UUID ? String(id) : null;
}

export class RunStore {
  constructor() {
    this.runs = new Map(); // key (prompt id and node) -> run, in the order first seen
    this.started = 0; // counts runs as they start: the latest started run has the highest
    this.fromCache = new Set(); // keys of runs ComfyUI answered from its cache (never queued again)
  }

  static key(promptId, node) {
    return `${promptId}|${node}`;
  }

  get(promptId, node) {
    return this.runs.get(RunStore.key(promptId, String(node)));
  }

  // A run seen in ComfyUI's queue before its first progress event: shown as "queued".
  addQueued(promptId, node, workflowId, loraName) {
    const key = RunStore.key(promptId, String(node));
    if (this.runs.has(key)) return this.runs.get(key);
    if (this.fromCache.has(key)) return null; // it did not run: the shown run carries the note
    const run = {
      promptId,
      node: String(node),
      workflowId: workflowKey(workflowId),
      status: "queued",
      progress: { status: "queued", step: 0, total: 0, lora_name: loraName, previews: [] },
      losses: [],
      validation: [], // [step, loss] of the held-out evaluations, in step order
      queued: true, // no progress event yet
      order: 0,
    };
    this.runs.set(key, run);
    return run;
  }

  // Queued runs whose prompt left the queue without ever starting (deleted, or an earlier node
  // failed): forget them, so the panel goes back to the run it showed before.
  dropQueuedExcept(promptIdsInQueue) {
    for (const [key, run] of this.runs) {
      if (run.queued && !promptIdsInQueue.has(run.promptId)) this.runs.delete(key);
    }
  }

  // A progress event (or the progress route's state). Returns the run; `run.missing` says
  // whether losses between two (throttled) events are still to be fetched; `run.validationStale`
  // that a validation point not seen before came (the ones between two events are then fetched
  // too; the fetch clears it).
  applyProgress(payload) {
    const run = this.addQueued(payload.prompt_id, payload.node, payload.workflow_id, payload.lora_name);
    if (run.queued) this.start(run);
    run.progress = { ...payload, previews: payload.previews ?? [] };
    run.status = payload.status;
    if (payload.loss != null && payload.step === run.losses.length + 1) run.losses.push(payload.loss);
    run.missing = payload.step > run.losses.length;
    if (payload.validation_step != null) {
      const added = this.addValidation(run, [[payload.validation_step, payload.validation_loss]]);
      run.validationStale = run.validationStale || added;
    }
    return run;
  }

  // Validation points (from an event or the route); a point of a step already known replaces
  // it. Returns whether a new step came.
  addValidation(run, points) {
    const byStep = new Map(run.validation);
    const known = byStep.size;
    for (const [step, loss] of points ?? []) byStep.set(Number(step), loss);
    run.validation = [...byStep].sort((a, b) => a[0] - b[0]);
    return byStep.size > known;
  }

  // A TrainLoRA that failed before it could send anything (e.g. it refused to overwrite a LoRA).
  applyError(promptId, node, message) {
    const run = this.get(promptId, node);
    if (!run || !run.queued) return null;
    this.start(run);
    run.status = "error";
    run.progress = { ...run.progress, status: "error", message };
    return run;
  }

  // ComfyUI ran the prompt from its cache: TrainLoRA `node` had nothing new to train (same
  // settings, dataset and model since its last run, whose LoRA is still there). The queued run
  // goes and the run shown before keeps its chart, with `note` on top of its message; with no
  // run shown before (a page opened after it), a finished entry carries the note alone.
  applyCached(promptId, node, workflowId, note) {
    node = String(node);
    const key = RunStore.key(promptId, node);
    const queued = this.get(promptId, node);
    if (queued?.queued) this.runs.delete(key);
    let run = this.runFor(node, workflowId);
    if (!run || run.queued) {
      run = this.addQueued(promptId, node, workflowId, queued?.progress.lora_name);
      this.start(run);
      run.status = "finished";
      run.progress = { ...run.progress, status: "finished", message: "" };
    }
    run.cachedNote = note;
    this.fromCache.add(key); // a /queue answer older than this may still list it: not queued again
    return run;
  }

  // Losses from the route, `from` being the index of the first one.
  setLosses(run, from, losses) {
    if (from > run.losses.length) return;
    run.losses.length = from;
    for (let i = 0; i < losses.length; i++) run.losses.push(losses[i]); // no spread: may be huge
    run.missing = (run.progress.step ?? 0) > run.losses.length;
  }

  start(run) {
    run.queued = false;
    run.cachedNote = "";
    run.order = ++this.started;
    // an earlier run of this node in this workflow can never be shown again: free its losses
    for (const [key, other] of this.runs) {
      if (other !== run && !other.queued && other.node === run.node && other.workflowId === run.workflowId) {
        this.runs.delete(key);
      }
    }
  }

  // The run the panel of node `node` shows while workflow `workflowId` is on the canvas.
  runFor(node, workflowId) {
    const key = workflowKey(workflowId);
    const mine = [...this.runs.values()].filter((run) => run.node === String(node));
    const claimed = key === null ? [] : mine.filter((run) => run.workflowId === key);
    const shown = claimed.length ? claimed : mine.filter((run) => run.workflowId === null);
    const running = shown.find((run) => !run.queued && !ENDED.includes(run.status));
    const next = shown.find((run) => run.queued); // the first queued runs first
    const latest = shown.filter((run) => !run.queued).sort((a, b) => b.order - a.order)[0];
    return running ?? next ?? latest ?? null;
  }
}
