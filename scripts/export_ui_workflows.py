"""Regenerate the UI-format workflows in example_workflows/ from their API-format sources in
example_workflows/api/, with the real frontend doing the conversion (`app.loadApiJson`, then
`app.graph.serialize()` through `JSON.stringify`, as the frontend saves a file: keys that are
`undefined` are left out, never written as `null`, which the frontend's zod schema refuses),
so the shared files are exactly what ComfyUI itself would save, and a `<name>.jpg` thumbnail
of each (a screenshot of the loaded graph) for ComfyUI's template browser. Each loader node gets
the download of the files it names (`properties.models`, from MODEL_DOWNLOADS), and each graph
its note (NOTES); the server has an empty file under every model name, so the graphs open and
are shot as for a user who has the files.

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
# Each model file the examples' loaders name: the folder under models/ it goes in and the link
# ComfyUI's own templates (Comfy-Org/workflow_templates, the comfyui-workflow-templates packages)
# give for it. Written on each loader node as `properties.models` ([{name, url, directory}], the
# form those templates carry), which the frontend reads when a workflow opens: a missing file
# gets a Download button (1.32's Missing Models dialog, 1.49's Errors panel).
MODEL_DOWNLOADS = {
    # FLUX.1 Kontext dev, FLUX.1-dev (templates flux_kontext_dev_basic, flux_dev_full_text_to_image)
    "flux1-dev-kontext_fp8_scaled.safetensors": (
        "diffusion_models",
        "https://huggingface.co/Comfy-Org/flux1-kontext-dev_ComfyUI/resolve/main/split_files/"
        "diffusion_models/flux1-dev-kontext_fp8_scaled.safetensors",
    ),
    "flux1-dev.safetensors": (
        "diffusion_models",
        "https://huggingface.co/Comfy-Org/flux1-dev/resolve/main/flux1-dev.safetensors",
    ),
    "clip_l.safetensors": (
        "text_encoders",
        "https://huggingface.co/comfyanonymous/flux_text_encoders/resolve/main/clip_l.safetensors",
    ),
    "t5xxl_fp8_e4m3fn_scaled.safetensors": (
        "text_encoders",
        "https://huggingface.co/comfyanonymous/flux_text_encoders/resolve/main/t5xxl_fp8_e4m3fn_scaled.safetensors",
    ),
    "ae.safetensors": (
        "vae",
        "https://huggingface.co/Comfy-Org/Lumina_Image_2.0_Repackaged/resolve/main/split_files/vae/ae.safetensors",
    ),
    # FLUX.2 [dev] (image_flux2), FLUX.2 [klein] 4B Base (image_flux2_klein_text_to_image)
    "flux2_dev_fp8mixed.safetensors": (
        "diffusion_models",
        "https://huggingface.co/Comfy-Org/flux2-dev/resolve/main/split_files/diffusion_models/"
        "flux2_dev_fp8mixed.safetensors",
    ),
    "mistral_3_small_flux2_bf16.safetensors": (
        "text_encoders",
        "https://huggingface.co/Comfy-Org/flux2-dev/resolve/main/split_files/text_encoders/"
        "mistral_3_small_flux2_bf16.safetensors",
    ),
    "flux2-vae.safetensors": (
        "vae",
        "https://huggingface.co/Comfy-Org/flux2-dev/resolve/main/split_files/vae/flux2-vae.safetensors",
    ),
    "flux-2-klein-base-4b.safetensors": (
        "diffusion_models",
        "https://huggingface.co/Comfy-Org/flux2-klein/resolve/main/split_files/diffusion_models/"
        "flux-2-klein-base-4b.safetensors",
    ),
    "qwen_3_4b.safetensors": (
        "text_encoders",
        "https://huggingface.co/Comfy-Org/flux2-klein/resolve/main/split_files/text_encoders/qwen_3_4b.safetensors",
    ),
    # Qwen-Image-Edit 2509 (image_qwen_image_edit_2509), 2511 (image-qwen_image_edit_2511_lora_inflation)
    "qwen_image_edit_2509_fp8_e4m3fn.safetensors": (
        "diffusion_models",
        "https://huggingface.co/Comfy-Org/Qwen-Image-Edit_ComfyUI/resolve/main/split_files/diffusion_models/"
        "qwen_image_edit_2509_fp8_e4m3fn.safetensors",
    ),
    "qwen_image_edit_2511_bf16.safetensors": (
        "diffusion_models",
        "https://huggingface.co/Comfy-Org/Qwen-Image-Edit_ComfyUI/resolve/main/split_files/diffusion_models/"
        "qwen_image_edit_2511_bf16.safetensors",
    ),
    "qwen_2.5_vl_7b_fp8_scaled.safetensors": (
        "text_encoders",
        "https://huggingface.co/Comfy-Org/Qwen-Image_ComfyUI/resolve/main/split_files/text_encoders/"
        "qwen_2.5_vl_7b_fp8_scaled.safetensors",
    ),
    "qwen_image_vae.safetensors": (
        "vae",
        "https://huggingface.co/Comfy-Org/Qwen-Image_ComfyUI/resolve/main/split_files/vae/qwen_image_vae.safetensors",
    ),
}
# The loaders' file widgets, in the order they are written to `properties.models`.
LOADER_FILE_WIDGETS = {
    "UNETLoader": ("unet_name",),
    "VAELoader": ("vae_name",),
    "CLIPLoader": ("clip_name",),
    "DualCLIPLoader": ("clip_name1", "clip_name2"),
}
# What each example does, the files it loads, and the three things to change before a run of
# one's own, on the canvas (custom-node template cards show only the file name: the frontend's
# template store gives a pack's cards no title or description).
MISSING = "A missing file shows a Download button when the workflow opens."
KONTEXT_FILES = (
    "flux1-dev-kontext_fp8_scaled (models/diffusion_models), clip_l + t5xxl_fp8_e4m3fn_scaled "
    "(models/text_encoders), ae (models/vae). " + MISSING
)
FLUX2_FILES = (
    "flux2_dev_fp8mixed (models/diffusion_models), mistral_3_small_flux2_bf16 (models/text_encoders), "
    "flux2-vae (models/vae). " + MISSING
)
KLEIN_FILES = (
    "flux-2-klein-base-4b (models/diffusion_models), qwen_3_4b (models/text_encoders), flux2-vae "
    "(models/vae). " + MISSING
)
QWEN_TEXT_AND_VAE = (
    "qwen_2.5_vl_7b_fp8_scaled (models/text_encoders), qwen_image_vae (models/vae). " + MISSING
)


def training_changes(pairs: str) -> str:
    """The three widgets a training example's user changes, `pairs` the dataset's files."""
    return (
        f"Change:\n1. Edit Dataset folder: your folder in input/ ({pairs}).\n"
        "2. LoRA Trainer lora_name: a new name (it writes models/loras/<name>.safetensors).\n"
        "3. LoRA Trainer steps: 1000 or more (as shipped, a quick check); Edit Dataset resolution 512-1024."
    )


def inference_changes(lora: str, layout: str) -> str:
    """The three things an inference example's user changes."""
    return (
        f"Change:\n1. LoraLoaderModelOnly: your LoRA (the training example writes {lora}).\n"
        "2. Load Image: your own reference images; the prompt in the text encode node.\n"
        f"3. Keep the layout ({layout}) and reference_resolution your LoRA was trained with."
    )


EDIT_PAIRS = "name.png target + name_control.png reference + name.txt caption"
TWO_REFERENCES = "name.png + name_control.png + name_control_1.png + name.txt"
NOTES = {
    "kontext_lora_training": (
        "Train a FLUX.1 Kontext LoRA on edit pairs. Progress, loss and previews show on the LoRA "
        "Trainer node; Cancel writes a checkpoint to resume.\n\nFiles: "
        + KONTEXT_FILES
        + "\n\n"
        + training_changes(EDIT_PAIRS)
    ),
    "kontext_lora_inference": (
        "Edit an image with a trained Kontext LoRA through Multi-Image Conditioning, in the layout it "
        "was trained with.\n\nFiles: "
        + KONTEXT_FILES
        + "\n\n"
        + inference_changes("kontext_demo_lora", "offset")
    ),
    "dreamomni2_lora_training": (
        "Train a multi-reference LoRA on FLUX.1 Kontext in the DreamOmni2 layout: two references per "
        "sample; previews use person.png and hat.png.\n\nFiles: "
        + KONTEXT_FILES
        + "\n\n"
        + training_changes(TWO_REFERENCES)
    ),
    "flux_dev_lora_training": (
        "Train a FLUX.1-dev LoRA without references (text to image).\n\nFiles: flux1-dev "
        "(models/diffusion_models), clip_l + t5xxl_fp8_e4m3fn_scaled (models/text_encoders), ae "
        "(models/vae). " + MISSING + "\n\n" + training_changes("name.png + name.txt caption")
    ),
    "multi_reference_dreamomni2": (
        "Sample FLUX.1 Kontext with two reference images (person.png + hat.png) in the DreamOmni2 "
        "layout.\n\nFiles: " + KONTEXT_FILES + "\n\nChange: the two Load Image nodes and the prompt."
    ),
    "flux2_lora_training": (
        "Train a FLUX.2 [dev] multi-reference LoRA (index layout); previews use person.png and "
        "hat.png.\n\nFiles: " + FLUX2_FILES + "\n\n" + training_changes(TWO_REFERENCES)
    ),
    "flux2_lora_inference": (
        "Sample FLUX.2 [dev] with a trained LoRA and two references (person.png + hat.png).\n\nFiles: "
        + FLUX2_FILES
        + "\n\n"
        + inference_changes("flux2_lora", "index")
    ),
    "flux2_klein_lora_training": (
        "Train a FLUX.2 [klein] 4B multi-reference LoRA (layout auto: index). ComfyUI 0.33 or newer. "
        "Load the Base file, not the distilled one: LoRAs trained on the distilled file come out weak "
        "(for 9B: its Base file and Qwen3-8B). Previews use CFG: Base is not guidance-distilled."
        "\n\nFiles: " + KLEIN_FILES + "\n\n" + training_changes(TWO_REFERENCES)
    ),
    "flux2_klein_lora_inference": (
        "Sample FLUX.2 [klein] 4B Base with a trained LoRA and two references (person.png + hat.png), "
        "CFG 4 over 28 steps. ComfyUI 0.33 or newer.\n\nFiles: "
        + KLEIN_FILES
        + "\n\n"
        + inference_changes("flux2_klein_lora", "auto")
    ),
    "qwen_image_edit_2509_lora_training": (
        "Train a Qwen-Image-Edit 2509 LoRA with two references per sample (layout auto: index). Each "
        "caption is encoded with its references by TextEncodeQwenImageEditPlus, as sampling encodes "
        "it; the previews' negative is that node with an empty prompt.\n\nFiles: "
        "qwen_image_edit_2509_fp8_e4m3fn (models/diffusion_models), "
        + QWEN_TEXT_AND_VAE
        + "\n\n"
        + training_changes(TWO_REFERENCES)
    ),
    "qwen_image_edit_2509_lora_inference": (
        "Sample Qwen-Image-Edit 2509 with a trained LoRA and two references (person.png + hat.png) "
        "through TextEncodeQwenImageEditPlus, CFG 2.5 over 20 steps at 1024x1024.\n\nFiles: "
        "qwen_image_edit_2509_fp8_e4m3fn (models/diffusion_models), "
        + QWEN_TEXT_AND_VAE
        + "\n\n"
        + inference_changes("qwen_image_edit_2509_lora", "auto")
    ),
    "qwen_image_edit_2511_lora_training": (
        "Train a Qwen-Image-Edit 2511 LoRA (layout auto: index_timestep_zero). ComfyUI 0.33 or newer "
        "(0.3.75 runs a 2511 as a 2509).\n\nFiles: qwen_image_edit_2511_bf16 (models/diffusion_models), "
        + QWEN_TEXT_AND_VAE
        + "\n\n"
        + training_changes(TWO_REFERENCES)
    ),
    "qwen_image_edit_2511_lora_inference": (
        "Sample Qwen-Image-Edit 2511 with a trained LoRA and two references (person.png + hat.png), "
        "CFG 2.5 over 20 steps at 1024x1024. ComfyUI 0.33 or newer.\n\nFiles: "
        "qwen_image_edit_2511_bf16 (models/diffusion_models), "
        + QWEN_TEXT_AND_VAE
        + "\n\n"
        + inference_changes("qwen_image_edit_2511_lora", "auto")
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
# Each loader's `properties.models`: the downloads (MODEL_DOWNLOADS) of the files its widgets name.
MODELS_JS = """([downloads, fileWidgets]) => {
    for (const node of window.comfyAPI.app.app.graph._nodes) {
        const files = (fileWidgets[node.type] ?? [])
            .map((name) => node.widgets.find((w) => w.name === name).value)
            .filter((file) => file in downloads);
        if (!files.length) continue;
        node.properties.models = files.map((file) => (
            { name: file, url: downloads[file][1], directory: downloads[file][0] }));
    }
}"""
SAVED_JS = "() => JSON.parse(JSON.stringify(window.comfyAPI.app.app.graph.serialize()))"
VISIBLE_TOASTS = """() => [...document.querySelectorAll('.p-toast-message')]
    .filter((t) => t.offsetParent !== null).map((t) => t.innerText.trim())"""


# Where each loader's files go under models/, and its file widgets
STAND_IN_FOLDERS = {
    "UNETLoader": ("diffusion_models", ("unet_name",)),
    "VAELoader": ("vae", ("vae_name",)),
    "CLIPLoader": ("text_encoders", ("clip_name",)),
    "DualCLIPLoader": ("text_encoders", ("clip_name1", "clip_name2")),
    "LoraLoaderModelOnly": ("loras", ("lora_name",)),
}


def with_stand_ins(base: Path, sources: list[Path]) -> Path:
    """`base` with an empty file under each model name the examples load in its models/: the
    graphs open as for a user who has the files (no Missing Models dialog in a thumbnail)."""
    for source in sources:
        for node in json.loads(source.read_text()).values():
            folder, widgets = STAND_IN_FOLDERS.get(node["class_type"], (None, ()))
            for widget in widgets:
                file = base / "models" / folder / node["inputs"][widget]
                file.parent.mkdir(parents=True, exist_ok=True)
                file.touch()
    return base


def main() -> int:
    from playwright.sync_api import sync_playwright

    chromium = shutil.which("chromium")
    if chromium is None:
        print("Debian chromium is needed: apt-get install chromium", file=sys.stderr)
        return 1
    sources = sorted(API_DIR.glob("*.json"))
    with (
        tempfile.TemporaryDirectory() as base,
        ComfyServer(with_stand_ins(Path(base), sources)) as server,
        sync_playwright() as pw,
    ):
        browser = pw.chromium.launch(executable_path=chromium, args=["--no-sandbox", "--disable-gpu"])
        page = browser.new_page(viewport={"width": 1600, "height": 1068})
        for setting, value in SHOT_SETTINGS.items():
            server.post_json(f"/settings/{setting}", value)
        page.goto(server.url)
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
            page.evaluate(MODELS_JS, [MODEL_DOWNLOADS, LOADER_FILE_WIDGETS])
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
