// Kontext Trainer: TrainLoRA shows its essential settings; the others are "advanced" and wait
// behind the node's own "Show Advanced" / "Hide Advanced" (right-click menu). The server marks
// them (`advanced: true` in the input spec) and the frontend copies that onto each widget's
// options, but its canvas reads the flag from the widget itself: copy it there. The canvas
// (frontends 1.32 and 1.49 alike) skips a hidden advanced widget when it draws, yet still gives
// it a row when it lays the node out, so the node held a blank gap per hidden widget and the
// live panel sat a screen below the title. A hidden row gets the size core's group nodes give
// their hidden widgets, [0, -4] (the canvas adds 4 px per row), and the node fits its shown
// widgets, also after "Show / Hide Advanced". Values of hidden widgets still save and run.
// Each widget also has an input slot, laid out at its row: a hidden row's slot sat on the next
// shown row's label, and the frontend hit-tests input slots before widgets, so hovering the
// label of `rank` showed the tooltip of the hidden `gradient_accumulation` (issue 45, both
// frontends). While hidden, a widget reports a row far above the node: its slot lies there.
const { app } = window.comfyAPI.app;

const NODE_CLASS = "KontextTrainer_TrainLoRA";
const NO_ROW = [0, -4];
const FAR_ABOVE = -1e6; // a hidden widget's row, for its input slot (graph units above the node)

function takeNoRowWhileHidden(node, widget) {
  const own = widget.computeSize; // undefined for the stock widgets: one standard row
  widget.computeSize = function (width) {
    if (!node.isWidgetVisible(this)) return NO_ROW;
    return own ? own.call(this, width) : [width ?? node.size[0], window.LiteGraph.NODE_WIDGET_HEIGHT];
  };
}

function keepSlotAwayWhileHidden(node, widget) {
  let y = widget.y ?? 0;
  Object.defineProperty(widget, "y", {
    configurable: true,
    enumerable: true,
    get() {
      return this.advanced && !node.showAdvanced ? FAR_ABOVE : y;
    },
    set(value) {
      y = value;
    },
  });
}

function fitHeight(node) {
  node.setSize([node.size[0], node.computeSize()[1]]);
  node.setDirtyCanvas?.(true, true);
}

app.registerExtension({
  name: "KontextTrainer.AdvancedWidgets",
  nodeCreated(node) {
    if (node.comfyClass !== NODE_CLASS) return;
    const advanced = (node.widgets ?? []).filter((widget) => widget.options?.advanced);
    if (!advanced.length) return;
    for (const widget of advanced) {
      widget.advanced = true;
      takeNoRowWhileHidden(node, widget);
      keepSlotAwayWhileHidden(node, widget);
    }
    const onConfigure = node.onConfigure;
    node.onConfigure = function () {
      const result = onConfigure?.apply(this, arguments);
      // a saved size too small for the shown widgets (the examples save 460 x 498) grows now,
      // not while the canvas draws the node's first frame
      if (this.size[1] < this.computeSize()[1]) fitHeight(this);
      return result;
    };
    const toggleAdvanced = node.toggleAdvanced;
    node.toggleAdvanced = function () {
      const result = toggleAdvanced.apply(this, arguments);
      fitHeight(this); // the frontend only grows a node here: shrink it back on "Hide"
      return result;
    };
    fitHeight(node);
  },
});
