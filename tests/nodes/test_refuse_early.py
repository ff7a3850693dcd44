"""Issue 62 item 4, "refuse early", through ComfyUI's executor: what the settings and the MODEL
decide is refused before LoadKontextDataset encodes anything (TrainLoRA asks for its dataset, a
lazy input, only after those checks), `hold_out` against the folder's samples before the encoders
run, a setting the model ignores told once and recorded as ignored in the LoRA's metadata, and a
file removed while the dataset encodes named in the pack's own line."""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

import pytest

from kt_testing.datasets import write_one_folder
from kt_testing.executor import InGraph, run_graph, run_node
from kt_testing.graphs import cache_name, dataset_inputs
from kt_testing.tiny_models import (
    small_flux2_vae,
    small_flux_vae,
    tiny_clip,
    tiny_flux2_patcher,
    tiny_flux_patcher,
    tiny_klein_patcher,
)

pytestmark = pytest.mark.usefixtures("comfy_runtime")

TRAIN = "KontextTrainer_TrainLoRA"
DATASET = "KontextTrainer_LoadKontextDataset"


class Spied:
    """A VAE and a CLIP whose encoder calls are counted (`calls`); `on_encode(n)` runs before
    the n-th VAE encode (1 first)."""

    def __init__(self, vae, clip, on_encode=None):
        self.vae, self.clip, self.calls, self.encodes = vae, clip, 0, 0
        encode, tokenize = vae.encode, clip.tokenize

        def counted_encode(*args, **kwargs):
            self.calls, self.encodes = self.calls + 1, self.encodes + 1
            if on_encode is not None:
                on_encode(self.encodes)
            return encode(*args, **kwargs)

        def counted_tokenize(*args, **kwargs):
            self.calls += 1
            return tokenize(*args, **kwargs)

        vae.encode, clip.tokenize = counted_encode, counted_tokenize


@pytest.fixture(scope="module")
def folder(tmp_path_factory, comfy_runtime):
    return write_one_folder(tmp_path_factory.mktemp("early") / "set", ["a", "b"], references=1, size=(64, 64))


@pytest.fixture(scope="module")
def config_fields(pack_import):
    return {f.name: f.default for f in dataclasses.fields(pack_import("trainer_core.config").TrainConfig)}


def train_inputs(config_fields, model, name, **overrides) -> dict:
    settings = {**config_fields, "steps": 1, "rank": 2, "alpha": 2.0, "gradient_checkpointing": False}
    return {
        "model": InGraph(model),
        "lora_name": name,
        "overwrite": False,
        "resume_from": "none",
        **settings,
        **overrides,
    }


def loras_dir() -> Path:
    import folder_paths

    return Path(folder_paths.get_folder_paths("loras")[0])


REFUSED = {
    # klein runs FLUX.2's layouts: DreamOmni2's ids were learnt by a FLUX.1 Kontext model
    "klein dreamomni2": (
        tiny_klein_patcher,
        lambda: (small_flux2_vae(seed=1), tiny_clip(seed=2, pooled=False)),
        {"layout": "dreamomni2"},
        "layout 'dreamomni2' does not fit a FLUX.2 [klein] 4B model; choose one of index, offset, uxo, "
        "index_timestep_zero (index is its default)",
    ),
    "FLUX.1 index_timestep_zero": (
        tiny_flux_patcher,
        lambda: (small_flux_vae(seed=1), tiny_clip(seed=2)),
        {"layout": "index_timestep_zero"},
        "layout 'index_timestep_zero' does not fit a FLUX.1 model",
    ),
    "an existing lora_name": (
        tiny_flux_patcher,
        lambda: (small_flux_vae(seed=1), tiny_clip(seed=2)),
        {"lora_name": "kt_early_exists"},
        "kt_early_exists.safetensors already exists. Choose another lora_name, or turn on overwrite",
    ),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_what_the_settings_and_the_model_decide_is_refused_before_the_dataset_encodes(
    case, folder, config_fields, tmp_path_factory
):
    """On main the dataset encoded first (LoadKontextDataset ran before TrainLoRA looked at its
    MODEL): the refusal came after 4 VAE and 3 text encoder calls here, after minutes of encoding
    on a real dataset. Now TrainLoRA asks for the dataset only once they pass: no encoder call."""
    model, encoders, overrides, message = REFUSED[case]
    spied = Spied(*encoders())
    prompt = {
        "4": {
            "class_type": DATASET,
            "inputs": dataset_inputs(spied.vae, spied.clip, folder, cache_name(tmp_path_factory)),
        },
        "5": {
            "class_type": TRAIN,
            "inputs": {
                "dataset": ["4", 0],
                **train_inputs(config_fields, model, f"kt_early_{len(case)}", **overrides),
            },
        },
    }
    existing = loras_dir() / "kt_early_exists.safetensors"
    existing.parent.mkdir(parents=True, exist_ok=True)
    existing.write_bytes(b"an earlier run's LoRA")
    try:
        with pytest.raises(ValueError) as refused:
            run_graph(prompt, ["5"])
    finally:
        existing.unlink()
    assert message in str(refused.value) and "\n" not in str(refused.value), str(refused.value)
    assert spied.calls == 0


@pytest.mark.version_independent  # our files and messages
@pytest.mark.parametrize("hold_out", [2, 3])
def test_a_hold_out_that_leaves_nothing_to_train_is_refused_naming_it_before_encoding(
    hold_out, folder, tmp_path_factory
):
    spied = Spied(small_flux_vae(seed=1), tiny_clip(seed=2))
    inputs = dataset_inputs(spied.vae, spied.clip, folder, cache_name(tmp_path_factory))
    inputs["hold_out"] = hold_out
    with pytest.raises(ValueError) as refused:
        run_node(DATASET, inputs)
    assert str(refused.value) == (
        f"hold_out: {hold_out} leaves none of the dataset's 2 sample(s) to train on; set hold_out to "
        "at most 1, or add samples"
    )
    assert spied.calls == 0


def test_a_setting_the_model_ignores_is_told_once_and_recorded_as_ignored(
    folder, config_fields, pack_import, tmp_path_factory, caplog
):
    """klein has no guidance embedding: a guidance of 3.5 changed nothing and the LoRA said
    ss_guidance_scale 3.5, without a word. FLUX.2 [dev] (guidance-distilled) reads it: no note."""
    vae, clip = small_flux2_vae(seed=1), tiny_clip(seed=2, pooled=False)
    loaded = dataset_inputs(InGraph(lambda: vae), InGraph(lambda: clip), folder, cache_name(tmp_path_factory))
    dataset = run_node(DATASET, loaded).outputs[0]
    load = pack_import("trainer_core.lora_file").load
    note = (
        "guidance: FLUX.2 [klein] 4B has no guidance embedding (it is not guidance-distilled), so "
        "guidance 3.5 changes nothing; the LoRA's metadata records it as ignored"
    )
    runs = {}
    for name, model in (("kt_early_klein", tiny_klein_patcher), ("kt_early_flux2", tiny_flux2_patcher)):
        settings = train_inputs(config_fields, model, name, guidance=3.5, layout="index")
        inputs = {"dataset": dataset, **settings}
        with caplog.at_level(logging.WARNING, logger="kontext_trainer"):
            caplog.clear()
            result = run_node(TRAIN, inputs)
        messages = [e["message"] for e in result.events("kontext_trainer.progress") if e["message"]]
        logged = [r.getMessage() for r in caplog.records if "guidance" in r.getMessage()]
        runs[name] = messages, logged, load(loras_dir() / result.outputs[1])[1]
    messages, logged, metadata = runs["kt_early_klein"]
    training = [message for message in messages if not message.startswith("saved ")]
    assert training and all(message.count(note) == 1 for message in training), messages
    assert logged == [f"TrainLoRA kt_early_klein: {note}"]
    assert "ss_guidance_scale" not in metadata
    assert json.loads(metadata["kontext_trainer.ignored"]) == ["guidance"]
    messages, logged, metadata = runs["kt_early_flux2"]
    assert not any("guidance" in message for message in messages) and not logged
    assert metadata["ss_guidance_scale"] == "3.5" and "kontext_trainer.ignored" not in metadata


@pytest.mark.version_independent  # our files and messages
@pytest.mark.parametrize("which", ["b.png", "b_control.png"])
def test_a_file_removed_while_the_dataset_encodes_is_named_in_one_line(which, tmp_path, tmp_path_factory):
    """FLUX: a target or reference deleted while the VAE encodes the first sample."""
    root = write_one_folder(tmp_path / "set", ["a", "b"], references=1, size=(64, 64))
    gone = root / which

    def remove(call: int) -> None:
        if call == 1:
            gone.unlink()

    spied = Spied(small_flux_vae(seed=1), tiny_clip(seed=2), on_encode=remove)
    with pytest.raises(ValueError) as refused:
        run_node(DATASET, dataset_inputs(spied.vae, spied.clip, root, cache_name(tmp_path_factory)))
    assert str(refused.value) == (
        f"{gone} is gone: it was moved or deleted after the dataset was checked. Put it back, or "
        "take its sample out of the dataset, and run again"
    )


@pytest.mark.version_independent  # our files and messages
@pytest.mark.parametrize("which", ["b.png", "b.txt"])
def test_a_file_removed_while_the_command_loads_its_models_is_named_in_one_line(
    which, pack_import, tmp_path, tmp_path_factory
):
    """The command checks the folder before ComfyUI boots and encodes after the models load
    (minutes for a real model): a target or caption deleted meanwhile. The caption's line said
    "check that ComfyUI may read it, or remove it"."""
    datasets = pack_import("application.datasets")
    options = pack_import("trainer_core.dataset_options")
    root = write_one_folder(tmp_path / "set", ["a", "b"], references=1, size=(64, 64))
    chosen = options.DatasetOptions(
        path=str(root), resolution=128, reference_resolution=64, min_size=0, cache_folder=str(tmp_path / "c")
    )
    checked = datasets.check_dataset(chosen, confined=False)  # before the boot (`preflight`)
    (root / which).unlink()  # while the models load
    with pytest.raises(ValueError) as refused:
        datasets.load_dataset(
            small_flux_vae(seed=1), tiny_clip(seed=2), chosen, confined=False, checked=checked
        )
    assert str(refused.value) == (
        f"{root / which} is gone: it was moved or deleted after the dataset was checked. Put it back, "
        "or take its sample out of the dataset, and run again"
    )
