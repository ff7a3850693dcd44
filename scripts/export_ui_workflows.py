"""Regenerate the UI-format workflows in example_workflows/ from their API-format sources in
example_workflows/api/, with the real frontend doing the conversion (`app.loadApiJson`, then
`app.graph.serialize()` through `JSON.stringify`, as the frontend saves a file: keys that are
`undefined` are left out, never written as `null`, which the frontend's zod schema refuses),
so the shared files are exactly what ComfyUI itself would save, and a `<name>.jpg` thumbnail
of each (a screenshot of the loaded graph) for ComfyUI's template browser.

Each written file is loaded back the way a user opens it (`app.loadGraphData`, which validates
it against the frontend's zod schema); any toast the frontend shows fails the export.
tests/e2e/test_example_workflows.py checks the two formats stay equivalent and opens each file
from the template browser.

    .venv/bin/python scripts/export_ui_workflows.py     (needs Debian chromium)
"""

from __future__ import annotations

import io
import json
import shutil
import sys
import tempfile
from pathlib import Path

from PIL import Image

from comfy_server import REPO_ROOT, ComfyServer

API_DIR = REPO_ROOT / "example_workflows" / "api"
# Thumbnail look: readable node text at fit-view zoom, no minimap or canvas statistics.
SHOT_SETTINGS = {
    "Comfy.TutorialCompleted": True,  # no first-run dialog
    "Comfy.Minimap.Visible": False,
    "Comfy.Graph.CanvasInfo": False,
    "LiteGraph.Canvas.MinFontSizeForLOD": 1,
}
# The zoom each example opens at: the frontend draws nodes without text below about 0.6
# (LiteGraph's low-quality threshold; MinFontSizeForLOD 8 px on 14 px text on 1.49), and a
# fit-to-window view of a training graph is below that on a laptop screen.
OPEN_SCALE = 0.8
OPEN_LEFT_PX = 80  # the graph's left edge on the page: right of the side bar (about 60 px)
EXAMPLE_MARK = "kontext_trainer_example"  # in `extra`: web/js/example_view.js reads it
# What each example does and what it needs, on the canvas (custom-node template cards show only
# the file name: the frontend's template store gives a pack's cards no title or description).
DEMO = "Runs as shipped on the files `make demo` writes (random weights: the images are coloured noise)."
NOTES = {
    "kontext_lora_training": (
        "Train a FLUX.1 Kontext LoRA on edit pairs.\n\n"
        "Dataset: input/kontext_demo (name.png target + name_control.png reference + name.txt "
        "caption). " + DEMO + "\n\nFor real training: load flux1-dev-kontext (or its fp8_scaled "
        "file), clip_l, t5xxl and ae in the loaders, raise resolution, steps and rank. Progress, "
        "loss and previews show on the LoRA Trainer node; Cancel writes a checkpoint to resume."
    ),
    "kontext_lora_inference": (
        "Edit an image with a trained Kontext LoRA (kontext_demo_lora, what the training example "
        "writes) through MultiImageConditioning in the layout it was trained with. " + DEMO
    ),
    "dreamomni2_lora_training": (
        "Train a multi-reference (DreamOmni2 layout) LoRA: two references per sample.\n\n"
        "Dataset: input/dreamomni2_demo (name.png + name_control.png + name_control_1.png + "
        "name.txt); previews use person.png and hat.png. " + DEMO
    ),
    "flux_dev_lora_training": (
        "Train a FLUX.1-dev LoRA without references (text to image).\n\n"
        "Dataset: input/flux_dev_demo (name.png + name.txt). " + DEMO
    ),
    "multi_reference_dreamomni2": (
        "Sample FLUX.1 Kontext with two reference images (person.png + hat.png) in the DreamOmni2 "
        "layout.\n\nNeeds model files the demo cannot make: flux1-dev-kontext_fp8_scaled.safetensors "
        "(models/diffusion_models), clip_l.safetensors and t5xxl_fp8_e4m3fn_scaled.safetensors "
        "(models/text_encoders), ae.safetensors (models/vae), or pick yours in the loaders."
    ),
    "flux2_lora_training": (
        "Train a FLUX.2 [dev] multi-reference LoRA (index layout).\n\nNeeds FLUX.2 files the demo "
        "cannot make: flux2_dev_fp8mixed.safetensors (models/diffusion_models), "
        "mistral_3_small_flux2_bf16.safetensors (models/text_encoders), flux2-vae.safetensors "
        "(models/vae). Dataset: input/flux2_demo (two references per sample); previews use "
        "person.png and hat.png."
    ),
    "flux2_klein_lora_training": (
        "Train a FLUX.2 [klein] 4B multi-reference LoRA (layout auto: FLUX.2's index). Needs "
        "ComfyUI 0.33 or newer.\n\nLoad the Base file, not the distilled one (ComfyUI cannot tell "
        "them apart; LoRAs trained on the distilled file come out weak): "
        "flux-2-klein-base-4b.safetensors (models/diffusion_models), qwen_3_4b.safetensors "
        "(models/text_encoders), flux2-vae.safetensors (models/vae); for 9B, its Base file and "
        "Qwen3-8B. Dataset: input/flux2_demo (the FLUX.2 example's: two references per "
        "sample); previews use person.png and hat.png, with CFG (Base is not guidance-distilled)."
    ),
    "flux2_klein_lora_inference": (
        "Sample FLUX.2 [klein] 4B Base with the LoRA the klein training example writes "
        "(flux2_klein_lora) and two references (person.png + hat.png), CFG 4 over 28 steps. Needs "
        "ComfyUI 0.33 or newer and flux-2-klein-base-4b.safetensors, qwen_3_4b.safetensors, "
        "flux2-vae.safetensors."
    ),
    "qwen_image_edit_2509_lora_training": (
        "Train a Qwen-Image-Edit 2509 LoRA with two references per sample (layout auto: 2509's "
        "index). Needs qwen_image_edit_2509_fp8_e4m3fn.safetensors (models/diffusion_models), "
        "qwen_2.5_vl_7b_fp8_scaled.safetensors (models/text_encoders), qwen_image_vae.safetensors "
        "(models/vae).\n\nDataset: input/qwen_edit_demo (name.png + name.txt, references "
        "name_control.png + name_control_1.png); each caption is encoded with its references by "
        "TextEncodeQwenImageEditPlus, as sampling encodes it (references at about 1 MP). Previews: "
        "that node with person.png + hat.png; the negative, the same node with an empty prompt."
    ),
    "qwen_image_edit_2509_lora_inference": (
        "Sample Qwen-Image-Edit 2509 with the LoRA the 2509 training example writes "
        "(qwen_image_edit_2509_lora) and two references (person.png + hat.png) through "
        "TextEncodeQwenImageEditPlus, CFG 2.5 over 20 steps at 1024x1024. Needs "
        "qwen_image_edit_2509_fp8_e4m3fn.safetensors, qwen_2.5_vl_7b_fp8_scaled.safetensors, "
        "qwen_image_vae.safetensors."
    ),
    "qwen_image_edit_2511_lora_training": (
        "Train a Qwen-Image-Edit 2511 LoRA (layout auto: 2511's index_timestep_zero, the "
        "references modulated at timestep 0). Needs ComfyUI 0.33 or newer (0.3.75 runs a 2511 "
        "as a 2509) and qwen_image_edit_2511_bf16.safetensors (models/diffusion_models), "
        "qwen_2.5_vl_7b_fp8_scaled.safetensors, qwen_image_vae.safetensors.\n\nDataset and "
        "previews as in the 2509 example: input/qwen_edit_demo, person.png + hat.png."
    ),
    "qwen_image_edit_2511_lora_inference": (
        "Sample Qwen-Image-Edit 2511 with the LoRA the 2511 training example writes "
        "(qwen_image_edit_2511_lora) and two references (person.png + hat.png), CFG 2.5 over 20 "
        "steps at 1024x1024. Needs ComfyUI 0.33 or newer and qwen_image_edit_2511_bf16.safetensors, "
        "qwen_2.5_vl_7b_fp8_scaled.safetensors, qwen_image_vae.safetensors."
    ),
    "flux2_lora_inference": (
        "Sample FLUX.2 [dev] with the LoRA the FLUX.2 training example writes (flux2_lora) and two "
        "references (person.png + hat.png).\n\nNeeds FLUX.2 files the demo cannot make: "
        "flux2_dev_fp8mixed.safetensors, mistral_3_small_flux2_bf16.safetensors, "
        "flux2-vae.safetensors."
    ),
}
# After the frontend has laid the API graph out (`LGraph.arrange`: columns by depth, 100 px
# apart, each node at the size it has before anything loads), the graph as a user sees it:
# - a LoadImage at the height both frontends grow it to once its image shows (its two widget
#   rows and the 220 px image preview): laid out at 102 px, it grew over the node below (issue 45);
# - each PreviewAny (the dataset report) under the node it shows, wide and tall enough for the
#   report's lines (1.49 gave it a box of 4 lines);
# - columns and rows packed again at those sizes, closer than arrange's 100 px, so a training
#   graph at OPEN_SCALE ends left of the minimap (both frontends show it at the bottom right);
# - the note above the graph, seeds that stay put (a user comparing LoRAs compares them on one
#   seed), and the view at OPEN_SCALE with the note and the first nodes in it.
ARRANGE_JS = """([note, scale, left_px]) => {
    const app = window.comfyAPI.app.app;
    const graph = app.graph;
    const TITLE = window.LiteGraph.NODE_TITLE_HEIGHT;
    const COLUMN_GAP = 30, ROW_GAP = 40;
    const LOADED_IMAGE_NODE = 314, REPORT_SIZE = [400, 240];
    for (const node of graph._nodes) {
        for (const widget of node.widgets ?? []) {
            if (widget.name === "control_after_generate") widget.value = "fixed";
        }
        if (node.type === "LoadImage") node.size[1] = Math.max(node.size[1], LOADED_IMAGE_NODE);
        if (node.type === "PreviewAny") {
            node.size = [...REPORT_SIZE];
            const source = node.getInputNode(0);
            if (source) node.pos = [source.pos[0], Infinity]; // the bottom of its source's column
        }
    }
    const columns = new Map();
    for (const node of graph._nodes) {
        if (!columns.has(node.pos[0])) columns.set(node.pos[0], []);
        columns.get(node.pos[0]).push(node);
    }
    const left = Math.min(...graph._nodes.map((n) => n.pos[0]));
    const top = Math.min(...graph._nodes.filter((n) => isFinite(n.pos[1])).map((n) => n.pos[1]));
    let x = left;
    for (const [, column] of [...columns.entries()].sort((a, b) => a[0] - b[0])) {
        column.sort((a, b) => a.pos[1] - b.pos[1]);
        let y = top;
        for (const node of column) {
            node.pos = [x, y];
            y += node.size[1] + TITLE + ROW_GAP;
        }
        x += Math.max(...column.map((n) => n.size[0])) + COLUMN_GAP;
    }
    const memo = window.LiteGraph.createNode("Note");
    memo.title = "About this example";
    memo.widgets[0].value = note;
    memo.size = [520, 200];
    memo.pos = [left, top - 240];
    graph.add(memo);
    app.canvas.ds.scale = scale;
    // (screen = (graph + offset) x scale): the note's corner left_px right of and 150 px below
    // the page's
    app.canvas.ds.offset = [left_px / scale - left, 150 / scale - (top - 240)];
    app.canvas.setDirty(true, true);
}"""
SAVED_JS = "() => JSON.parse(JSON.stringify(window.comfyAPI.app.app.graph.serialize()))"
VISIBLE_TOASTS = """() => [...document.querySelectorAll('.p-toast-message')]
    .filter((t) => t.offsetParent !== null).map((t) => t.innerText.trim())"""


def main() -> int:
    from playwright.sync_api import sync_playwright

    chromium = shutil.which("chromium")
    if chromium is None:
        print("Debian chromium is needed: apt-get install chromium", file=sys.stderr)
        return 1
    with tempfile.TemporaryDirectory() as base, ComfyServer(Path(base)) as server, sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=chromium, args=["--no-sandbox", "--disable-gpu"])
        page = browser.new_page(viewport={"width": 1600, "height": 1068})
        for setting, value in SHOT_SETTINGS.items():
            server.post_json(f"/settings/{setting}", value)
        page.goto(server.url)
        sources = sorted(API_DIR.glob("*.json"))
        needed = sorted({n["class_type"] for s in sources for n in json.loads(s.read_text()).values()})
        # Node definitions are registered a moment after the app appears: wait for every type.
        page.wait_for_function(
            "(types) => types.every(t => window.LiteGraph?.registered_node_types?.[t])",
            arg=needed,
            timeout=60_000,
        )
        for source in sources:
            page.evaluate(
                """async ([prompt, name]) => {
                    const app = window.comfyAPI.app.app;
                    await app.loadApiJson(prompt, name);
                }""",
                [json.loads(source.read_text()), source.name],
            )
            page.evaluate(ARRANGE_JS, [NOTES[source.stem], OPEN_SCALE, OPEN_LEFT_PX])
            workflow = page.evaluate(SAVED_JS)
            # the pack's extension opens it at its saved view from the template browser too
            # (web/js/example_view.js)
            workflow.setdefault("extra", {})[EXAMPLE_MARK] = source.stem
            page.evaluate(
                "([workflow, name]) => window.comfyAPI.app.app.loadGraphData(workflow, true, true, name)",
                [workflow, source.stem],
            )
            page.wait_for_timeout(300)  # a validation alert renders on the next tick
            problems = page.evaluate(VISIBLE_TOASTS)
            if problems:
                print(f"{source.name}: the frontend refuses the result: {problems}", file=sys.stderr)
                return 1
            target = REPO_ROOT / "example_workflows" / source.name
            target.write_text(json.dumps(workflow, indent=2) + "\n")
            page.wait_for_timeout(500)  # opened at its saved view: the note and the first nodes
            thumbnail = target.with_suffix(".jpg")
            # a card is 600 x 380: a region that shrinks little keeps the text readable
            canvas_only = {"x": 64, "y": 130, "width": 900, "height": 570}  # no menus or banners
            shot = Image.open(io.BytesIO(page.screenshot(clip=canvas_only))).convert("RGB")
            shot.resize((600, 380), Image.Resampling.LANCZOS).save(thumbnail, quality=85)
            print(f"wrote {target.relative_to(REPO_ROOT)} and {thumbnail.name}")
        browser.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
