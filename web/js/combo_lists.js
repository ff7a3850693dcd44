// Kontext Trainer: file lists current after a training run. A run saves a LoRA (stock
// LoraLoader's `lora_name`, TrainLoRA's `start_from_lora`) or a checkpoint to resume from
// (TrainLoRA's `resume_from`); the server lists it at once, but a combo on the canvas keeps the
// list it was created with until the user refreshes the node definitions (`r`). When a
// training prompt ends, the panel calls `refreshComboLists`: the definitions of the node classes
// on the canvas that have combos come fresh from `GET /object_info/<class>`, and every such
// combo takes its new list, the way the frontend's own refresh does, without its toasts. A
// selected value stays selected. A node created after that (added by the user, or from a workflow
// opened later) would get the list the page loaded with: once a run has ended, each new node with
// combos takes its class's current lists too (one request per class per run end).
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

// The definitions fetched since the last run ended, by node class (promises, shared by nodes).
let current = null;

function currentDefinition(nodeClass) {
  if (!current.has(nodeClass)) current.set(nodeClass, definition(nodeClass));
  return current.get(nodeClass);
}

function classOf(node) {
  return node.comfyClass ?? node.type;
}

function hasCombos(node) {
  return node.widgets?.some((widget) => widget.type === "combo");
}

function giveLists(node, nodeDefinition) {
  const inputs = nodeDefinition?.input ?? {};
  for (const widget of node.widgets ?? []) {
    if (widget.type !== "combo") continue;
    const choices = choicesOf(inputs.required?.[widget.name] ?? inputs.optional?.[widget.name]);
    if (choices) widget.options.values = choices; // the widget's value is left as it is
  }
}

export async function refreshComboLists() {
  current = new Map();
  const combos = allNodes().filter(hasCombos);
  const definitions = await Promise.all(combos.map((node) => currentDefinition(classOf(node))));
  combos.forEach((node, index) => giveLists(node, definitions[index]));
  app.graph?.setDirtyCanvas?.(true, true);
}

app.registerExtension({
  name: "KontextTrainer.ComboLists",
  nodeCreated(node) {
    if (current === null || !hasCombos(node)) return; // no run ended: the page's lists are current
    currentDefinition(classOf(node))
      .then((nodeDefinition) => {
        giveLists(node, nodeDefinition);
        app.graph?.setDirtyCanvas?.(true, true);
      })
      .catch(() => {}); // the server is unreachable: the node keeps the page's lists
  },
});
