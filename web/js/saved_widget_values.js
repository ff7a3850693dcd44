// Kontext Trainer: TrainLoRA workflows saved by an earlier version load with every value in
// place. The frontend restores widget values by position; widgets added to TrainLoRA later sit
// after the older ones (after `overwrite`), so an older file fills the older widgets and leaves
// the newer ones alone — except for the value the node's panel saved last (an empty string),
// which lands on the first newer widget. That value is never a valid one for a newer widget
// (numbers and lists): where one arrived, it and every widget after it go back to the default.
const { app } = window.comfyAPI.app;

const NODE_CLASS = "KontextTrainer_TrainLoRA";

function inputDefaults(nodeData) {
  const specs = { ...(nodeData.input?.required ?? {}), ...(nodeData.input?.optional ?? {}) };
  return Object.fromEntries(
    Object.entries(specs)
      .filter(([, spec]) => spec?.[1] && "default" in spec[1])
      .map(([name, spec]) => [name, spec[1].default]),
  );
}

app.registerExtension({
  name: "KontextTrainer.SavedWidgetValues",
  beforeRegisterNodeDef(nodeType, nodeData) {
    if (nodeData.name !== NODE_CLASS) return;
    const defaults = inputDefaults(nodeData);
    const onConfigure = nodeType.prototype.onConfigure;
    nodeType.prototype.onConfigure = function (info) {
      const result = onConfigure?.apply(this, arguments);
      const saved = info?.widgets_values;
      if (Array.isArray(saved) && saved.at(-1) === "") {
        const widgets = (this.widgets ?? []).filter((w) => w.serialize !== false);
        const landed = widgets[saved.length - 1];
        if (landed && landed.type !== "text" && landed.type !== "customtext" && landed.name in defaults) {
          for (const widget of widgets.slice(saved.length - 1)) {
            if (widget.name in defaults) widget.value = defaults[widget.name];
          }
        }
      }
      return result;
    };
  },
});
