"""What a user does with runs and files, through a real ComfyUI server (where every node runs
under torch.inference_mode()): Cancel then resume in a new prompt with exactly the losses of
an uninterrupted run, continuing a finished run, resumes that fail or use another name never
touching the checkpoints they came from, LoRA lists holding only LoRAs, and the overwrite
policy for an existing LoRA name."""

from __future__ import annotations

import json

import pytest
import torch

from kt_testing.datasets import write_one_folder
from kt_testing.graphs import training_graph
from kt_testing.runs import (
    checkpoints_root,
    error_of,
    losses_of,
    progress_events,
    run_and_act,
    run_and_interrupt,
    snapshot,
)
from trainer_core.lora_file import load

pytestmark = pytest.mark.version_independent  # runs once in `make test` (on 0.3.75: scripts/test.sh)

# Every random part of a step on: LoRA dropout, caption dropout, input-perturbation noise.
RECIPE = {"dropout": 0.1, "caption_dropout": 0.3, "ip_noise_gamma": 0.1, "seed": 11, "steps": 40}
TRAIN_LORA = "KontextTrainer_TrainLoRA"


@pytest.fixture(scope="module")
def dataset(server):
    return write_one_folder(
        server.base_dir / "input" / "kt_resume_set", ["a", "b", "c"], references=1, size=(64, 64)
    )


def loras(server):
    return server.base_dir / "models" / "loras"


def combo_options(server, node_type: str, name: str) -> list[str]:
    """A dropdown's choices as the frontend gets them from /object_info."""
    spec = server.get_json(f"/object_info/{node_type}")[node_type]["input"]["required"][name]
    return spec[0] if isinstance(spec[0], list) else spec[1]["options"]


def checkpoint_choices(server, name: str) -> list[str]:
    return [c for c in combo_options(server, TRAIN_LORA, "resume_from") if c.startswith(f"{name}/")]


def succeeded(messages) -> None:
    assert messages[-1]["type"] == "execution_success", messages[-1]["data"].get("exception_message")


@pytest.mark.parametrize("optimizer", ["adamw", "adafactor"])
def test_cancel_then_resume_gives_the_uninterrupted_losses(server, dataset, optimizer):
    recipe = {**RECIPE, "optimizer": optimizer}
    full_id, full = server.run_prompt(training_graph(dataset, f"kt_full_{optimizer}", **recipe))
    succeeded(full)
    uninterrupted = losses_of(server, full_id)
    assert len(uninterrupted) == RECIPE["steps"]

    cut = run_and_interrupt(server, training_graph(dataset, f"kt_cut_{optimizer}", **recipe), at_step=3)
    assert cut[-1]["type"] == "execution_interrupted", cut[-1]
    final = progress_events(cut)[-1]
    assert final["status"] == "cancelled"
    choice = final["message"].split("resume from ")[1]  # the node says what to pick
    assert choice in checkpoint_choices(server, f"kt_cut_{optimizer}")
    stopped_at = int(choice.rsplit("_", 1)[1])
    assert 3 <= stopped_at < RECIPE["steps"]
    original_run = checkpoints_root(server) / choice.rsplit("/", 1)[0]
    before = snapshot(original_run)

    resumed_id, resumed = server.run_prompt(
        training_graph(dataset, f"kt_cut_{optimizer}", resume_from=choice, **recipe)
    )
    succeeded(resumed)
    resumed_losses = losses_of(server, resumed_id)
    print(f"\n{optimizer}: cancelled at step {stopped_at}; step, uninterrupted, resumed:")
    for step, (a, b) in enumerate(zip(uninterrupted, resumed_losses, strict=True), 1):
        print(f"  {step:3d}  {a:.6f}  {b:.6f}{'  <- resumed' if step == stopped_at + 1 else ''}")
    assert resumed_losses == uninterrupted  # exactly, on CPU
    # the node's smoothed loss goes on from the earlier steps too (it restarted: issue 33)
    smoothed = [progress_events(run)[-1]["smoothed_loss"] for run in (full, resumed)]
    assert smoothed[1] == pytest.approx(smoothed[0], rel=1e-9), smoothed
    assert snapshot(original_run) == before  # the checkpoint resumed from is untouched

    # a finished run continues with more steps (its final step was checkpointed)
    last = checkpoint_choices(server, f"kt_full_{optimizer}")[-1]
    assert last.endswith(f"step_{RECIPE['steps']:06d}")
    more_id, more = server.run_prompt(
        training_graph(
            dataset, f"kt_full_{optimizer}", overwrite=True, resume_from=last, **{**recipe, "steps": 44}
        )
    )
    succeeded(more)
    continued = losses_of(server, more_id)
    assert continued[: RECIPE["steps"]] == uninterrupted and len(continued) == 44


def test_failed_resumes_and_other_names_never_touch_the_original_run(server, dataset):
    settings = {"steps": 6, "save_every": 2, "keep_last": 3, "seed": 4}
    first_id, first = server.run_prompt(training_graph(dataset, "kt_keep", **settings))
    succeeded(first)
    choices = checkpoint_choices(server, "kt_keep")
    assert [c.rsplit("/", 1)[1] for c in choices] == ["step_000002", "step_000004", "step_000006"]
    root = checkpoints_root(server) / "kt_keep"
    before, lora_before = snapshot(root), (loras(server) / "kt_keep.safetensors").read_bytes()

    # refused by its checks (another rank): nothing changes
    _, refused = server.run_prompt(
        training_graph(dataset, "kt_keep_b", resume_from=choices[0], **{**settings, "rank": 4})
    )
    assert "rank=2 but this run has rank=4" in error_of(refused)
    assert snapshot(root) == before

    # fails while training (its data becomes unreadable), under the same name
    graph = training_graph(dataset, "kt_keep", overwrite=True, resume_from=choices[0], **settings)
    graph["9"] = {"class_type": "KTTest_FailingDataset", "inputs": {"dataset": ["4", 0], "after_reads": 0}}
    graph["5"]["inputs"]["dataset"] = ["9", 0]
    _, failed = server.run_prompt(graph)
    assert "reading sample" in error_of(failed)
    after = snapshot(root)
    assert {k: after.get(k) for k in before} == before  # every checkpoint of the run is still there
    assert (loras(server) / "kt_keep.safetensors").read_bytes() == lora_before

    # resumed under another name: the original run and LoRA stay exactly as they were
    other_id, other = server.run_prompt(
        training_graph(dataset, "kt_keep_other", resume_from=choices[1], **settings)
    )
    succeeded(other)
    assert losses_of(server, other_id)[:4] == losses_of(server, first_id)[:4]
    assert snapshot(root) == after
    assert (loras(server) / "kt_keep.safetensors").read_bytes() == lora_before
    assert [c.rsplit("/", 1)[1] for c in checkpoint_choices(server, "kt_keep_other")] == ["step_000006"]


def test_a_resume_with_changed_settings_says_which_on_the_node(server, dataset):
    """Issue 32: a changed guidance or timestep shift continued silently, although the losses
    then differ from the uninterrupted run's. The node's progress line names each changed
    setting (the learning rate as accepted on purpose); an unchanged resume says nothing."""
    settings = {"steps": 2, "seed": 5}
    _, first = server.run_prompt(training_graph(dataset, "kt_notes", **settings))
    succeeded(first)
    (last,) = checkpoint_choices(server, "kt_notes")
    state = json.loads((checkpoints_root(server) / last / "state.json").read_text())
    assert state["config"]["base"]["plain"] and state["config"]["base"]["dynamic_vram"] is False
    graph = training_graph(
        dataset,
        "kt_notes",
        overwrite=True,
        resume_from=last,
        **{**settings, "steps": 3},
        guidance=3.5,
        shift=2.0,
        learning_rate=5e-4,
    )
    _, changed = server.run_prompt(graph)
    succeeded(changed)
    message = progress_events(changed)[0]["message"]
    assert message.startswith(
        "resumed from step 2 with changed settings: learning_rate 0.001 -> 0.0005 "
        "(accepted on purpose), shift 3.0 -> 2.0, guidance 1.0 -> 3.5; the "
        "continuation is no longer exactly the uninterrupted run's"
    ), message
    assert "estimated VRAM" in message  # the estimate follows
    _, same = server.run_prompt(
        training_graph(dataset, "kt_notes", overwrite=True, resume_from=last, **{**settings, "steps": 3})
    )
    succeeded(same)
    assert not [e for e in progress_events(same) if "changed settings" in e["message"]]


def test_keep_last_counts_the_whole_run_across_resumes(server, dataset):
    """Issue 32: with keep_last 2, a Cancel and a resume left 4 checkpoints and 4 snapshots,
    and each further resume added more. Now the resumed run counts its origin's: the
    checkpoint it resumed from goes only once 2 newer ones exist."""
    settings = {"steps": 40, "save_every": 1, "keep_last": 2, "seed": 6}
    cut = run_and_interrupt(server, training_graph(dataset, "kt_lineage", **settings), at_step=3)
    choice = progress_events(cut)[-1]["message"].split("resume from ")[1]
    stopped = int(choice.rsplit("_", 1)[1])
    assert len(checkpoint_choices(server, "kt_lineage")) == 2 and stopped < 38
    snapshots = loras(server) / "kt_lineage_steps"
    assert len(list(snapshots.iterdir())) == 2

    # a resume that ends after one new step: the checkpoint it resumed from is still kept
    _, short = server.run_prompt(
        training_graph(dataset, "kt_lineage", resume_from=choice, **{**settings, "steps": stopped + 1})
    )
    succeeded(short)
    steps = [c.rsplit("_", 1)[1] for c in checkpoint_choices(server, "kt_lineage")]
    assert steps == [f"{stopped:06d}", f"{stopped + 1:06d}"]
    # a further resume to the end: the two newest of the whole run, two runs' folders pruned
    _, done = server.run_prompt(
        training_graph(
            dataset,
            "kt_lineage",
            overwrite=True,
            resume_from=checkpoint_choices(server, "kt_lineage")[-1],
            **settings,
        )
    )
    succeeded(done)
    kept = checkpoint_choices(server, "kt_lineage")
    assert [c.rsplit("_", 1)[1] for c in kept] == ["000039", "000040"] and len(
        {c.split("/")[1] for c in kept}
    ) == 1
    assert len(list((checkpoints_root(server) / "kt_lineage").iterdir())) == 1  # emptied run folders go
    assert sorted(p.name for p in snapshots.iterdir()) == [  # the last step is the LoRA itself
        "kt_lineage-step00000038.safetensors",
        "kt_lineage-step00000039.safetensors",
    ]


def test_a_lora_saved_under_the_name_while_training_is_never_replaced(server, dataset):
    """Issue 32: two runs on one lora_name, overwrite off, both passed the check at their start
    and the later replaced the earlier's LoRA. The policy is checked again at the rename,
    atomically: the later run's LoRA takes the next free name, and says so."""
    lora = loras(server) / "kt_race.safetensors"
    other = loras(server) / "kt_race_other.safetensors"
    _, first = server.run_prompt(training_graph(dataset, "kt_race_other", steps=2))
    succeeded(first)

    def another_run_saves_the_name():  # as a CLI run of the same name finishing now
        lora.write_bytes(other.read_bytes())

    # 40 steps: the run is still training when the other LoRA lands (events come every 0.25 s)
    messages = run_and_act(
        server, training_graph(dataset, "kt_race", steps=40), 2, another_run_saves_the_name
    )
    succeeded(messages)
    assert lora.read_bytes() == other.read_bytes()  # the other run's LoRA is untouched
    renamed = loras(server) / "kt_race_2.safetensors"
    message = progress_events(messages)[-1]["message"]
    shown = renamed.relative_to(server.base_dir)  # the panel writes paths from ComfyUI's folder
    assert message.startswith(f"saved {shown}: kt_race.safetensors appeared while this run trained"), (
        message
    )
    assert "overwrite is off" in message
    tensors, metadata = load(renamed)
    assert tensors and metadata["ss_steps"] == "40"
    assert (loras(server) / "kt_race_2_loss.png").is_file() and not (
        loras(server) / "kt_race_loss.png"
    ).exists()
    prompt_id = messages[-1]["data"]["prompt_id"]
    assert server.history(prompt_id)["outputs"]["5"]["lora_name"] == ["kt_race_2.safetensors"]


def test_a_deleted_lora_makes_its_cached_prompt_train_again(server, dataset):
    """Issue 32: after the user deleted the LoRA, re-queueing the identical prompt 'succeeded'
    from ComfyUI's cache in 0.03 s and the file stayed gone. Unchanged, it is still answered
    from the cache."""
    graph = training_graph(dataset, "kt_cached", steps=2)
    lora = loras(server) / "kt_cached.safetensors"
    _, first = server.run_prompt(graph)
    succeeded(first)
    original, _ = load(lora)

    def trained(messages) -> bool:
        cached = {n for m in messages if m["type"] == "execution_cached" for n in m["data"]["nodes"]}
        return "5" not in cached and bool(progress_events(messages))

    _, again = server.run_prompt(graph)
    succeeded(again)
    assert not trained(again)  # the file is there: the cache answers
    lora.unlink()
    _, after_delete = server.run_prompt(graph)
    succeeded(after_delete)
    assert trained(after_delete)
    again_tensors, _ = load(lora)  # the same seed: the same LoRA
    assert set(again_tensors) == set(original) and all(
        torch.equal(again_tensors[k], original[k]) for k in original
    )
    _, once_more = server.run_prompt(graph)
    succeeded(once_more)
    assert not trained(once_more)


def test_a_cancelled_overwrite_keeps_the_replaced_runs_snapshots(server, dataset):
    """Issue 32: with overwrite on, a new run that failed or was cancelled after its first
    snapshot had already deleted the old run's snapshots. Now they are set aside in
    <name>_steps/replaced_<time>/ and go only when a run of the name saves its LoRA."""
    _, old = server.run_prompt(training_graph(dataset, "kt_aside", steps=3, save_every=1, keep_last=0))
    succeeded(old)
    folder = loras(server) / "kt_aside_steps"
    old_files = {p.name: p.read_bytes() for p in folder.iterdir()}
    old_lora = (loras(server) / "kt_aside.safetensors").read_bytes()
    assert len(old_files) == 2

    settings = {"steps": 40, "save_every": 1, "keep_last": 0, "seed": 9}
    cut = run_and_interrupt(
        server, training_graph(dataset, "kt_aside", overwrite=True, **settings), at_step=3
    )
    assert cut[-1]["type"] == "execution_interrupted", cut[-1]
    message = progress_events(cut)[-1]["message"]
    (aside,) = [p for p in folder.iterdir() if p.is_dir()]
    assert f"the replaced run's snapshots are kept in kt_aside_steps/{aside.name}" in message, message
    assert {p.name: p.read_bytes() for p in aside.iterdir()} == old_files
    assert (loras(server) / "kt_aside.safetensors").read_bytes() == old_lora
    listed = combo_options(server, "LoraLoader", "lora_name")
    assert f"kt_aside_steps/{aside.name}/kt_aside-step00000001.safetensors" in listed  # still loadable

    choice = message.split("resume from ")[1]
    _, resumed = server.run_prompt(
        training_graph(dataset, "kt_aside", overwrite=True, resume_from=choice, **settings)
    )
    succeeded(resumed)
    assert not aside.exists()  # replaced now: this run's LoRA is saved
    assert len([p for p in folder.iterdir() if p.is_file()]) == 39  # steps 1..39; 40 is the LoRA


LORA_TENSORS = (".lora_down.weight", ".lora_up.weight", ".lora_A.weight", ".lora_B.weight", ".alpha")


def test_lora_lists_hold_only_loras_and_the_step_snapshots(server, dataset):
    _, messages = server.run_prompt(
        training_graph(dataset, "kt_listed", steps=3, save_every=1, keep_last=0, save_precision="fp16")
    )
    succeeded(messages)
    assert len(checkpoint_choices(server, "kt_listed")) == 3  # the run did write checkpoints
    snapshots = [
        "kt_listed_steps/kt_listed-step00000001.safetensors",
        "kt_listed_steps/kt_listed-step00000002.safetensors",
    ]
    for node_type, field in (("LoraLoaderModelOnly", "lora_name"), ("LoraLoader", "lora_name")):
        listed = combo_options(server, node_type, field)
        assert "kt_listed.safetensors" in listed and set(snapshots) <= set(listed)
        assert not [name for name in listed if name.startswith("kt_listed_steps/") and name not in snapshots]
        for name in listed:
            tensors, _ = load(loras(server) / name)
            assert tensors, name
            assert all(k.endswith(LORA_TENSORS) for k in tensors), name
    # each snapshot is the LoRA at its step, in the save precision, and the stock loader applies it
    for step, name in enumerate(snapshots, start=1):
        tensors, metadata = load(loras(server) / name)
        assert metadata["ss_steps"] == str(step) and metadata["ss_output_name"] == "kt_listed"
        assert {t.dtype for k, t in tensors.items() if not k.endswith(".alpha")} == {torch.float16}
    first, _ = load(loras(server) / snapshots[0])
    final, _ = load(loras(server) / "kt_listed.safetensors")
    assert set(first) == set(final) and any(not torch.equal(first[k], final[k]) for k in first)
    probe = {
        "1": {"class_type": "KTTest_TinyFluxModel", "inputs": {"seed": 3}},
        "2": {
            "class_type": "LoraLoaderModelOnly",
            "inputs": {"model": ["1", 0], "lora_name": snapshots[1], "strength_model": 1.0},
        },
        "3": {"class_type": "KTTest_ModelDifference", "inputs": {"model_a": ["2", 0], "model_b": ["1", 0]}},
    }
    probe_id, probe_messages = server.run_prompt(probe)
    succeeded(probe_messages)
    assert server.history(probe_id)["outputs"]["3"]["difference"][0] > 0  # the snapshot changes the model

    # a new run never mixes its snapshots with an earlier run's of the same name
    (loras(server) / "kt_listed.safetensors").unlink()  # as a cancelled run leaves them: no LoRA
    _, refused = server.run_prompt(training_graph(dataset, "kt_listed", steps=5, save_every=2))
    assert "kt_listed_steps holds the per-step snapshots of an earlier run" in error_of(refused)
    assert (loras(server) / snapshots[0]).exists()  # refused: nothing touched
    _, again = server.run_prompt(
        training_graph(dataset, "kt_listed", steps=5, save_every=2, keep_last=1, overwrite=True, seed=7)
    )
    succeeded(again)
    folder = loras(server) / "kt_listed_steps"
    # the earlier run's two are gone, this run's step 2 was pruned (keep_last 1), step 4 stays
    assert sorted(p.name for p in folder.iterdir()) == ["kt_listed-step00000004.safetensors"]
    _, metadata = load(folder / "kt_listed-step00000004.safetensors")
    assert json.loads(metadata["kontext_trainer.config"])["seed"] == 7


def test_an_existing_lora_is_never_replaced_silently(server, dataset):
    lora = loras(server) / "kt_twice.safetensors"
    _, first = server.run_prompt(training_graph(dataset, "kt_twice", steps=2))
    succeeded(first)
    original = lora.read_bytes()

    _, again = server.run_prompt(training_graph(dataset, "kt_twice", steps=2, seed=1))
    message = error_of(again)
    assert "kt_twice.safetensors already exists" in message and "overwrite" in message
    assert lora.read_bytes() == original

    _, replaced = server.run_prompt(training_graph(dataset, "kt_twice", overwrite=True, steps=2, seed=1))
    succeeded(replaced)
    assert "replaced the previous file" in progress_events(replaced)[-1]["message"]
    assert lora.read_bytes() != original

    # two TrainLoRA nodes of one workflow with one name: refused before either trains
    graph = training_graph(dataset, "kt_pair", steps=2)
    graph["9"] = {**graph["5"], "inputs": {**graph["5"]["inputs"], "seed": 1}}
    _, pair = server.run_prompt(graph)
    assert "TrainLoRA nodes 5, 9 of this workflow all save as 'kt_pair.safetensors'" in error_of(pair)
    assert not (loras(server) / "kt_pair.safetensors").exists()
    assert not (checkpoints_root(server) / "kt_pair").exists()
