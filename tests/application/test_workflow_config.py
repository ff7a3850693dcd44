"""Workflow <-> run config in the real runtime: every saved training workflow (UI and API, old
and current) reads into a config, and the config writes back a prompt with every value of the
five nodes it holds; what a config cannot hold is refused by name; LoadKontextDataset's widgets
generated from DatasetOptions are the ones it always had."""

from __future__ import annotations

import copy
import dataclasses
import json
import uuid
from pathlib import Path

import pytest

from kt_testing.comfy_runtime import run_sync

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "example_workflows"
E2E_DATA = REPO / "tests" / "e2e" / "data"
SAVED_BY_70ADB75 = REPO / "tests" / "nodes" / "data" / "written_by_70adb75" / "workflows"
TRAIN, DATASET = "KontextTrainer_TrainLoRA", "KontextTrainer_LoadKontextDataset"
# every saved UI workflow with its API twin: the shipped examples, the workflows saved before
# widgets were added (CHANGELOG.md) and the examples as 70adb75 saved them
PAIRS = [(p, EXAMPLES / "api" / p.name) for p in sorted(EXAMPLES.glob("*.json"))] + [
    (p, p.with_name(p.stem + "_api.json"))
    for folder in (E2E_DATA, SAVED_BY_70ADB75)
    for p in sorted(folder.glob("*.json"))
    if "_api" not in p.stem
]


def read(path: Path) -> dict:
    return json.loads(path.read_text())


@pytest.fixture(scope="module")
def wc(pack_import):
    return pack_import("application.workflow_config")


@pytest.fixture(scope="module")
def rc(pack_import):
    return pack_import("trainer_core.run_config")


def is_link(value) -> bool:
    return isinstance(value, list) and len(value) == 2


def five_nodes(prompt: dict) -> dict[str, dict]:
    """role -> the API node, found by following TrainLoRA's links (independently of the code
    under test)."""
    train = next(node for node in prompt.values() if node["class_type"] == TRAIN)
    dataset = prompt[train["inputs"]["dataset"][0]]
    return {
        "train": train,
        "model": prompt[train["inputs"]["model"][0]],
        "dataset": dataset,
        "vae": prompt[dataset["inputs"]["vae"][0]],
        "clip": prompt[dataset["inputs"]["clip"][0]],
    }


def declared_widgets(comfy_runtime, class_type: str) -> dict:
    """name -> options of every widget input, from ComfyUI's own view of the class."""
    declared = comfy_runtime.nodes.NODE_CLASS_MAPPINGS[class_type].INPUT_TYPES()
    specs = {**declared["required"], **declared.get("optional", {})}
    return {
        name: spec[1] if len(spec) > 1 else {}
        for name, spec in specs.items()
        if isinstance(spec[0], list) or spec[0] in ("INT", "FLOAT", "STRING", "BOOLEAN", "COMBO")
    }


def assert_same_run(comfy_runtime, written: dict, original: dict) -> None:
    """`written` holds every value of the five nodes of `original`; widgets `original` predates
    hold their declared defaults; links join the same roles; the preview is not carried."""
    ours, theirs = five_nodes(written), five_nodes(original)
    for role, node in theirs.items():
        assert ours[role]["class_type"] == node["class_type"], role
        values = {k: v for k, v in ours[role]["inputs"].items() if not is_link(v)}
        widgets = declared_widgets(comfy_runtime, node["class_type"])
        assert set(values) == set(widgets), role  # every widget, nothing else
        for name, value in node["inputs"].items():
            if not is_link(value):
                assert (type(values[name]), values[name]) == (type(value), value), (role, name)
        for name in set(widgets) - set(node["inputs"]):
            assert values[name] == widgets[name]["default"], (role, name)
    assert "preview" in theirs["train"]["inputs"] and "preview" not in ours["train"]["inputs"]


def trains(prompt: dict) -> bool:
    return any(node["class_type"] == TRAIN for node in prompt.values())


@pytest.mark.parametrize(("ui", "api"), PAIRS, ids=[f"{p.parent.name}/{p.stem}" for p, _ in PAIRS])
def test_every_saved_workflow_reads_and_writes_back_the_same_run(comfy_runtime, wc, rc, tmp_path, ui, api):
    base = comfy_runtime.base_dir
    if not trains(read(api)):
        for source in (ui, api):
            with pytest.raises(ValueError, match="the workflow has no TrainLoRA node"):
                wc.config_from_workflow(read(source), base)
        return
    config = wc.config_from_workflow(read(api), base)
    assert wc.config_from_workflow(read(ui), base) == config  # UI widgets by position = API by name
    assert config.base_directory == base
    assert_same_run(comfy_runtime, wc.workflow_from_config(config), read(api))
    # and through the TOML file
    path = tmp_path / "run.toml"
    path.write_text(rc.dump_run_config(config), encoding="utf-8")
    assert rc.load_run_config(path) == config


def test_ui_links_saved_as_objects_read_the_same(comfy_runtime, wc):
    ui = read(EXAMPLES / "kontext_lora_training.json")
    objects = copy.deepcopy(ui)
    keys = ("id", "origin_id", "origin_slot", "target_id", "target_slot", "type")
    objects["links"] = [dict(zip(keys, link, strict=True)) for link in ui["links"]]
    base = comfy_runtime.base_dir
    assert wc.config_from_workflow(objects, base) == wc.config_from_workflow(ui, base)


def test_two_text_encoders_are_a_dual_clip_loader(comfy_runtime, wc):
    prompt = read(EXAMPLES / "api" / "kontext_lora_training.json")
    dual = next(
        n
        for n in read(EXAMPLES / "api" / "multi_reference_dreamomni2.json").values()
        if n["class_type"] == "DualCLIPLoader"
    )
    clip_id = five_nodes(prompt)["dataset"]["inputs"]["clip"][0]
    prompt[clip_id] = dual
    config = wc.config_from_workflow(prompt, comfy_runtime.base_dir)
    assert config.model.text_encoders == [dual["inputs"]["clip_name1"], dual["inputs"]["clip_name2"]]
    assert config.model.clip_type == dual["inputs"]["type"]
    assert_same_run(comfy_runtime, wc.workflow_from_config(config), prompt)


def test_ui_widget_values_follow_the_frontends_order_for_every_saved_node(comfy_runtime, wc):
    """Every node of every saved UI workflow (stock ones too, e.g. KSampler with its seed's
    control value; the examples as 70adb75 saved them) reads as its API twin names it: each
    value lands on the widget it was saved for."""
    checked = 0
    for ui, api in PAIRS:
        twins = read(api)
        for node in read(ui)["nodes"]:
            if node["type"] in ("Note", "MarkdownNote"):  # drawn by the frontend, never sent
                continue
            expected = {k: v for k, v in twins[str(node["id"])]["inputs"].items() if not is_link(v)}
            cls = comfy_runtime.nodes.NODE_CLASS_MAPPINGS[node["type"]]
            assert wc.ui_widget_values(cls, node.get("widgets_values") or []) == expected, (
                ui.name,
                node["type"],
            )
            checked += "KSampler" == node["type"]
    assert checked  # the seed's control value was among them


def test_a_node_between_is_refused_by_name(comfy_runtime, wc):
    prompt = read(EXAMPLES / "api" / "kontext_lora_training.json")
    train = five_nodes(prompt)["train"]
    prompt["99"] = {
        "class_type": "LoraLoaderModelOnly",
        "inputs": {"model": train["inputs"]["model"], "lora_name": "x.safetensors", "strength_model": 1.0},
    }
    train["inputs"]["model"] = ["99", 0]
    with pytest.raises(ValueError) as caught:
        wc.config_from_workflow(prompt, comfy_runtime.base_dir)
    assert "its model comes from node 99 (LoraLoaderModelOnly)" in str(caught.value)
    assert "UNETLoader" in str(caught.value)
    # the same in a UI workflow: the link into TrainLoRA's model now starts at a LoRA loader
    ui = read(EXAMPLES / "kontext_lora_training.json")
    train_ui = next(n for n in ui["nodes"] if n["type"] == TRAIN)
    model_link = next(slot["link"] for slot in train_ui["inputs"] if slot["name"] == "model")
    link = next(link for link in ui["links"] if link[0] == model_link)
    ui["nodes"].append(
        {"id": 99, "type": "LoraLoaderModelOnly", "mode": 0, "inputs": [], "widgets_values": []}
    )
    link[1] = 99
    with pytest.raises(ValueError, match=r"model comes from node 99 \(LoraLoaderModelOnly\)"):
        wc.config_from_workflow(ui, comfy_runtime.base_dir)


def test_two_trainers_need_a_choice(comfy_runtime, wc):
    prompt = read(EXAMPLES / "api" / "kontext_lora_training.json")
    train_id = next(k for k, n in prompt.items() if n["class_type"] == TRAIN)
    prompt["50"] = copy.deepcopy(prompt[train_id])
    prompt["50"]["inputs"]["lora_name"] = "second"
    with pytest.raises(ValueError, match=rf"2 TrainLoRA nodes \({train_id}, 50\); pick one by its node id"):
        wc.config_from_workflow(prompt, comfy_runtime.base_dir)
    assert wc.config_from_workflow(prompt, comfy_runtime.base_dir, "50").trainer.lora_name == "second"
    with pytest.raises(ValueError, match="node 7 is not a TrainLoRA"):
        wc.config_from_workflow(prompt, comfy_runtime.base_dir, "7")


def test_a_widget_fed_by_another_node_is_refused(comfy_runtime, wc):
    prompt = read(EXAMPLES / "api" / "kontext_lora_training.json")
    five_nodes(prompt)["train"]["inputs"]["steps"] = ["1", 0]
    with pytest.raises(ValueError, match="its steps comes from node 1; a run config holds values only"):
        wc.config_from_workflow(prompt, comfy_runtime.base_dir)


def test_a_bad_value_in_a_workflow_is_named_like_in_a_file(comfy_runtime, wc):
    prompt = read(EXAMPLES / "api" / "kontext_lora_training.json")
    five_nodes(prompt)["train"]["inputs"]["steps"] = 0
    with pytest.raises(ValueError, match=r"\[train\] steps is 0; give a number from 1 to 1000000"):
        wc.config_from_workflow(prompt, comfy_runtime.base_dir)


@pytest.mark.parametrize(
    ("section", "key", "folder"),
    [
        ("model", "diffusion_model", "models/diffusion_models"),
        ("model", "vae", "models/vae"),
        ("model", "text_encoders", "models/text_encoders"),
        ("trainer", "start_from_lora", "models/loras"),
        ("trainer", "resume_from", "output/kontext_trainer_checkpoints"),
    ],
)
def test_absolute_paths_cannot_go_into_a_workflow(comfy_runtime, wc, section, key, folder):
    config = wc.config_from_workflow(
        read(EXAMPLES / "api" / "kontext_lora_training.json"), comfy_runtime.base_dir
    )
    absolute = "/data/models/file.safetensors"
    owner = getattr(config, section)
    config = dataclasses.replace(
        config,
        **{section: dataclasses.replace(owner, **{key: [absolute] if key == "text_encoders" else absolute})},
    )
    table = "model" if section == "model" else "train"
    with pytest.raises(ValueError) as caught:
        wc.workflow_from_config(config)
    assert str(caught.value).startswith(f"[{table}] {key}: '{absolute}' is an absolute path")
    assert f"put it in {folder}" in str(caught.value)


@pytest.mark.parametrize("encoders", [1, 2], ids=["CLIPLoader", "DualCLIPLoader"])
def test_a_written_workflow_passes_comfyuis_own_validation(comfy_runtime, wc, rc, encoders):
    import execution

    base = comfy_runtime.base_dir
    tag = f"kt-config-{uuid.uuid4().hex[:8]}"  # names no other test uses
    files = {
        "diffusion_models": f"{tag}-flux.safetensors",
        "vae": f"{tag}-ae.safetensors",
        "text_encoders": f"{tag}-clip.safetensors",
    }
    for folder, name in files.items():
        (base / "models" / folder).mkdir(parents=True, exist_ok=True)
        (base / "models" / folder / name).write_bytes(b"")
    (base / "input" / tag).mkdir(parents=True)
    config = rc.RunConfig(
        base_directory=base,
        model=rc.ModelFiles(
            diffusion_model=files["diffusion_models"],
            weight_dtype="fp8_e4m3fn",
            vae=files["vae"],
            text_encoders=[files["text_encoders"]] * encoders,
            clip_type="flux" if encoders == 2 else "stable_diffusion",
        ),
        dataset=rc.DatasetOptions(folder=tag, resolution=512),
        train=rc.TrainConfig(steps=7, optimizer="adafactor"),
    )
    prompt = wc.workflow_from_config(config)
    valid, error, outputs, node_errors = run_sync(execution.validate_prompt(str(uuid.uuid4()), prompt, None))
    assert (valid, error, node_errors) == (True, None, {})
    assert outputs == [next(k for k, n in prompt.items() if n["class_type"] == TRAIN)]


def test_a_loader_choice_this_comfyui_lacks_is_named(comfy_runtime, wc):
    config = wc.config_from_workflow(
        read(EXAMPLES / "api" / "kontext_lora_training.json"), comfy_runtime.base_dir
    )
    config.model.clip_type = "no_such_type"
    wrong = r"\[model\] clip_type: 'no_such_type' is not a type of (Dual)?CLIPLoader"
    with pytest.raises(ValueError, match=wrong):
        wc.workflow_from_config(config)


def test_trainer_options_are_trainloras_own_widgets(comfy_runtime, rc, pack_import):
    widgets = declared_widgets(comfy_runtime, TRAIN)
    rows = {row.name: row for row in pack_import("application.widget_schema").TRAIN_LORA}
    for option in dataclasses.fields(rc.TrainerOptions):
        assert widgets[option.name]["tooltip"] == rows[option.name].tooltip, option.name
        assert widgets[option.name]["default"] == option.default, option.name
    assert set(widgets) == {f.name for f in dataclasses.fields(rc.TrainerOptions)} | {
        f.name for f in dataclasses.fields(rc.TrainConfig)
    }
