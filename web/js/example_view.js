// Kontext Trainer: the pack's examples open at the view they were saved with, however they are
// opened. Frontend 1.49 (ComfyUI 0.33) fits a graph opened from the template browser to the
// window and ignores its saved view; for our training graphs that fit is below the zoom at
// which the canvas draws node text (about 57 %): on a 1920 x 937 page five of seven examples
// opened as blank boxes, their note included (issue 45). A file opened or dropped keeps its
// saved view already. An example carries `extra.kontext_trainer_example` (written by
// scripts/export_ui_workflows.py); once the frontend has laid out such a graph, its saved view
// is applied, unless the user turned off "Save and restore canvas position and zoom level".
const { app } = window.comfyAPI.app;

const MARK = "kontext_trainer_example";
const VIEW_RESTORE = "Comfy.EnableWorkflowViewRestore";

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
