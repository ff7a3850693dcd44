// Kontext Trainer: the pack's examples open at the view they were saved with, however they are
// opened. Frontend 1.49 (ComfyUI 0.33) fits a graph opened from the template browser to the
// window and ignores its saved view; for our training graphs that fit is below the zoom at
// which the canvas draws node text (about 57 %): on a 1920 x 937 page five of seven examples
// opened as blank boxes, their note included (issue 45). A file opened or dropped keeps its
// saved view already. An example carries `extra.kontext_trainer_example` (written by
// scripts/export_ui_workflows.py); once the frontend has laid out such a graph, its saved view
// is applied, unless the user turned off "Save and restore canvas position and zoom level".
// And the pack's cards in the template browser start with the starter example (issue 64): ComfyUI
// lists a pack's example_workflows/ in the order its file system returns them (`glob`), which
// both frontends keep, so kontext_lora_training came 7th of 13.
const { app } = window.comfyAPI.app;
const { api } = window.comfyAPI.api;

const MARK = "kontext_trainer_example";
const VIEW_RESTORE = "Comfy.EnableWorkflowViewRestore";
const FIRST_CARDS = ["kontext_lora_training", "kontext_lora_inference"]; // then by name
// the key /workflow_templates lists the pack under: its folder, as in this file's address
// (/extensions/<folder>/js/example_view.js)
const PACK = decodeURIComponent(new URL(import.meta.url).pathname.split("/")[2]);

function starterFirst(names) {
  const rank = (name) => (FIRST_CARDS.includes(name) ? FIRST_CARDS.indexOf(name) : FIRST_CARDS.length);
  return [...names].sort((a, b) => rank(a) - rank(b) || a.localeCompare(b));
}

// Both frontends ask once, when the template browser first opens: before that, this module has run.
const listTemplates = api.getWorkflowTemplates.bind(api);
api.getWorkflowTemplates = async () => {
  const templates = await listTemplates();
  if (Array.isArray(templates?.[PACK])) templates[PACK] = starterFirst(templates[PACK]);
  return templates;
};

function viewRestoreOn() {
  const settings = app.extensionManager?.setting;
  const value = settings?.get ? settings.get(VIEW_RESTORE) : app.ui?.settings?.getSettingValue?.(VIEW_RESTORE);
  return value !== false;
}

function applySavedView() {
  const ds = app.graph?.extra?.ds;
  const canvas = app.canvas;
  if (!canvas || !Array.isArray(ds?.offset) || !(ds.scale > 0)) return;
  canvas.ds.scale = ds.scale;
  canvas.ds.offset = [ds.offset[0], ds.offset[1]];
  canvas.setDirty(true, true);
}

app.registerExtension({
  name: "KontextTrainer.ExampleView",
  afterConfigureGraph() {
    if (!app.graph?.extra?.[MARK] || !viewRestoreOn()) return;
    applySavedView();
    // where the canvas had no size yet, the frontend fits on the next frame: after that one
    requestAnimationFrame(() => requestAnimationFrame(applySavedView));
  },
});
