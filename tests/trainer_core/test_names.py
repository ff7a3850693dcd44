"""LoRA names become one safe stem inside models/loras, or a message."""

from __future__ import annotations

import re

import pytest

from trainer_core.names import MAX_PATH_BYTES, check_folder_path, lora_stem, written_names


@pytest.mark.parametrize(
    ("name", "stem"),
    [("my_edit", "my_edit"), ("my edit v2", "my edit v2"), ("style.safetensors", "style"), ("a.b", "a.b")],
)
def test_good_names(name, stem):
    assert lora_stem(name) == stem


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("", "empty"),
        ("sub/dir", "contains a path"),
        ("..\\evil", "contains a path"),
        ("/etc/passwd", "contains a path"),
        ("~root", "contains a path"),
        ("a..b", "contains '..'"),
        ("CON", "reserved device name"),
        ("lpt1.txt", "reserved device name"),
        ("what?", "contains one of"),
        (".hidden", "starts with a dot"),
        ("x" * 121, "keep it under 120"),
        # issue 44: used as typed or refused, never stripped; format characters as control ones
        ("my lora ", "starts or ends with a space"),
        (" my lora", "starts or ends with a space"),
        ("\u202eexe.lora", "control or format character \\(U\\+202E\\)"),
        ("a\u200bb", "U\\+200B"),
        ("a\x7fb", "U\\+007F"),
        ("a\nb", "U\\+000A"),
        ("cf.", "ending in a dot"),
    ],
)
def test_bad_names_are_refused_with_a_reason(name, message):
    with pytest.raises(ValueError, match=message):
        lora_stem(name)


def test_every_name_written_for_a_stem_is_listed():
    names = written_names("cat")
    assert names[:3] == ["cat.safetensors", "cat_loss.png", "cat-step01000000.safetensors"]
    assert re.fullmatch(r"\.cat\.safetensors\.[0-9a-f]{12}\.partial", names[3])
    assert re.fullmatch(r"\.cat_loss\.png\.[0-9a-f]{12}\.partial", names[4])
    assert re.fullmatch(r"\.cat-step01000000\.safetensors\.[0-9a-f]{12}\.partial", names[5])
    assert names[6:] == ["cat", "cat_steps", "cat_step1000000_999.png"]


def test_the_limit_is_in_bytes_of_the_longest_name_written():
    # longest: the last snapshot's temp name,
    # "." + stem + "-step01000000.safetensors" + "." + 12 hex + ".partial" = stem + 47 bytes <= 255
    assert lora_stem("字" * 69) == "字" * 69  # 207 bytes
    assert lora_stem("a" * 120) == "a" * 120
    with pytest.raises(ValueError) as caught:
        lora_stem("字" * 100)  # 100 characters pass the character check, 300 bytes do not
    message = str(caught.value)
    assert message.startswith("lora_name is 300 bytes in UTF-8 (100 characters); the trainer would write")
    assert "347 bytes, and file systems allow 255 bytes per file name" in message
    assert "Use a shorter lora_name: at most 208 bytes" in message
    with pytest.raises(ValueError, match="lora_name is 210 bytes"):
        lora_stem("字" * 70)


def test_every_accepted_name_can_really_be_written(tmp_path):
    stem = lora_stem("é" * 104)  # 208 bytes: the largest number of bytes accepted
    for name in written_names(stem):
        (tmp_path / name).write_bytes(b"")  # raises 'File name too long' if the check is too loose
    assert len(list(tmp_path.iterdir())) == len(written_names(stem))


@pytest.mark.parametrize(
    ("typed", "message"),
    [
        ("cache/CON", "'CON', a reserved device name"),
        ("aux", "'aux', a reserved device name"),
        ("cf.", "ending in a dot"),
        ("my cache ", "starts or ends with a space"),
        ("cache\nname", "U\\+000A"),
        ("cache\x00", "U\\+0000"),
        ("\u202ecache", "U\\+202E"),
        ("/data/" + "c" * 300, "300 bytes in UTF-8"),
        ("/data/" + "c/" * 2100, f"paths may have {MAX_PATH_BYTES}"),
        ("   ", "only spaces"),
    ],
)
def test_a_folder_the_user_types_passes_the_rule_lora_name_passes(typed, message):
    """Issue 44: cache_folder took 'CON', 'cf.', a newline (a folder with a newline in its name)
    and 300-character names (a raw 'File name too long' later); a NUL was refused as
    'outside ComfyUI's output folder', the wrong reason."""
    with pytest.raises(ValueError, match=f"^cache_folder.*{message}"):
        check_folder_path("cache_folder", typed)


def test_ordinary_folders_pass():
    for typed in ("cache", "/data/my cache/v2", "~/kt cache", "../output/cache", "字幕/缓存"):
        check_folder_path("cache_folder", typed)
