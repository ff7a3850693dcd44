"""A resume knows what it resumes (issue 62), through a real server: a checkpoint records the
model entry, the base weights (file name and fingerprint) and the VAE and text encoder that
encoded its dataset; a resume on another model entry is refused first, naming both; one on
another base file of the same model resumes with a note the panel shows first (with every
"not exactly the uninterrupted run" note) and the LoRA's metadata names both bases; a checkpoint
written before the record resumes with a note that its base cannot be checked. On c1ab39f a
FLUX.1 checkpoint in a klein graph was refused for its layout, another seed's model resumed
silently, and a learning-rate change was said only in the server's log."""

from __future__ import annotations

import json

import pytest

from kt_testing.datasets import write_one_folder
from kt_testing.graphs import training_graph
from kt_testing.runs import checkpoints_root, error_of, progress_events
from trainer_core.lora_file import load

pytestmark = pytest.mark.version_independent

TRAIN_LORA = "KontextTrainer_TrainLoRA"


@pytest.fixture(scope="module")
def dataset(server):
    return write_one_folder(server.base_dir / "input" / "kt_on_set", ["a", "b"], references=1, size=(64, 64))


def checkpoint_choices(server, name: str) -> list[str]:
    spec = server.get_json(f"/object_info/{TRAIN_LORA}")[TRAIN_LORA]["input"]["required"]["resume_from"]
    options = spec[0] if isinstance(spec[0], list) else spec[1]["options"]
    return [c for c in options if c.startswith(f"{name}/")]


def trained_on(server, choice: str) -> dict:
    state = json.loads((checkpoints_root(server) / choice / "state.json").read_text())
    return state["config"]["trained_on"]


def succeeded(messages) -> None:
    assert messages[-1]["type"] == "execution_success", messages[-1]["data"].get("exception_message")


def final_message(messages) -> str:
    return progress_events(messages)[-1]["message"]


def test_a_resume_names_the_model_and_the_base_it_was_trained_on(server, dataset):
    _, first = server.run_prompt(training_graph(dataset, "kt_on", steps=2, save_every=0))
    succeeded(first)
    (choice,) = checkpoint_choices(server, "kt_on")
    record = trained_on(server, choice)
    assert record["model"] == "FLUX.1"
    assert len(record["base"]["fingerprint"]) == 32
    assert record["vae"]["fingerprint"] and record["text_encoder"]["fingerprint"]

    # another model entry: refused first, both named (not the layout, not "another dataset")
    klein = training_graph(dataset, "kt_on", steps=4, resume_from=choice, overwrite=True)
    klein["1"] = {"class_type": "KTTest_TinyKleinModel", "inputs": {"seed": 3}}
    klein["2"] = {"class_type": "KTTest_SmallFlux2VAE", "inputs": {"seed": 1}}
    klein["3"] = {"class_type": "KTTest_TinyKleinTextEncoder", "inputs": {"seed": 2}}
    _, refused = server.run_prompt(klein)
    message = error_of(refused)
    assert message.startswith("resume_from: the checkpoint trained a FLUX.1 LoRA"), message
    assert "this MODEL is FLUX.2 [klein] 4B" in message and "load the FLUX.1 model to resume it" in message

    # a dataset encoded by another VAE: named as such (not "another dataset")
    other_vae = training_graph(dataset, "kt_on", steps=4, resume_from=choice, overwrite=True)
    other_vae["2"]["inputs"]["seed"] = 5
    _, refused = server.run_prompt(other_vae)
    message = error_of(refused)
    vae = "resume_from: the checkpoint's dataset was encoded by the VAE weights "
    assert message.startswith(vae), message
    assert "load the VAE it was trained with to resume" in message

    # another base file of the same model (another seed), and a changed learning rate: both said
    # first on the panel's last message; the LoRA names both bases
    other = training_graph(dataset, "kt_on", steps=4, resume_from=choice, overwrite=True, learning_rate=5e-4)
    other["1"]["inputs"]["seed"] = 4
    _, resumed = server.run_prompt(other)
    succeeded(resumed)
    message = final_message(resumed)
    assert message.startswith(
        "resumed from step 2 on another base model file: the checkpoint was trained on"
    ), message
    assert f"weights {record['base']['fingerprint'][:8]}" in message
    assert "learning_rate 0.001 -> 0.0005 (accepted on purpose)" in message
    assert "saved " in message
    _, metadata = load(server.base_dir / "models" / "loras" / "kt_on.safetensors")
    written = json.loads(metadata["kontext_trainer.trained_on"])
    assert written["earlier_bases"] == [{**record["base"], "until_step": 2}]
    assert written["base"]["fingerprint"] != record["base"]["fingerprint"]

    # a checkpoint written before the record: resumes, and says its base cannot be checked
    (newest,) = [c for c in checkpoint_choices(server, "kt_on") if c.endswith("step_000004")]
    state_file = checkpoints_root(server) / newest / "state.json"
    state = json.loads(state_file.read_text())
    del state["config"]["trained_on"]
    state_file.write_text(json.dumps(state))
    old = training_graph(dataset, "kt_on", steps=5, resume_from=newest, overwrite=True, learning_rate=5e-4)
    old["1"]["inputs"]["seed"] = 4
    _, resumed_old = server.run_prompt(old)
    succeeded(resumed_old)
    assert final_message(resumed_old).startswith(
        "resumed from step 4 of a checkpoint written before checkpoints recorded their base model"
    ), final_message(resumed_old)
