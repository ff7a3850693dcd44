"""Bad input sent to a real ComfyUI server (over HTTP, as the API and the frontend send it) gets
a clear error naming the file or the field and what to do, and leaves nothing written."""

from __future__ import annotations

import math
import urllib.error

import pytest

from kt_testing.bad_files import write_huge_png
from kt_testing.datasets import write_one_folder
from kt_testing.graphs import training_graph
from kt_testing.runs import error_of

pytestmark = pytest.mark.version_independent  # runs on ComfyUI 0.33 only in `make test`


@pytest.fixture(scope="module")
def good_set(server):
    return write_one_folder(server.base_dir / "input" / "kt_bad_input_good", ["a", "b"], size=(64, 64))


def loras(server):
    return server.base_dir / "models" / "loras"


def run_failing(server, graph) -> str:
    prompt_id, messages = server.run_prompt(graph)
    # ComfyUI's /history would serve a NaN input as bare `NaN`, which the frontend of the
    # browser tests sharing this server cannot parse: drop the refused prompt from it, once
    # ComfyUI has written it there (just after the error message: deleting earlier is a no-op)
    server.history(prompt_id)
    server.post_json("/history", {"delete": [prompt_id]})
    return error_of(messages).strip()  # ComfyUI adds a line break


def test_a_decompression_bomb_is_one_named_problem_among_the_others(server, tmp_path):
    root = write_one_folder(tmp_path / "set", ["a", "b"], size=(64, 64))
    write_huge_png(root / "big.png", 20000, 20000)
    (root / "b_control.png").unlink()
    graph = training_graph(root, "kt_bad_bomb", steps=1)
    cache = server.base_dir / "output" / "kt_bad_bomb_cache"
    graph["4"]["inputs"]["cache_folder"] = str(cache)
    message = run_failing(server, graph)
    assert f"The dataset in {root} has 3 problem(s); nothing was encoded" in message
    assert f"{root / 'big.png'}: 20000x20000 px is over the 4096 px limit on a side; downscale it" in message
    assert f"{root / 'b_control.png'} (or .jpg / .webp) is missing: a.png has a_control.png" in message
    assert f"{root / 'big_control.png'} (or .jpg / .webp) is missing" in message
    assert not cache.exists()


def test_a_lora_name_too_long_in_bytes_is_refused_before_training(server, good_set):
    name = "字" * 100  # 100 characters, 300 bytes
    message = run_failing(server, training_graph(good_set, name, steps=1))
    assert message.startswith("lora_name is 300 bytes in UTF-8 (100 characters)")
    assert "Use a shorter lora_name: at most 208 bytes" in message
    assert not any(name in p.name for p in loras(server).glob("*"))


@pytest.mark.parametrize(
    ("field", "value", "limits"),
    [
        ("max_grad_norm", math.nan, "from 0.0 to 100.0"),
        ("alpha", math.nan, "from 0.01 to 1024.0"),
        ("guidance", math.nan, "from 0.0 to 100.0"),
        ("shift", math.nan, "from 0.01 to 100.0"),
        ("learning_rate", math.nan, "from 1e-07 to 1.0"),
    ],
)
def test_nan_settings_sent_through_the_api_are_refused_by_name(server, good_set, field, value, limits):
    # ComfyUI's own min / max check lets NaN through (every comparison with NaN is false)
    message = run_failing(server, training_graph(good_set, f"kt_bad_nan_{field}", steps=1, **{field: value}))
    assert message == f"{field} is nan; give a finite number {limits}"
    assert not (loras(server) / f"kt_bad_nan_{field}.safetensors").exists()


def test_a_linked_dataset_folder_says_to_use_path(server, tmp_path):
    real = write_one_folder(tmp_path / "real_set", ["a"], size=(64, 64))
    link = server.base_dir / "input" / "kt_bad_linked"
    link.symlink_to(real, target_is_directory=True)
    try:
        graph = training_graph(real, "kt_bad_linked", steps=1)
        graph["4"]["inputs"].update(folder="kt_bad_linked", path="")
        message = run_failing(server, graph)
    except urllib.error.HTTPError as refused:  # ComfyUI 0.33 checks combo values when queuing:
        body = refused.read().decode()  # the folder list never offers a link
        assert refused.code == 400 and "'kt_bad_linked' not in" in body, body
        return
    finally:
        link.unlink()
    assert message == (
        f"folder: 'kt_bad_linked' is a link to {real}, outside ComfyUI's input directory, and links "
        f"out of it are not followed; give the folder's real location in path: {real}"
    )


def test_a_cache_folder_that_cannot_be_created_is_named(server, good_set, tmp_path):
    blocker = server.base_dir / "output" / "kt_a_file"
    blocker.write_text("not a folder", encoding="utf-8")
    graph = training_graph(good_set, "kt_bad_cache", steps=1)
    graph["4"]["inputs"]["cache_folder"] = str(blocker / "cache")
    message = run_failing(server, graph)
    assert message == (
        f"cache_folder: cannot create or write to {blocker / 'cache'} ({blocker} is a file, not a "
        "folder); give a folder ComfyUI may create and write to, or leave cache_folder empty to use "
        "output/kontext_trainer_cache"
    )
    blocker.unlink()


def test_the_node_writes_its_cache_only_in_comfyuis_folders(server, good_set, tmp_path):
    """Issue 32: LoadKontextDataset wrote its cache wherever cache_folder pointed (/tmp/..., or
    models/loras, where the entries showed up in every LoRA list)."""
    for outside in (tmp_path / "cache", server.base_dir / "models" / "loras" / "kt_cache"):
        graph = training_graph(good_set, "kt_bad_cache_place", steps=1)
        graph["4"]["inputs"]["cache_folder"] = str(outside)
        message = run_failing(server, graph)
        assert message.startswith(f"cache_folder: '{outside}' is outside ComfyUI's output and temp folders")
        assert not outside.exists()
    graph = training_graph(good_set, "kt_cache_place", steps=1)
    graph["4"]["inputs"]["cache_folder"] = "kt_named_cache"  # a name: a folder of output/
    _, messages = server.run_prompt(graph)
    assert messages[-1]["type"] == "execution_success", messages[-1]
    assert any((server.base_dir / "output" / "kt_named_cache").rglob("*.safetensors"))


def test_a_dataset_file_linked_out_of_the_input_folder_is_refused(server, tmp_path):
    """Issue 32: a caption linked to a file outside input/ (/etc/hostname) and an image linked
    elsewhere were trained on without notice, while a linked folder was refused."""
    root = write_one_folder(server.base_dir / "input" / "kt_bad_links", ["a", "b"], size=(64, 64))
    elsewhere = write_one_folder(tmp_path / "elsewhere", ["x"], size=(64, 64))
    (root / "a.txt").unlink()
    (root / "a.txt").symlink_to("/etc/hostname")
    (root / "b.png").unlink()
    (root / "b.png").symlink_to(elsewhere / "x.png")
    shared = server.base_dir / "input" / "kt_shared_caption.txt"
    shared.write_text("a shared caption", encoding="utf-8")
    (root / "b.txt").unlink()
    (root / "b.txt").symlink_to(shared)  # a link that stays inside input/ is fine
    graph = training_graph(root, "kt_bad_links", steps=1)
    graph["4"]["inputs"].update({"folder": "kt_bad_links", "path": ""})
    message = run_failing(server, graph)
    assert f"{root / 'a.txt'}: a link to /etc/hostname, outside ComfyUI's input directory" in message
    assert f"{root / 'b.png'}: a link to {elsewhere / 'x.png'}, outside ComfyUI's input directory" in message
    assert "has 2 problem(s); nothing was encoded" in message and "b.txt" not in message
    assert not (loras(server) / "kt_bad_links.safetensors").exists()


@pytest.mark.parametrize("field,limits", [("cfg", "from 1.0 to 30.0"), ("guidance", "from 0.0 to 100.0")])
def test_nan_preview_settings_are_refused_by_name(server, good_set, field, limits):
    graph = training_graph(good_set, f"kt_bad_preview_{field}", preview_every=1, steps=1)
    graph["8"]["inputs"][field] = math.nan
    assert run_failing(server, graph) == f"{field} is nan; give a finite number {limits}"
    assert not (loras(server) / f"kt_bad_preview_{field}.safetensors").exists()


def test_a_huge_caption_is_refused_by_name_and_the_server_lives(server, tmp_path):
    """Issue 32: a 2,000,000-byte caption was tokenised to 363,640 tokens and the kernel
    killed ComfyUI for its memory, with every open workflow. Now it is refused before
    anything encodes, naming the file."""
    root = write_one_folder(tmp_path / "set", ["a", "b"], size=(64, 64))
    (root / "a.txt").write_text("a long caption " * 140_000, encoding="utf-8")
    graph = training_graph(root, "kt_bad_caption", steps=1)
    cache = server.base_dir / "output" / "kt_bad_caption_cache"
    graph["4"]["inputs"]["cache_folder"] = str(cache)
    message = run_failing(server, graph)
    assert f"{root / 'a.txt'}: the caption is 2,100,000 bytes long, over the 8,192-character limit" in message
    assert "shorten it" in message
    assert not cache.exists() and not (loras(server) / "kt_bad_caption.safetensors").exists()
    assert server.get_json("/system_stats")["system"]  # still serving


def test_a_batch_larger_than_the_dataset_is_lowered_with_a_line_saying_so(server, good_set):
    """Issue 44: batch_size 8 on 2 samples trained with no notice, and the LoRA's metadata and
    the VRAM estimate said 8. Now the run lowers it to the dataset's size and says so; its
    estimate is the one of a run asked for that batch, and the metadata records it."""
    from kt_testing.runs import progress_events
    from trainer_core.lora_file import load

    def trained(name: str, batch: int) -> tuple[str, dict]:
        _, messages = server.run_prompt(training_graph(good_set, name, steps=1, batch_size=batch))
        assert messages[-1]["type"] == "execution_success", messages[-1]["data"]
        first = progress_events(messages)[0]["message"]
        return first, load(loras(server) / f"{name}.safetensors")[1]

    asked_8, metadata = trained("kt_batch_8_on_2", 8)
    asked_2, metadata_2 = trained("kt_batch_2_on_2", 2)
    note = "batch_size 8 is more than the dataset's 2 training sample(s): training with batch_size 2"
    assert note in asked_8, asked_8
    assert asked_8.replace(note + "; ", "") == asked_2  # the same estimate as a run of batch 2
    assert metadata["ss_batch_size_per_device"] == metadata_2["ss_batch_size_per_device"] == "2"
    assert metadata["ss_total_batch_size"] == "2"


@pytest.mark.parametrize(
    ("field", "value", "expected"),
    [
        ("lora_name", "kt_spaced ", "lora_name 'kt_spaced ' starts or ends with a space; remove the space"),
        ("lora_name", "\u202ekt_reversed", "contains an invisible control or format character (U+202E)"),
        ("cache_folder", "kt_cache/CON", "cache_folder 'kt_cache/CON' uses 'CON', a reserved device name"),
        ("cache_folder", "kt_cache\x00", "contains an invisible control or format character (U+0000)"),
        ("cache_folder", "kt_cache.", "has a name ending in a dot"),
    ],
)
def test_names_are_used_as_typed_or_refused_by_one_rule(server, good_set, field, value, expected):
    """Issue 44: a trailing space was stripped silently, a right-to-left override accepted (the
    name showed reversed in every list), and cache_folder took CON, 'cf.' and a NUL was
    refused for being outside the output folder. One rule for both, before anything is
    written."""
    graph = training_graph(good_set, "kt_named_by_rule", steps=1)
    graph["5" if field == "lora_name" else "4"]["inputs"][field] = value
    message = run_failing(server, graph)
    assert expected in message, message
    assert not (server.base_dir / "output" / "kt_cache").exists()
    assert not any("kt_spaced" in p.name or "kt_reversed" in p.name for p in loras(server).glob("*"))


def test_a_named_pipe_for_a_caption_is_named_for_what_it_is(server, tmp_path):
    """Issue 44: a FIFO caption was reported as "no caption file" (and reading one blocks)."""
    import os

    root = write_one_folder(tmp_path / "set", ["a", "b"], size=(64, 64))
    (root / "a.txt").unlink()
    os.mkfifo(root / "a.txt")
    message = run_failing(server, training_graph(root, "kt_fifo_caption", steps=1))
    expected = f"{root / 'a.txt'}: is a named pipe (FIFO), not a caption file; replace it with a text file"
    assert expected in message, message
