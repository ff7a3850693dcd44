"""What a checkpoint says it was trained on, and what a resume makes of it.

A checkpoint's run record (`resume.run_record`) carries `trained_on`: the model entry (its
family's title: "FLUX.1", "FLUX.2 [klein] 4B", "Qwen-Image-Edit 2511", ...), the base model's
file name (where the graph or the run file names one) with a cheap fingerprint of its weights
as loaded, and the VAE's and the text encoder's names and fingerprints (the ones the dataset
cache keys on). A resume on another model entry is refused first, naming both; another base
file of the same model resumes with a note the user sees; a checkpoint written before the
record resumes with a note that its base cannot be checked.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

NOT_EXACT = "the continuation is no longer exactly the uninterrupted run's"


@dataclass(frozen=True)
class Weights:
    """One set of weights: its file's name ("" where the graph built it or does not say) and
    the fingerprint of what was loaded."""

    name: str
    fingerprint: str

    def describe(self) -> str:
        short = self.fingerprint[:8]
        return f"{self.name} (weights {short})" if self.name else f"weights {short} (no file named)"


@dataclass(frozen=True)
class TrainedOn:
    model: str  # the model entry's title
    base: Weights
    vae: Weights | None = None
    text_encoder: Weights | None = None
    # the base files of the steps before this run's (a resume on another base file): oldest first
    earlier_bases: tuple[dict, ...] = ()

    def record(self) -> dict:
        return asdict(self)


def read(saved: dict | None) -> TrainedOn | None:
    """The record of a checkpoint's state.json "config" (`saved`), or None where it predates it."""
    found = (saved or {}).get("trained_on")
    if not isinstance(found, dict) or "model" not in found:
        return None

    def weights(value) -> Weights | None:
        return Weights(str(value.get("name", "")), str(value.get("fingerprint", ""))) if value else None

    return TrainedOn(
        str(found["model"]),
        weights(found.get("base")),
        weights(found.get("vae")),
        weights(found.get("text_encoder")),
        tuple(found.get("earlier_bases", ())),
    )


def check_model(saved: dict, current: TrainedOn) -> None:
    """Refuse a resume on another model entry, naming both (before any other setting is
    compared: the layout, the dataset and the LoRA's layers all follow from the model)."""
    before = read(saved)
    if before is not None and before.model != current.model:
        raise ValueError(
            f"resume_from: the checkpoint trained a {before.model} LoRA (on {before.base.describe()}) "
            f"and this MODEL is {current.model} (on {current.base.describe()}); load the "
            f"{before.model} model to resume it, or set resume_from to none to start a new run"
        )


def check_encoders(saved: dict, current: TrainedOn) -> None:
    """Refuse a resume whose dataset was encoded by another VAE or text encoder, naming both
    (the dataset check would only say "another dataset")."""
    before = read(saved)
    if before is None:
        return
    for what, old, new in (
        ("VAE", before.vae, current.vae),
        ("text encoder", before.text_encoder, current.text_encoder),
    ):
        if old is not None and new is not None and old.fingerprint != new.fingerprint:
            raise ValueError(
                f"resume_from: the checkpoint's dataset was encoded by the {what} {old.describe()} "
                f"and this run's by {new.describe()}; load the {what} it was trained with to resume"
            )


def resume_notes(saved: dict, step: int, current: TrainedOn) -> tuple[list[str], TrainedOn]:
    """What a resume from `step` says about its base model (notes the panel and the command
    show first), and the record this run writes (with the checkpoint's base among the earlier
    ones where this run trains another file)."""
    before = read(saved)
    if before is None:
        return [
            f"resumed from step {step} of a checkpoint written before checkpoints recorded their "
            "base model: that it was trained on this model's file cannot be checked"
        ], current
    if before.base.fingerprint == current.base.fingerprint:
        return [], replace(current, earlier_bases=before.earlier_bases)
    earlier = (*before.earlier_bases, {**asdict(before.base), "until_step": step})
    note = (
        f"resumed from step {step} on another base model file: the checkpoint was trained on "
        f"{before.base.describe()}, this run trains on {current.base.describe()}; {NOT_EXACT}"
    )
    return [note], replace(current, earlier_bases=earlier)
