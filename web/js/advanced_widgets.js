// Kontext Trainer: TrainLoRA shows its essential settings; the others are "advanced" and wait
// behind the node's own "Show Advanced" / "Hide Advanced" (right-click menu). The server marks
// them (`advanced: true` in the input spec) and the frontend copies that onto each widget's
// options, but its canvas reads the flag from the widget itself: copy it there, then fit the
// node to the widgets it shows. Values of hidden widgets still save and run.
const { app } = window.comfyAPI.app;

const NODE_CLASS = "KontextTrainer_TrainLoRA";

app.registerExtension({
  name: "KontextTrainer.AdvancedWidgets",
  nodeCreated(node) {
    if (node.comfyClass !== NODE_CLASS) return;
    let marked = false;
    for (const widget of node.widgets ?? []) {
      if (widget.options?.advanced && !widget.advanced) {
        widget.advanced = true;
        marked = true;
      }
    }
    if (marked) node.setSize([node.size[0], node.computeSize()[1]]);
  },
});
