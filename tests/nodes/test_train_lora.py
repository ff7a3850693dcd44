"""TrainLoRA in the real runtime, run through ComfyUI's own executor (inference mode, prompt
thread, hidden inputs): files, outputs, resume, cancel, NaN, names, the overwrite policy, one
job at a time, and the event constants shared with the web extension."""

from __future__ import annotations

import dataclasses
import json
import re
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from kt_testing.datasets import write_one_folder
from kt_testing.executor import InGraph, PromptRejected, run_node
from kt_testing.graphs import cache_name, dataset_inputs, preview_inputs
from kt_testing.paths import REPO_ROOT
from kt_testing.probes import model_output
from kt_testing.tiny_models import small_flux_vae, tiny_clip, tiny_flux_patcher

TRAIN = "KontextTrainer_TrainLoRA"


@pytest.fixture(scope="module")
def mods(pack_import):
    names = {
        "node": "nodes.train_lora",
        "data": "nodes.load_kontext_dataset",
        "job": "trainer_core.job",
        "events": "nodes.progress_events",
        "checkpoint": "trainer_core.checkpoint",
        "config": "trainer_core.config",
    }
    return type("Mods", (), {key: pack_import(name) for key, name in names.items()})


@pytest.fixture(scope="module")
def dataset_files(tmp_path_factory):
    root = write_one_folder(
        tmp_path_factory.mktemp("data") / "set", ["a", "b", "c"], references=1, size=(64, 64)
    )
    return root, cache_name(tmp_path_factory)


def load_dataset(dataset_files, **options):
    vae, clip = InGraph(lambda: small_flux_vae(seed=1)), InGraph(lambda: tiny_clip(seed=2))
    inputs = {**dataset_inputs(vae, clip, *dataset_files), **options}
    return run_node("KontextTrainer_LoadKontextDataset", inputs).outputs[0]


@pytest.fixture(scope="module")
def dataset(mods, dataset_files):
    return load_dataset(dataset_files)


def settings(mods, **overrides):
    defaults = {f.name: f.default for f in dataclasses.fields(mods.config.TrainConfig)}
    defaults.update(steps=4, rank=2, alpha=2.0, learning_rate=1e-3, gradient_checkpointing=False)
    defaults.update(overrides)
    return defaults


def run_train(mods, dataset, name, resume="none", overwrite=False, preview=None, **overrides):
    """TrainLoRA through ComfyUI's executor, on a tiny Flux built inside it (like a loader's)."""
    inputs = {
        "model": InGraph(lambda: tiny_flux_patcher(seed=3)),
        "dataset": dataset,
        "lora_name": name,
        "overwrite": overwrite,
        "resume_from": resume,
        "preview": preview,
        **settings(mods, **overrides),
    }
    return run_node(TRAIN, inputs, node_id="7", extra_pnginfo={"workflow": {"id": "wf-test"}})


def train(mods, dataset, name, **kwargs):
    return run_train(mods, dataset, name, **kwargs).outputs[:3]  # MODEL, name, loss map


def loras_dir():
    import folder_paths

    return Path(folder_paths.get_folder_paths("loras")[0])


def checkpoints_dir(name):
    import folder_paths

    return Path(folder_paths.get_output_directory()) / "kontext_trainer_checkpoints" / name


def test_trains_saves_and_outputs_the_trained_model(mods, dataset, comfy_runtime):
    result = run_train(mods, dataset, "kt_node_run", steps=3)
    model, name, loss_map = result.outputs[:3]
    assert name == "kt_node_run.safetensors" and (loras_dir() / name).is_file()
    assert len(loss_map["loss"]) == 3 and result.ui["loss"] == loss_map["loss"]
    events = result.events(mods.events.PROGRESS_EVENT)
    assert events[-1]["status"] == "finished" and events[-1]["workflow_id"] == "wf-test"
    assert events[-1]["node"] == "7" and events[-1]["prompt_id"] == result.prompt_id
    # The output MODEL is the input with the saved file applied the stock way.
    stock = run_node(
        "LoraLoaderModelOnly",
        {"model": InGraph(lambda: tiny_flux_patcher(seed=3)), "lora_name": name, "strength_model": 1.0},
    ).outputs[0]
    # conditioning as the tiny CLIP makes it: 77 tokens of 48, pooled 48
    outputs = [model_output(patcher, text=(77, 48), pooled=48) for patcher in (model, stock)]
    assert torch.equal(outputs[0], outputs[1])


def test_comfyuis_own_bar_moves_with_the_panels_events(mods, dataset):
    """ComfyUI's progress bar on the node (its "progress" message, which every open page
    redraws for) is updated when the panel's event goes out, not on every poll of the run: at
    most one message per event, and the last at the final step. Updated on every poll (0.1 s),
    as before, this run sent 54 messages against 18 events on ComfyUI 0.3.75 (it sends one per
    update) and 39 against 14 on 0.33 (its own throttle, 0.1 s, lets the polls through): the
    assertion fails (measured with the per-poll update put back); now 18 and 18, 15 and 15."""
    result = run_train(mods, dataset, "kt_node_bar", steps=80)
    events = result.events(mods.events.PROGRESS_EVENT)
    bar = [(p["value"], p["max"]) for p in result.events("progress") if p["node"] == "7"]
    print(f"\n{len(bar)} progress messages, {len(events)} events")
    assert bar and bar[-1] == (80, 80), bar
    assert len(bar) <= len(events), (bar, len(events))


def test_loss_chart_output_and_file(mods, dataset):
    outputs = run_train(mods, dataset, "kt_chart", steps=3).outputs
    previews, chart = outputs[3], outputs[4]
    assert previews.shape == (1, 64, 64, 3) and float(previews.abs().max()) == 0  # no PreviewSampler: black
    assert (
        chart.shape == (1, 256, 512, 3)
        and chart.dtype == torch.float32
        and 0 <= chart.min() <= chart.max() <= 1
    )
    from PIL import Image

    saved = torch.from_numpy(
        np.asarray(Image.open(loras_dir() / "kt_chart_loss.png"), dtype=np.float32) / 255
    )
    assert torch.equal(saved[None], chart)


def test_the_lora_is_flushed_whole_under_a_temp_name_then_published_with_the_umask(
    mods, dataset, monkeypatch
):
    """The LoRA gets its name in models/loras (which every LoraLoader lists) only once it is whole
    on disk: flushed (`os.fsync`) under its hidden temp name, then renamed (the inode keeps),
    with ComfyUI's permissions, 0666 minus the umask (safetensors alone writes 0600). The
    writer's own test is tests/trainer_core/test_atomic_flush.py; this one is the node's file."""
    import os
    import stat

    lora = loras_dir() / "kt_flushed.safetensors"
    seen, real = [], os.fsync

    def fsync(fd):
        size = os.fstat(fd).st_size
        seen.append((os.fstat(fd).st_ino, os.pread(fd, size, 0), lora.exists()))
        return real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    previous = os.umask(0o027)
    try:
        train(mods, dataset, "kt_flushed", steps=2)
    finally:
        os.umask(previous)
    flushed = (lora.stat().st_ino, lora.read_bytes(), False)  # the LoRA, whole, before it had its name
    assert flushed in seen, "the LoRA was not flushed whole under its temp name"
    assert stat.S_IMODE(lora.stat().st_mode) == 0o640


def test_widgets_come_from_the_config_and_the_widget_schema(mods, pack_import):
    schema = mods.node.TrainLoRA.define_schema()
    widgets = {i.id: i for i in schema.inputs}
    rows = pack_import("application.widget_schema").TRAIN_LORA
    sockets = ("model", "dataset", "preview")
    assert [i.id for i in schema.inputs if i.id not in sockets] == [row.name for row in rows]
    for row in rows:
        assert widgets[row.name].tooltip == row.tooltip
        assert widgets[row.name].as_dict().get("advanced", False) == row.advanced, row.name
        assert widgets[row.name].optional == row.optional, row.name
    for f in dataclasses.fields(mods.config.TrainConfig):  # defaults and limits: the config's
        assert widgets[f.name].default == f.default, f.name
        assert (widgets[f.name].as_dict().get("min"), widgets[f.name].as_dict().get("max")) == (
            f.metadata.get("min"),
            f.metadata.get("max"),
        ), f.name
    assert widgets["targets"].options == ["attention", "attention_mlp", "all_linear"]
    # the order saved workflows rely on: the first widgets, then those added after `overwrite`,
    # then those added after `start_from_lora`
    order = [i.id for i in schema.inputs if i.id not in ("model", "dataset", "preview")]
    before = order[: order.index("overwrite") + 1]
    assert before[:2] == ["lora_name", "resume_from"] and len(before) == 32
    assert order[order.index("overwrite") + 1 :] == [
        "validate_every",
        "reference_dropout",
        "lr_floor",
        "start_from_lora",
        "save_precision",
    ]
    visible = [name for name in order if not widgets[name].as_dict().get("advanced")]
    assert len(visible) <= 17, visible


def test_resume_continues_with_identical_losses(mods, dataset):
    _, _, uninterrupted = train(mods, dataset, "kt_resume_a", steps=6, save_every=3, dropout=0.1, seed=5)
    choices = [c for c in mods.node.resume_choices() if c.startswith("kt_resume_a/")]
    # one run folder, with the step-3 checkpoint and the final step (a finished run can go on)
    assert [c.rsplit("/", 1)[1] for c in choices] == ["step_000003", "step_000006"]
    checkpoint, final = choices
    _, _, resumed = train(
        mods, dataset, "kt_resume_b", resume=checkpoint, steps=6, save_every=3, dropout=0.1, seed=5
    )
    assert resumed["loss"] == uninterrupted["loss"]  # steps 1-3 from the checkpoint, 4-6 trained again
    _, _, extended = train(
        mods,
        dataset,
        "kt_resume_a",
        resume=final,
        overwrite=True,
        steps=8,
        save_every=3,
        dropout=0.1,
        seed=5,
    )
    assert extended["loss"][:6] == uninterrupted["loss"] and len(extended["loss"]) == 8
    # every run kept its own checkpoints: the resumed-from run still has steps 3 and 6
    assert [c for c in mods.node.resume_choices() if c.startswith("kt_resume_a/")][:2] == choices
    with pytest.raises(ValueError, match="checkpoint was trained with rank=2 but this run has rank=4"):
        train(mods, dataset, "kt_resume_c", resume=checkpoint, steps=6, rank=4, seed=5)
    with pytest.raises(ValueError, match="optimizer='adamw' but this run has optimizer='adafactor'"):
        train(mods, dataset, "kt_resume_c", resume=checkpoint, steps=6, optimizer="adafactor", seed=5)


def test_checkpoints_of_the_old_folders_still_resume(mods, dataset):
    """Before 5263cc3 (CHANGELOG.md), checkpoints lived in models/loras/<name>_checkpoints/
    (where they filled the LoRA lists): they are still offered, and resume exactly."""
    import shutil

    _, _, uninterrupted = train(mods, dataset, "kt_legacy", steps=4, save_every=2, seed=2)
    run = next(checkpoints_dir("kt_legacy").iterdir())
    legacy = loras_dir() / "kt_legacy_checkpoints" / run.name
    shutil.copytree(run, legacy)
    try:
        choice = f"models/loras/kt_legacy_checkpoints/{run.name}/step_000002"
        assert choice in mods.node.resume_choices()
        _, _, resumed = train(mods, dataset, "kt_legacy_b", resume=choice, steps=4, save_every=2, seed=2)
        assert resumed["loss"] == uninterrupted["loss"]
    finally:
        shutil.rmtree(legacy.parent)


def test_a_damaged_checkpoint_is_not_offered_and_is_refused_by_file(mods, dataset, caplog):
    """A checkpoint whose optimizer file a crash truncated: resume_from no longer lists it (the
    log names the file), and a prompt that still names it is refused in one line naming the
    file, before anything trains (the command line: tests/application/test_headless.py)."""
    train(mods, dataset, "kt_damaged", steps=2, save_every=1, seed=2)
    run = next(checkpoints_dir("kt_damaged").iterdir())
    choices = [c for c in mods.node.resume_choices() if c.startswith("kt_damaged/")]
    assert [c.rsplit("/", 1)[1] for c in choices] == ["step_000001", "step_000002"]
    broken = run / "step_000001" / "optimizer.safetensors"
    broken.write_bytes(broken.read_bytes()[:100])
    with caplog.at_level("WARNING", logger="kontext_trainer"):
        choices = [c for c in mods.node.resume_choices() if c.startswith("kt_damaged/")]
    assert [c.rsplit("/", 1)[1] for c in choices] == ["step_000002"]
    assert f"not offered in resume_from: {broken}: it is not a readable safetensors file" in caplog.text
    # a prompt that still names it (queued before, or by API) is refused before anything trains:
    # by ComfyUI's validation where it checks the choice against the list (0.33), else by the
    # run in one line naming the file (0.3.75)
    message = rf"^{re.escape(str(broken))}: it is not a readable safetensors file .* resume another one"
    with pytest.raises((ValueError, PromptRejected)) as refused:
        train(mods, dataset, "kt_damaged_b", resume=f"kt_damaged/{run.name}/step_000001", steps=2)
    if isinstance(refused.value, PromptRejected):
        assert "resume_from" in str(refused.value) and "not in" in str(refused.value)
    else:
        assert re.search(message, str(refused.value)), refused.value
    assert not (loras_dir() / "kt_damaged_b.safetensors").exists()


def test_a_resume_choice_leading_out_of_the_checkpoint_folders_is_refused(mods, dataset, tmp_path):
    """resume_from reads only the trainer's checkpoints: a prompt whose choice leads out of
    output/kontext_trainer_checkpoints (by `..`, or through a link inside it) is refused before
    anything is read, although a checkpoint that would resume lies there: by ComfyUI's
    validation where it checks the choice against the list (0.33), else by the run (0.3.75)."""
    import os
    import shutil

    train(mods, dataset, "kt_confined", steps=2, save_every=2, seed=2)
    (run,) = checkpoints_dir("kt_confined").iterdir()
    elsewhere = tmp_path / "elsewhere"
    shutil.copytree(run, elsewhere / run.name)  # a whole checkpoint, outside
    root = checkpoints_dir("kt_confined").parent.resolve()
    link = root / "kt_confined_link"
    link.symlink_to(elsewhere, target_is_directory=True)
    try:
        for choice in (
            os.path.relpath(elsewhere / run.name / "step_000002", root),
            f"{link.name}/{run.name}/step_000002",
        ):
            with pytest.raises((ValueError, PromptRejected)) as refused:
                train(mods, dataset, "kt_confined_b", resume=choice, steps=4, save_every=2, seed=2)
            if isinstance(refused.value, PromptRejected):
                assert "resume_from" in str(refused.value) and "not in" in str(refused.value)
            else:
                assert str(refused.value) == (
                    f"resume_from: '{choice}' is not a checkpoint of Kontext Trainer ({root})"
                )
    finally:
        link.unlink()
    assert not (loras_dir() / "kt_confined_b.safetensors").exists()


def test_a_resume_on_another_hold_out_is_refused_even_when_the_dataset_hash_is_the_same(
    mods, dataset, dataset_files
):
    """Holding out the dataset's last sample keeps its content hash (training and held-out
    samples hash as one sequence), yet the resumed run would train on one sample fewer and
    validate on one it trained on: refused by name."""
    import torch

    last_only = [
        s for s in range(100) if torch.randperm(3, generator=torch.Generator().manual_seed(s))[0] == 2
    ]
    held_out = load_dataset(dataset_files, hold_out=1, seed=last_only[0])  # holds out c, the last
    assert held_out.content_hash == dataset.content_hash and held_out.held_out_hash != dataset.held_out_hash
    train(mods, dataset, "kt_hold_out", steps=2, save_every=1, seed=2)
    (first, _) = [c for c in mods.node.resume_choices() if c.startswith("kt_hold_out/")]
    with pytest.raises(ValueError, match="held out other samples for validation"):
        train(mods, held_out, "kt_hold_out_b", resume=first, steps=2, save_every=1, seed=2)


def test_runs_under_one_name_keep_their_own_checkpoints(mods, dataset):
    train(mods, dataset, "kt_two_runs", steps=4, save_every=1, keep_last=2)
    train(mods, dataset, "kt_two_runs", overwrite=True, steps=2, save_every=1, keep_last=2)
    runs = sorted(checkpoints_dir("kt_two_runs").iterdir())
    assert len(runs) == 2
    kept = [[p.name for p in mods.checkpoint.list_checkpoints(run)] for run in runs]
    assert kept == [["step_000003", "step_000004"], ["step_000001", "step_000002"]]
    assert not list(loras_dir().glob("kt_two_runs_checkpoints"))  # nothing where LoRA lists look


def test_a_resume_whose_checkpoint_keep_last_pruned_names_the_choice_that_replaces_it(mods, dataset):
    """Issue 45 item 4: keep_last counts the run a resume continues, so it can prune the
    checkpoint the run resumed from; the run's last event then names the choice that takes its
    place in resume_from (the run's newest checkpoint) and its message says why, and that
    choice is in the list the next Run validates against. A resume whose checkpoint stays
    names nothing."""
    train(mods, dataset, "kt_pruned", steps=2, save_every=1, keep_last=2)
    choices = [c for c in mods.node.resume_choices() if c.startswith("kt_pruned/")]
    first = choices[0]  # step 1: pruned once the resumed run has written two newer ones
    settings = {"overwrite": True, "steps": 4, "save_every": 1, "keep_last": 2}
    result = run_train(mods, dataset, "kt_pruned", resume=first, **settings)
    final = result.events(mods.events.PROGRESS_EVENT)[-1]
    newest = [c for c in mods.node.resume_choices() if c.startswith("kt_pruned/")][-1]
    assert first not in mods.node.resume_choices()
    assert final["resume_next"] == newest and newest.endswith("step_000004"), final
    assert final["message"].endswith(
        f"keep_last pruned the checkpoint this run resumed from: resume_from is now {newest}"
    )
    kept = run_train(mods, dataset, "kt_pruned", resume=newest, overwrite=True, steps=5, keep_last=0)
    assert kept.events(mods.events.PROGRESS_EVENT)[-1]["resume_next"] == ""


def test_an_existing_lora_needs_overwrite(mods, dataset):
    train(mods, dataset, "kt_exists", steps=1)
    before = (loras_dir() / "kt_exists.safetensors").read_bytes()
    with pytest.raises(ValueError, match=r"kt_exists\.safetensors already exists.*turn on overwrite"):
        train(mods, dataset, "kt_exists", steps=1, seed=9)
    assert (loras_dir() / "kt_exists.safetensors").read_bytes() == before
    result = run_train(mods, dataset, "kt_exists", overwrite=True, steps=1, seed=9)
    assert "replaced the previous file" in result.events(mods.events.PROGRESS_EVENT)[-1]["message"]
    assert (loras_dir() / "kt_exists.safetensors").read_bytes() != before


def test_cancel_stops_at_a_step_writes_a_checkpoint_and_the_next_run_works(mods, dataset):
    import comfy.model_management

    def press_cancel():
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            job = mods.job.MANAGER.current
            if job is not None and job.name == "kt_cancel" and job.snapshot().step >= 2:
                comfy.model_management.interrupt_current_processing(True)
                return
            time.sleep(0.01)

    presser = threading.Thread(target=press_cancel)
    presser.start()
    with pytest.raises(comfy.model_management.InterruptProcessingException):
        train(mods, dataset, "kt_cancel", steps=10_000)
    presser.join()
    job = mods.job.MANAGER.current
    assert not job.running and job.snapshot().status == "cancelled", (job.error, job.snapshot())
    saved = mods.checkpoint.all_checkpoints(checkpoints_dir("kt_cancel"))
    assert len(saved) == 1
    stopped_at = mods.checkpoint.load_checkpoint(saved[0], []).step
    assert 2 <= stopped_at < 10_000
    assert job.snapshot().message.endswith(f"resume from kt_cancel/{saved[0].parent.name}/{saved[0].name}")
    assert not (loras_dir() / "kt_cancel.safetensors").exists()
    _, _, losses = train(mods, dataset, "kt_after_cancel", steps=2)  # the next prompt runs normally
    assert len(losses["loss"]) == 2


def test_nan_loss_stops_and_keeps_the_last_good_checkpoint(mods, dataset):
    poisoned = dataclasses.replace(dataset, entries=list(dataset.entries))
    entry = poisoned.entries[1]
    latent = poisoned.cache.load("latents", entry.target_key)["latent"]
    poisoned.cache.put("latents", "f" * 64, {"latent": torch.full_like(latent, float("nan"))})
    poisoned.entries[1] = dataclasses.replace(entry, target_key="f" * 64)
    with pytest.raises(Exception, match=r"the loss became nan at step (\d+)") as caught:
        train(mods, poisoned, "kt_nan", steps=20, save_every=1, batch_size=1)
    step = int(re.search(r"step (\d+)", str(caught.value)).group(1))
    saved = mods.checkpoint.all_checkpoints(checkpoints_dir("kt_nan"))
    if step > 1:
        last = mods.checkpoint.load_checkpoint(saved[-1], [])
        assert last.step == step - 1 and all(torch.isfinite(torch.tensor(last.losses)))
    assert not (loras_dir() / "kt_nan.safetensors").exists()


@pytest.mark.parametrize("name", ["../escape", "sub/dir", "CON", ""])
def test_bad_names_are_refused_before_training(mods, dataset, name):
    with pytest.raises(ValueError, match="lora_name"):
        train(mods, dataset, name, steps=1)


def test_one_training_at_a_time(mods):
    release = threading.Event()
    first = mods.job.MANAGER.start("kt_blocker", lambda job: release.wait(30))
    try:
        with pytest.raises(RuntimeError, match="a training is already running \\(LoRA 'kt_blocker'"):
            mods.job.MANAGER.start("kt_second", lambda job: None)
    finally:
        release.set()
        first.thread.join()


def test_event_constants_match_the_web_extension(mods):
    source = (REPO_ROOT / "web" / "js" / "training_events.js").read_text()
    assert re.search(r'PROGRESS_EVENT = "([^"]+)"', source).group(1) == mods.events.PROGRESS_EVENT

    def js_list(name):
        body = re.search(rf"{name} = \[(.*?)\];", source, re.S).group(1)
        return json.loads(f"[{body.strip().rstrip(',')}]")

    assert js_list("STATUSES") == list(mods.events.STATUSES)
    assert js_list("PAYLOAD_FIELDS") == list(mods.events.PAYLOAD_FIELDS)
    progress_fields = [f.name for f in dataclasses.fields(mods.job.Progress)]
    assert set(mods.events.PAYLOAD_FIELDS) == {
        "node",
        "prompt_id",
        "workflow_id",
        "lora_name",
        *progress_fields,
    }


def test_previews_do_not_change_the_run(mods, dataset, monkeypatch):
    """Sampling previews between steps (own noise generator, global RNG restored) leaves the
    training losses exactly as without previews; the preview rounds come out as IMAGE and the
    node lists each round's images with their step."""
    clip = tiny_clip(seed=2)
    positive = clip.encode_from_tokens_scheduled(clip.tokenize("make it blue"))
    vae = InGraph(lambda: small_flux_vae(seed=1))
    preview = run_node("KontextTrainer_PreviewSampler", preview_inputs(positive, vae, 2)).outputs[0]
    reported = []  # the previews listed by every progress report of the job, in order
    report = mods.job.TrainingJob.report

    def recording_report(job, *args, **fields):
        report(job, *args, **fields)
        reported.append([p["step"] for p in job.snapshot().previews])

    monkeypatch.setattr(mods.job.TrainingJob, "report", recording_report)
    common = {"steps": 4, "dropout": 0.1, "seed": 3}
    plain = run_train(mods, dataset, "kt_no_preview", **common).outputs
    with_previews = run_train(mods, dataset, "kt_preview", preview=preview, **common).outputs
    assert with_previews[2]["loss"] == plain[2]["loss"]
    images = with_previews[3]  # the rounds at step 2 and at the end, one prompt each
    assert images.shape == (2, 64, 64, 3) and torch.isfinite(images).all() and float(images.std()) > 0
    job_previews = mods.job.MANAGER.current.snapshot().previews
    assert [p["step"] for p in job_previews] == [2, 4] and job_previews[0]["type"] == "temp"
    first = reported.index([2])  # the step-2 round stays listed at every later report
    assert all(steps[:1] == [2] for steps in reported[first:]) and reported[-1] == [2, 4]
