"""A training workflow <-> a run config (`trainer_core.run_config`): the graph and the config
file are two doors to one run, and each converts into the other.

`config_from_workflow` reads a workflow holding a TrainLoRA (an API prompt, or a UI workflow as
the frontend saves it) into a RunConfig; `workflow_from_config` writes the API prompt that
trains that run in the graph. A config holds exactly five nodes: UNETLoader -> TrainLoRA.model,
LoadKontextDataset -> TrainLoRA.dataset, VAELoader and CLIPLoader / DualCLIPLoader -> the
dataset's vae and clip. TrainLoRA's `preview` link is ignored: headless runs draw no previews.
Nodes inside subgraphs are not read. Runs with ComfyUI booted (the stock loaders' widgets come
from ComfyUI's own classes).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import Any

from ..comfy_adapter.comfy_registry import node_class
from ..trainer_core.choices import plain
from ..trainer_core.run_config import CHECKPOINTS, RunConfig, parse_run_config
from .node_ids import node_id as prefixed_id

TRAIN = prefixed_id("TrainLoRA")
DATASET = prefixed_id("LoadKontextDataset")
WIDGET_KINDS = ("INT", "FLOAT", "STRING", "BOOLEAN", "COMBO")
MUTED, BYPASSED = 2, 4  # UI node modes that do not run
# (source node types, what of it the config holds), per input followed
FEEDS = {
    "model": (("UNETLoader",), "a UNETLoader ([model] diffusion_model, weight_dtype)"),
    "dataset": ((DATASET,), "a LoadKontextDataset ([dataset])"),
    "vae": (("VAELoader",), "a VAELoader ([model] vae)"),
    "clip": (("CLIPLoader", "DualCLIPLoader"), "a CLIPLoader or DualCLIPLoader ([model] text_encoders...)"),
}


@dataclass(frozen=True)
class Link:
    node: str
    slot: int


@dataclass
class GraphNode:
    id: str
    class_type: str
    links: dict[str, Link]  # input name -> the output feeding it
    values: dict[str, Any] | None  # API prompt: widget values by name
    widgets_values: list | dict | None  # UI workflow: widget values by position
    mode: int = 0

    def __str__(self) -> str:
        return f"node {self.id} ({self.class_type})"


@dataclass(frozen=True)
class WidgetSpec:
    name: str
    kind: str
    trailing: int  # values the frontend saves after this one (its control_after_generate widgets)


def widget_specs(cls: type) -> list[WidgetSpec]:
    """The widgets of a node class in the order the frontend creates them (the order of a UI
    workflow's `widgets_values`): a V3 node's schema order (optional widgets sit among the
    others), a V1 node's required then optional inputs. Link-type inputs are skipped."""
    if hasattr(cls, "define_schema"):
        entries = [(i.id, i.get_io_type(), i.as_dict()) for i in cls.define_schema().inputs]
    else:
        declared = cls.INPUT_TYPES()
        entries = [
            (name, spec[0], spec[1] if len(spec) > 1 else {})
            for part in ("required", "optional")
            for name, spec in declared.get(part, {}).items()
        ]
    specs = []
    for name, kind, options in entries:
        kind = "COMBO" if isinstance(kind, list) else kind
        if kind not in WIDGET_KINDS or options.get("forceInput"):
            continue
        # the frontend adds a "control after generate" combo after such INTs (seeds by name
        # unless told), and after a combo that asks for one also a filter-list text widget
        control = options.get("control_after_generate", kind == "INT" and name in ("seed", "noise_seed"))
        specs.append(WidgetSpec(name, kind, (1 if kind == "INT" else 2) if control else 0))
    return specs


def ui_widget_values(cls: type, saved: list | dict) -> dict[str, Any]:
    """A UI node's `widgets_values` by widget name. Widgets a workflow saved before they existed
    are left out (they take their defaults), as are values past the last widget. TrainLoRA's panel
    of earlier versions saved one more value, an empty string, last: where it lands on a widget
    that is not text, it is not a value (web/js/saved_widget_values.js does the same)."""
    if isinstance(saved, dict):
        return dict(saved)
    values, position = {}, 0
    specs = widget_specs(cls)
    for spec in specs:
        if position >= len(saved):
            break
        is_last = position == len(saved) - 1
        if is_last and saved[position] == "" and spec.kind != "STRING":
            break
        values[spec.name] = saved[position]
        position += 1 + spec.trailing
    return values


def read_workflow(path: Path) -> dict:
    """A workflow file's JSON (`read_graph` reads its nodes); a file that is not one is a
    ValueError naming it, what is wrong and how to get one."""
    export = "export the workflow from ComfyUI with Workflow > Export, or Export (API), and give that file"
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as error:
        raise ValueError(f"{path}: cannot read the workflow ({error.strerror})") from None
    except UnicodeDecodeError:
        raise ValueError(f"{path}: not a JSON workflow (not UTF-8 text); {export}") from None
    except json.JSONDecodeError as error:
        where = f"line {error.lineno}, column {error.colno}"
        raise ValueError(f"{path}: {where}: not a JSON workflow ({error.msg}); {export}") from None


def read_graph(data: dict) -> dict[str, GraphNode]:
    """The nodes of an API prompt or of a UI workflow (links as lists or as objects)."""
    if not isinstance(data, dict):
        raise ValueError("a workflow is a JSON object (an API prompt or a saved UI workflow)")
    if isinstance(data.get("nodes"), list):
        return _read_ui(data)
    graph = {}
    for key, node in data.items():
        if not isinstance(node, dict) or "class_type" not in node:
            raise ValueError(
                f"'{key}' is not a node: this is neither an API prompt ({{id: {{class_type, inputs}}}}) "
                "nor a UI workflow (nodes, links); save the workflow from ComfyUI's menu"
            )
        inputs = node.get("inputs", {})
        links = {k: Link(str(v[0]), int(v[1])) for k, v in inputs.items() if _is_link(v)}
        values = {k: v for k, v in inputs.items() if k not in links}
        graph[str(key)] = GraphNode(str(key), node["class_type"], links, values, None)
    return graph


def _is_link(value) -> bool:
    return isinstance(value, list) and len(value) == 2 and isinstance(value[1], int)


def _read_ui(data: dict) -> dict[str, GraphNode]:
    origins = {}
    for link in data.get("links") or []:
        if isinstance(link, dict):
            origins[link["id"]] = Link(str(link["origin_id"]), int(link["origin_slot"]))
        else:  # [id, origin_id, origin_slot, target_id, target_slot, type]
            origins[link[0]] = Link(str(link[1]), int(link[2]))
    types = {str(n["id"]): n["type"] for n in data["nodes"]}
    graph = {}
    for node in data["nodes"]:
        links = {}
        for slot in node.get("inputs") or []:
            if slot.get("link") is None or slot["link"] not in origins:
                continue
            link = origins[slot["link"]]
            # a widget turned into an input keeps its value in widgets_values when a frontend-only
            # PrimitiveNode feeds it (the API prompt holds that value, not a link)
            if "widget" in slot and types.get(link.node) == "PrimitiveNode":
                continue
            links[slot.get("widget", {}).get("name", slot["name"])] = link
        saved = node.get("widgets_values") or []
        graph[str(node["id"])] = GraphNode(
            str(node["id"]), node["type"], links, None, saved, node.get("mode", 0)
        )
    return graph


def node_values(node: GraphNode) -> dict[str, Any]:
    """A node's widget values by name; refuses a widget fed by another node's output (a config
    holds values, not computations)."""
    cls = node_class(node.class_type)
    values = node.values if node.values is not None else ui_widget_values(cls, node.widgets_values)
    widgets = {spec.name for spec in widget_specs(cls)}
    fed = sorted(widgets & set(node.links))
    if fed:
        raise ValueError(
            f"{node}: its {fed[0]} comes from node {node.links[fed[0]].node}; a run config holds values "
            f"only: set {fed[0]} on the widget itself"
        )
    return values


def config_from_workflow(data: dict, base_directory: Path, node_id: str | None = None) -> RunConfig:
    """The run a workflow's TrainLoRA trains (`node_id` picks one where there are several), with
    `base_directory` as its ComfyUI base directory. The TrainLoRA's preview link is ignored
    (headless runs have no previews); any other node between the five a config holds is refused
    with a message naming it."""
    graph = read_graph(data)
    train = _pick_train(graph, node_id)
    model = _feeding(graph, train, "model")
    dataset = _feeding(graph, train, "dataset")
    vae, clip = _feeding(graph, dataset, "vae"), _feeding(graph, dataset, "clip")
    unet, clip_values = node_values(model), node_values(clip)
    encoders = (
        [clip_values.get("clip_name")]
        if clip.class_type == "CLIPLoader"
        else [clip_values.get("clip_name1"), clip_values.get("clip_name2")]
    )
    files = {
        "diffusion_model": unet.get("unet_name"),
        "weight_dtype": unet.get("weight_dtype"),
        "vae": node_values(vae).get("vae_name"),
        "text_encoders": encoders,
        "clip_type": clip_values.get("type"),
        "clip_device": clip_values.get("device"),
    }
    config = {
        "comfyui": {"base_directory": str(base_directory)},
        # a value the workflow lacks is left out: a default, or a message naming the key
        "model": {
            k: v for k, v in files.items() if v is not None and not (isinstance(v, list) and None in v)
        },
        "dataset": node_values(dataset),
        "train": node_values(train),
    }
    return parse_run_config(config, f"the workflow's {train}", Path.cwd())


def _pick_train(graph: dict[str, GraphNode], chosen: str | None) -> GraphNode:
    found = [n for n in graph.values() if n.class_type == TRAIN]
    listed = ", ".join(n.id for n in found)
    if chosen is not None:
        node = graph.get(str(chosen))
        if node is None or node.class_type != TRAIN:
            raise ValueError(
                f"node {chosen} is not a TrainLoRA; the workflow's TrainLoRA nodes: {listed or 'none'}"
            )
        return node
    running = [n for n in found if n.mode not in (MUTED, BYPASSED)]
    if not running:
        why = " that runs (every one is muted or bypassed)" if found else ""
        raise ValueError(f"the workflow has no TrainLoRA node ({TRAIN}){why}; nothing to train")
    if len(running) > 1:
        ids = ", ".join(n.id for n in running)
        raise ValueError(f"the workflow has {len(running)} TrainLoRA nodes ({ids}); pick one by its node id")
    return running[0]


def _feeding(graph: dict[str, GraphNode], node: GraphNode, name: str) -> GraphNode:
    """The node whose output feeds `node`'s input `name`: one of the types a config holds."""
    expected, holds = FEEDS[name]
    link = node.links.get(name)
    while link is not None and graph.get(link.node) and graph[link.node].class_type == "Reroute":
        link = next(iter(graph[link.node].links.values()), None)  # a UI Reroute only passes it on
    if link is None or link.node not in graph:
        raise ValueError(f"{node}: {name} is not connected; connect {holds}")
    source = graph[link.node]
    if source.class_type not in expected:
        raise ValueError(
            f"{node}: its {name} comes from {source}, which a run config cannot hold; it holds {holds} "
            f"feeding {name} directly. Remove {source.class_type} (or train this workflow in the graph)"
        )
    if source.mode in (MUTED, BYPASSED):
        raise ValueError(f"{source} is muted or bypassed; turn it back on (mode Always)")
    return source


def workflow_from_config(config: RunConfig) -> dict:
    """The API prompt that trains `config`'s run in the graph: the three stock loaders,
    LoadKontextDataset and TrainLoRA, with every value. Models and checkpoints must be named
    as the loaders list them (absolute paths cannot go into a workflow)."""
    _check_for_workflow(config)
    model = config.model
    encoders = model.text_encoders
    clip = (
        {"class_type": "CLIPLoader", "inputs": {"clip_name": encoders[0]}}
        if len(encoders) == 1
        else {
            "class_type": "DualCLIPLoader",
            "inputs": {"clip_name1": encoders[0], "clip_name2": encoders[1]},
        }
    )
    clip["inputs"] |= {"type": model.clip_type, "device": model.clip_device}
    return {
        "1": {
            "class_type": "UNETLoader",
            "inputs": {"unet_name": model.diffusion_model, "weight_dtype": model.weight_dtype},
        },
        "2": {"class_type": "VAELoader", "inputs": {"vae_name": model.vae}},
        "3": clip,
        "4": {
            "class_type": DATASET,
            "inputs": {"vae": ["2", 0], "clip": ["3", 0], **_values(config.dataset)},
        },
        "5": {
            "class_type": TRAIN,
            "inputs": {
                "model": ["1", 0],
                "dataset": ["4", 0],
                **_values(config.trainer),
                **_values(config.train),
            },
        },
    }


def _values(options) -> dict[str, Any]:
    return {f.name: plain(getattr(options, f.name)) for f in dataclasses.fields(options)}


def _check_for_workflow(config: RunConfig) -> None:
    names = [
        ("model", "diffusion_model", config.model.diffusion_model, "models/diffusion_models"),
        ("model", "vae", config.model.vae, "models/vae"),
        *(("model", "text_encoders", name, "models/text_encoders") for name in config.model.text_encoders),
        ("train", "start_from_lora", config.trainer.start_from_lora, "models/loras"),
        ("train", "resume_from", config.trainer.resume_from, CHECKPOINTS),
    ]
    for section, key, value, folder in names:
        if (
            value.startswith("~")
            or PurePosixPath(value).is_absolute()
            or PureWindowsPath(value).is_absolute()
        ):
            raise ValueError(
                f"[{section}] {key}: '{value}' is an absolute path, and a workflow names files as "
                f"ComfyUI lists them; put it in {folder} (under the ComfyUI base directory) and give "
                "its name there"
            )
    # the loaders' choices in this ComfyUI (file names may live on another machine: not checked)
    clip_loader = "CLIPLoader" if len(config.model.text_encoders) == 1 else "DualCLIPLoader"
    for key, loader, widget in (
        ("weight_dtype", "UNETLoader", "weight_dtype"),
        ("clip_type", clip_loader, "type"),
        ("clip_device", clip_loader, "device"),
    ):
        declared = node_class(loader).INPUT_TYPES()
        choices = {**declared.get("required", {}), **declared.get("optional", {})}[widget][0]
        if getattr(config.model, key) not in choices:
            raise ValueError(
                f"[model] {key}: '{getattr(config.model, key)}' is not a {widget} of {loader}; "
                f"choose one of {', '.join(map(str, choices))}"
            )
