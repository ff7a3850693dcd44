"""LoadKontextDataset in the real runtime with a real (small) Flux VAE and a real ComfyUI CLIP
object: both folder structures, named problems with nothing written, the cache across passes, encoder
identities, and a training step on what it loads."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest
import torch

from kt_testing.datasets import color_image, write_one_folder, write_parallel
from kt_testing.executor import run_node
from kt_testing.tiny_models import small_flux_vae, tiny_clip, tiny_flux_patcher


class Counting:
    """Counts calls of one bound method of a test-owned encoder object."""

    def __init__(self, owner, name):
        self.calls, self.inner = 0, getattr(owner, name)
        setattr(owner, name, self)

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.inner(*args, **kwargs)


@pytest.fixture(scope="module")
def node(pack):
    return importlib.import_module(f"{pack.__name__}.nodes.load_kontext_dataset")


@pytest.fixture(scope="module")
def encoders():
    return {"vae": small_flux_vae(seed=1), "clip": tiny_clip(seed=2)}


@pytest.fixture
def input_dir(comfy_runtime):
    import folder_paths

    return Path(folder_paths.get_input_directory())


def cache_in(tmp_path) -> Path:
    """A cache folder of this test's own in ComfyUI's output folder (the node writes nowhere else)."""
    import folder_paths

    return Path(folder_paths.get_output_directory()) / "kt_test_caches" / tmp_path.name


def run(node, encoders, folder="", path="", cache="", **overrides):
    kwargs = {
        "folder": folder or node.USE_PATH,
        "path": str(path),
        "resolution": 256,
        "reference_resolution": 128,
        "min_size": 32,
        "background": "white",
        "hold_out": 0,
        "seed": 0,
        "cache_folder": str(cache),
    }
    kwargs.update(overrides)
    inputs = {"vae": encoders["vae"], "clip": encoders["clip"], **kwargs}
    return run_node(node.LoadKontextDataset, inputs).outputs


def test_one_folder_in_the_input_directory(node, encoders, input_dir, tmp_path):
    write_one_folder(input_dir / "kt_one", ["cat", "dog"], references=2, size=(96, 64))
    dataset, report = run(node, encoders, folder="kt_one", cache=cache_in(tmp_path))
    assert [e.name for e in dataset.entries] == ["cat", "dog"]
    entry = dataset.entries[0]
    # 96x64 at 256: scale = 256 / sqrt(96 * 64) = 3.266; 313.5 -> 320, 209.0 -> 208
    assert entry.target_size == (320, 208)
    sample = dataset.sample(entry)
    assert sample.target.shape == (16, 208 // 8, 320 // 8)
    assert sample.context.shape == (77, 48) and sample.pooled.shape == (48,)
    assert len(sample.references) == 2
    assert "2 training + 0 held-out samples (one folder), 2 reference(s) each" in report
    assert "320x208: 2" in report


def test_parallel_folders_by_absolute_path_and_hold_out(node, encoders, tmp_path):
    root = write_parallel(tmp_path / "set", ["a", "b", "c"], references=1, size=(64, 64))
    dataset, _ = run(node, encoders, path=root, cache=cache_in(tmp_path), hold_out=1)
    assert dataset.folder_structure == "parallel_folders"
    assert len(dataset.entries) == 2 and len(dataset.held_out) == 1


def test_problems_are_reported_and_nothing_is_written(node, encoders, tmp_path):
    root = write_one_folder(tmp_path / "set", ["a", "b"], references=1)
    (root / "b_control.png").write_bytes(b"")
    color_image(64, 48, seed=4).save(root / "orphan_control.png")
    cache = cache_in(tmp_path)
    with pytest.raises(ValueError) as caught:
        run(node, encoders, path=root, cache=cache)
    assert "b_control.png: the file is empty" in str(caught.value)
    assert "orphan_control.png: a reference without a target" in str(caught.value)
    assert not cache.exists()


def test_second_pass_never_runs_the_encoders(node, tmp_path):
    vae, clip = small_flux_vae(seed=1), tiny_clip(seed=2)
    vae_calls, clip_calls = Counting(vae, "encode"), Counting(clip, "encode_from_tokens_scheduled")
    root = write_one_folder(tmp_path / "set", ["a", "b"], references=1, size=(64, 64))
    first, _ = run(node, {"vae": vae, "clip": clip}, path=root, cache=cache_in(tmp_path))
    assert (vae_calls.calls, clip_calls.calls) == (4, 3)  # 2 targets + 2 refs; 2 captions + empty
    second, report = run(node, {"vae": vae, "clip": clip}, path=root, cache=cache_in(tmp_path))
    assert (vae_calls.calls, clip_calls.calls) == (4, 3)
    assert "encoded 0 image(s) and 0 caption(s); 7 cache hit(s)" in report
    assert torch.equal(first.sample(first.entries[1]).target, second.sample(second.entries[1]).target)


def test_encoder_identities_follow_the_weights(pack):
    identity = importlib.import_module(f"{pack.__name__}.comfy_adapter.comfy_encoders")
    assert identity.vae_identity(small_flux_vae(seed=1)) == identity.vae_identity(small_flux_vae(seed=1))
    assert identity.vae_identity(small_flux_vae(seed=1)) != identity.vae_identity(small_flux_vae(seed=3))
    plain, patched = tiny_clip(seed=2), tiny_clip(seed=2)
    assert identity.clip_identity(plain) == identity.clip_identity(patched)
    key = next(k for k in patched.patcher.model_state_dict() if k.endswith("fc1.weight"))
    weight = patched.patcher.model_state_dict()[key]
    patched.add_patches({key: (torch.ones_like(weight),)}, 0.5)
    assert identity.clip_identity(plain) != identity.clip_identity(patched)


def test_paths_are_checked(pack, input_dir):
    datasets = importlib.import_module(f"{pack.__name__}.application.datasets")
    use_path = datasets.USE_PATH
    with pytest.raises(ValueError, match="path: 'relative/set' is not absolute"):
        datasets.resolve_dataset_folder(use_path, "relative/set", input_dir)
    with pytest.raises(ValueError, match="outside ComfyUI's input directory"):
        datasets.resolve_dataset_folder("../../etc", "", input_dir)
    with pytest.raises(ValueError, match="folder: pick a folder"):
        datasets.resolve_dataset_folder(use_path, "", input_dir)
    # the command line (no confinement): a name is a folder of output/, a path any folder
    assert datasets.resolve_cache_folder("cache", Path("/out")) == Path("/out/cache")
    assert datasets.resolve_cache_folder("", Path("/out")) == Path("/out") / datasets.CACHE_FOLDER_NAME
    assert datasets.resolve_cache_folder("/anywhere/cache", Path("/out")) == Path("/anywhere/cache")


def test_the_node_writes_its_cache_only_in_comfyuis_output_and_temp_folders(pack, tmp_path):
    """Issue 32: the server wrote 50 cache entries into /tmp/..., and entries inside
    models/loras showed up in every LoRA list."""
    import folder_paths

    datasets = importlib.import_module(f"{pack.__name__}.application.datasets")
    output, temp = Path(folder_paths.get_output_directory()), Path(folder_paths.get_temp_directory())
    confined = (output, temp)
    assert datasets.resolve_cache_folder("mine", output, confined) == output / "mine"
    assert datasets.resolve_cache_folder(str(temp / "c"), output, confined) == temp / "c"
    escape = cache_in(tmp_path)
    escape.mkdir(parents=True)
    (escape / "out").symlink_to(tmp_path, target_is_directory=True)
    loras = Path(folder_paths.get_folder_paths("loras")[0])
    for outside in (
        str(tmp_path / "cache"),
        "../models/loras/cache",
        str(loras / "c"),
        str(escape / "out" / "c"),
    ):
        with pytest.raises(ValueError) as caught:
            datasets.resolve_cache_folder(outside, output, confined)
        assert str(caught.value).startswith(
            f"cache_folder: '{outside}' is outside ComfyUI's output and temp folders, where this node "
            "may write; give a folder name"
        )
    # issue 44: a NUL is refused for what it is, before the place is judged
    with pytest.raises(ValueError, match=r"^cache_folder 'mine\\x00' contains an invisible control"):
        datasets.resolve_cache_folder("mine\x00", output, confined)


def test_a_loaded_dataset_trains(node, encoders, pack, tmp_path):
    ft = importlib.import_module(f"{pack.__name__}.comfy_adapter.lora_session")
    loop = importlib.import_module(f"{pack.__name__}.trainer_core.loop")
    root = write_one_folder(tmp_path / "set", ["a", "b"], references=1, size=(64, 64))
    dataset, _ = run(
        node, encoders, path=root, cache=cache_in(tmp_path), resolution=256, reference_resolution=64
    )
    model = tiny_flux_patcher(seed=3)
    samples = [dataset.sample(e, latent_in=model.model.process_latent_in) for e in dataset.entries]
    config = ft.TrainConfig(steps=2, rank=2, alpha=2.0, caption_dropout=0.5, learning_rate=1e-3)
    with (
        torch.inference_mode(False),
        ft.lora_session(model, config, empty_text=dataset.empty_text()) as session,
    ):
        result = loop.train(config, session.lora.parameters(), lambda i: samples, session.loss)
    assert len(result.losses) == 2 and all(torch.isfinite(torch.tensor(result.losses)))


def test_a_linked_folder_leading_out_of_the_input_directory_points_to_path(
    node, encoders, input_dir, tmp_path
):
    real = write_one_folder(tmp_path / "real_set", ["a"], references=0)
    (input_dir / "kt_linked").symlink_to(real, target_is_directory=True)
    from kt_testing.executor import PromptRejected

    try:
        with pytest.raises((ValueError, PromptRejected)) as caught:
            run(node, encoders, folder="kt_linked", cache=cache_in(tmp_path))
    finally:
        (input_dir / "kt_linked").unlink()
    if isinstance(caught.value, PromptRejected):  # ComfyUI 0.33 checks combo values first: the
        assert "'kt_linked' not in" in str(caught.value)  # folder list never offers a link
        return
    assert str(caught.value) == (
        f"folder: 'kt_linked' is a link to {real}, outside ComfyUI's input directory, and links out "
        f"of it are not followed; give the folder's real location in path: {real}"
    )


def test_a_cache_folder_that_cannot_be_created_is_named(node, encoders, tmp_path):
    root = write_one_folder(tmp_path / "set", ["a"], references=0)
    blocker = cache_in(tmp_path) / "file.txt"
    blocker.parent.mkdir(parents=True)
    blocker.write_text("not a folder", encoding="utf-8")
    for cache, reason in [
        (blocker / "cache", f"{blocker} is a file, not a folder"),
        (blocker, f"{blocker} is a file, not a folder"),
    ]:
        with pytest.raises(ValueError) as caught:
            run(node, encoders, path=root, cache=cache)
        assert str(caught.value) == (
            f"cache_folder: cannot create or write to {cache} ({reason}); give a folder ComfyUI may "
            "create and write to, or leave cache_folder empty to use output/kontext_trainer_cache"
        )


def test_the_estimate_counts_the_longest_encoded_caption(node, encoders, pack, tmp_path):
    """Issue 32: the VRAM estimate assumed 512 text tokens whatever the captions encoded to
    (ComfyUI's tokenizers cut nothing: this CLIP encodes a long caption in 77-token chunks)."""
    flux = importlib.import_module(f"{pack.__name__}.comfy_adapter.model_family")
    config = importlib.import_module(f"{pack.__name__}.trainer_core.config").TrainConfig(rank=2)
    model = tiny_flux_patcher(seed=3)
    estimates = {}
    for name, caption in (("short", "a red cube"), ("long", " ".join(["red cube"] * 600))):
        root = write_one_folder(tmp_path / name, ["a", "b"], references=1, size=(64, 64))
        (root / "b.txt").write_text(caption, encoding="utf-8")
        dataset, _ = run(node, encoders, path=root, cache=cache_in(tmp_path))
        longest = max(dataset.sample(e).context.shape[0] for e in dataset.entries)
        assert dataset.text_tokens == longest
        estimates[name] = (longest, flux.vram_estimate(model, dataset, config))
    (short_tokens, short), (long_tokens, long) = estimates["short"], estimates["long"]
    assert short_tokens == 77 and long_tokens > 512  # 1,200 words: past the 512 assumed before
    assert long.activations > short.activations and long.total > short.total


def test_a_huge_caption_or_too_many_references_are_refused_before_encoding(node, encoders, tmp_path):
    root = write_one_folder(tmp_path / "set", ["a", "b"], references=1, size=(64, 64))
    (root / "a.txt").write_text("x" * 2_000_000, encoding="utf-8")
    (root / "b.txt").write_text("y" * 8_193, encoding="utf-8")
    cache = cache_in(tmp_path)
    with pytest.raises(ValueError) as caught:
        run(node, encoders, path=root, cache=cache)
    message = str(caught.value)
    assert f"{root / 'a.txt'}: the caption is 2,000,000 bytes long, over the 8,192-character limit" in message
    assert f"{root / 'b.txt'}: the caption is 8,193 characters long" in message
    assert not cache.exists()
    many = write_one_folder(tmp_path / "many", ["a"], references=11, size=(32, 32))
    with pytest.raises(ValueError, match=r"a.png: its samples have 11 references each; at most 10"):
        run(node, encoders, path=many, cache=cache)
    assert not cache.exists()
