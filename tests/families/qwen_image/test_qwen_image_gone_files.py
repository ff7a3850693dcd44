"""Issue 62 item 4: a Qwen-Image-Edit reference image deleted while LoadKontextDataset encodes
(its whole-sample encoding hashes each sample's references when it reaches the sample) is named
in the pack's own line; on main a raw FileNotFoundError came out, 76 s later on a real dataset."""

from __future__ import annotations

import pytest

from kt_testing.datasets import write_one_folder
from kt_testing.executor import run_node
from kt_testing.graphs import cache_name, dataset_inputs
from kt_testing.qwen_image import small_wan_vae, tiny_qwen_image_clip

pytestmark = [pytest.mark.usefixtures("comfy_runtime"), pytest.mark.version_independent]


def test_a_reference_removed_while_the_dataset_encodes_is_named_in_one_line(
    registered, tmp_path, tmp_path_factory
):
    """The sample's references are hashed when the encoding reaches it (here at once: the first
    sample's, while its target encodes; on a real dataset one reached minutes later)."""
    root = write_one_folder(tmp_path / "set", ["a", "b"], references=1, size=(64, 48))
    gone = root / "a_control.png"
    vae = small_wan_vae(seed=1)
    encode = vae.encode

    def removing(*args, **kwargs):  # a's target: its reference goes before the sample's encoding
        gone.unlink(missing_ok=True)
        return encode(*args, **kwargs)

    vae.encode = removing
    inputs = dataset_inputs(vae, tiny_qwen_image_clip(seed=2), root, cache_name(tmp_path_factory))
    with pytest.raises(ValueError) as refused:
        run_node("KontextTrainer_LoadKontextDataset", inputs)
    assert str(refused.value) == (
        f"{gone} is gone: it was moved or deleted after the dataset was checked. Put it back, or "
        "take its sample out of the dataset, and run again"
    )
