// Kontext Trainer: file lists current after a training run. A run saves a LoRA (stock
// LoraLoader's `lora_name`, TrainLoRA's `start_from_lora`) or a checkpoint to resume from
// (TrainLoRA's `resume_from`); the server lists it at once, but a combo on the canvas keeps the
// list it was created with until the user refreshes the node definitions (`r`). When a
// training prompt ends, the panel calls `refreshComboLists`: the definitions of the node classes
// on the canvas that have combos come fresh from `GET /object_info/<class>`, and every such
// combo takes its new list, the way the frontend's own refresh does, without its toasts. A
// selected value stays selected.
const { app } = window.comfyAPI.app;
const { api } = window.comfyAPI.api;

// Every node on the canvas, those inside subgraphs too.
function allNodes() {
  const root = app.rootGraph ?? app.graph;
  const graphs = [root, ...(root?.subgraphs?.values?.() ?? [])];
  return graphs.flatMap((graph) => graph?.nodes ?? graph?._nodes ?? []);
}

// The choices of a combo input spec: V1 `[[...choices], options]`, V2 `["COMBO", {options}]`.
function choicesOf(spec) {
  if (!Array.isArray(spec)) return null;
  if (Array.isArray(spec[0])) return spec[0];
  return spec[0] === "COMBO" && Array.isArray(spec[1]?.options) ? spec[1].options : null;
}

async function definition(nodeClass) {
  const response = await api.fetchApi(`/object_info/${encodeURIComponent(nodeClass)}`);
  return response.ok ? (await response.json())[nodeClass] : undefined;
}

export async function refreshComboLists() {
  const combos = allNodes().filter((node) => node.widgets?.some((widget) => widget.type === "combo"));
  const classes = [...new Set(combos.map((node) => node.comfyClass ?? node.type))];
  const definitions = Object.fromEntries(
    await Promise.all(classes.map(async (nodeClass) => [nodeClass, await definition(nodeClass)])),
  );
  for (const node of combos) {
    const inputs = definitions[node.comfyClass ?? node.type]?.input ?? {};
    for (const widget of node.widgets) {
      if (widget.type !== "combo") continue;
      const choices = choicesOf(inputs.required?.[widget.name] ?? inputs.optional?.[widget.name]);
      if (choices) widget.options.values = choices; // the widget's value is left as it is
    }
  }
  app.graph?.setDirtyCanvas?.(true, true);
}
