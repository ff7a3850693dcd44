"""What a resume must share with its checkpoint, and what a longer resumed run's schedule does."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from trainer_core.config import TrainConfig
from trainer_core.loop import ResumeState, train
from trainer_core.resume import (
    RESUME_FREE,
    RESUME_MUST_MATCH,
    RESUME_REPORTS,
    check_resume,
    continuation_notes,
    run_record,
    schedule_note,
)
from trainer_core.schedule import lr_multiplier


def state_of(config: TrainConfig, step: int, dataset_hash="d1") -> dict:
    return {"config": run_record(config, dataset_hash), "step": step}


# a value other than the default for each setting that decides the random draws
CHANGED = {
    "rank": 8,
    "alpha": 4.0,
    "targets": "attention",
    "layout": "index",
    "seed": 3,
    "batch_size": 2,
    "gradient_accumulation": 2,
    "optimizer": "adafactor",
    "timestep_sampler": "uniform",
    "caption_dropout": 0.1,
    "reference_dropout": 0.2,
    "ip_noise_gamma": 0.1,
    "dropout": 0.1,
}


def test_every_setting_that_shapes_the_run_must_match():
    assert set(CHANGED) | {"dataset_hash", "held_out", "world_size"} == set(RESUME_MUST_MATCH)
    saved = state_of(TrainConfig(steps=4), 2)
    check_resume(saved, TrainConfig(steps=8, learning_rate=5e-5), "d1")  # others may change
    for name, value in CHANGED.items():
        with pytest.raises(ValueError, match=rf"trained with {name}=.* but this run has {name}="):
            check_resume(saved, dataclasses.replace(TrainConfig(steps=8), **{name: value}), "d1")
    with pytest.raises(ValueError, match="another dataset"):
        check_resume(saved, TrainConfig(steps=8), "d2")
    with pytest.raises(ValueError, match="at step 2 and steps is 2; raise steps"):
        check_resume(saved, TrainConfig(steps=2), "d1")


def test_a_resume_needs_the_same_number_of_data_parallel_processes():
    saved = {"config": run_record(TrainConfig(steps=4), "d1", world_size=2), "step": 2}
    check_resume(saved, TrainConfig(steps=8), "d1", world_size=2)
    for other in (1, 4):
        with pytest.raises(
            ValueError, match=rf"trained by 2 data-parallel process\(es\) and this run has {other}"
        ):
            check_resume(saved, TrainConfig(steps=8), "d1", world_size=other)
    single = state_of(TrainConfig(steps=4), 2)
    del single["config"]["world_size"]  # checkpoints written before data parallelism: one process
    check_resume(single, TrainConfig(steps=8), "d1")
    with pytest.raises(ValueError, match="trained by 1 data-parallel"):
        check_resume(single, TrainConfig(steps=8), "d1", world_size=2)


def test_a_checkpoint_from_before_a_setting_existed_counts_as_its_default():
    saved = state_of(TrainConfig(steps=4), 2)
    del saved["config"]["reference_dropout"]
    check_resume(saved, TrainConfig(steps=8), "d1")
    with pytest.raises(ValueError, match=r"reference_dropout=0\.0 but this run has reference_dropout=0\.5"):
        check_resume(saved, TrainConfig(steps=8, reference_dropout=0.5), "d1")


def test_continuing_a_finished_run_with_more_steps_follows_the_longer_schedule():
    """Defined behaviour: step k of the continued run gets the rate a run planned for the new
    `steps` has at k (README, 'Resume and continue')."""
    first = TrainConfig(steps=4, learning_rate=0.1, schedule="cosine", seed=2)
    weight = torch.nn.Parameter(torch.zeros(3))

    def loss_fn(batch, generator):
        return ((weight - torch.randn(3, generator=generator)) ** 2).sum()

    done = train(first, [weight], lambda i: 1.0, loss_fn)
    longer = dataclasses.replace(first, steps=8)
    assert "continues as that of a 8-step run from step 4" in schedule_note(
        run_record(first, "d1"), 4, longer
    )
    assert schedule_note(run_record(first, "d1"), 4, first) == ""
    assert schedule_note(run_record(first, "d1"), 4, dataclasses.replace(longer, schedule="constant")) == ""
    rates = []
    resume = ResumeState(4, done.losses, done.optimizer.state_dict(), done.generator.get_state())
    train(longer, [weight], lambda i: 1.0, loss_fn, lambda info: rates.append(info.learning_rate), resume)
    assert rates == pytest.approx([0.1 * lr_multiplier(k, 8, 0, "cosine") for k in range(4, 8)])
    assert rates[0] == pytest.approx(0.05)  # back up from the first run's last rate (0.1 x 0.146)


def test_a_changed_hold_out_is_refused_and_older_checkpoints_are_not():
    saved = {"config": run_record(TrainConfig(steps=4), "d1", held_out="h1"), "step": 2}
    check_resume(saved, TrainConfig(steps=8), "d1", held_out="h1")
    with pytest.raises(ValueError, match="held out other samples for validation"):
        check_resume(saved, TrainConfig(steps=8), "d1", held_out="h2")
    # a checkpoint written before the split was recorded cannot say: its dataset hash decides
    older = {"config": {k: v for k, v in saved["config"].items() if k != "held_out"}, "step": 2}
    check_resume(older, TrainConfig(steps=8), "d1", held_out="h2")


# a value other than the default for each setting a resume may change, with the note it gets
REPORTED = {
    "learning_rate": 5e-5,
    "schedule": "cosine",
    "warmup_steps": 3,
    "lr_floor": 0.1,
    "weight_decay": 0.0,
    "max_grad_norm": 0.5,
    "logit_mean": 0.5,
    "logit_std": 0.5,
    "sigmoid_scale": 2.0,
    "shift": 1.0,
    "loss_weighting": "sigma_sqrt",
    "guidance": 3.5,
    "fp8_mode": "fp8_scaled",
}


def test_every_setting_is_matched_reported_or_free_on_resume():
    """A new TrainConfig field has to be put in one of the three (so no setting can change a
    continuation silently)."""
    names = [f.name for f in dataclasses.fields(TrainConfig)]
    classes = (set(CHANGED), set(RESUME_REPORTS), set(RESUME_FREE))
    assert sorted(names) == sorted(n for c in classes for n in c)
    assert set(REPORTED) == set(RESUME_REPORTS)


def test_a_resume_names_each_changed_setting_and_says_the_continuation_is_not_exact():
    saved = run_record(TrainConfig(steps=4), "d1", base={"quantized": {}, "plain": {"bfloat16": 8}})
    same = TrainConfig(steps=8)
    assert continuation_notes(saved, 2, same, saved["base"]) == []
    for name in RESUME_FREE:  # these leave every number as it was
        if name != "steps":
            value = {"gradient_checkpointing": False, "save_precision": "fp32"}.get(name, 2)
            assert continuation_notes(saved, 2, dataclasses.replace(same, **{name: value})) == [], name
    for name, value in REPORTED.items():
        note = continuation_notes(saved, 2, dataclasses.replace(same, **{name: value}))[0]
        assert f"resumed from step 2 with changed settings: {name} " in note, note
        assert f"-> {value!r}" in note and "no longer exactly the uninterrupted run's" in note
        assert ("accepted on purpose" in note) == (name == "learning_rate")
    both = continuation_notes(saved, 2, dataclasses.replace(same, guidance=3.5, learning_rate=5e-5))
    assert "learning_rate 0.0001 -> 5e-05 (accepted on purpose), guidance 1.0 -> 3.5" in both[0]
    # a setting the model does not read (klein's guidance) changes nothing: not reported
    klein = continuation_notes(saved, 2, dataclasses.replace(same, guidance=3.5), ignored=("guidance",))
    assert klein == []
    fp8 = {"quantized": {"float8_e4m3fn": 8}, "plain": {}, "dynamic_vram": True}
    (note,) = continuation_notes(saved, 2, same, fp8)
    assert "base weights [bfloat16 x8] -> [quantized float8_e4m3fn x8; dynamic VRAM]" in note
    older = {k: v for k, v in saved.items() if k not in ("base", "guidance")}  # recorded since
    assert continuation_notes(older, 2, same, fp8) == []  # a missing guidance counts as its default
    cosine = continuation_notes(run_record(TrainConfig(steps=4, schedule="cosine"), "d1"), 4, same)
    assert "schedule 'cosine' -> 'constant'" in cosine[0] and len(cosine) == 1
