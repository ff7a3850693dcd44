"""LoRA names become one safe stem inside models/loras, or a message."""

from __future__ import annotations

import pytest

from trainer_core.names import lora_stem


@pytest.mark.parametrize(
    ("name", "stem"),
    [("my_edit", "my_edit"), ("  my edit v2 ", "my edit v2"), ("style.safetensors", "style"), ("a.b", "a.b")],
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
    ],
)
def test_bad_names_are_refused_with_a_reason(name, message):
    with pytest.raises(ValueError, match=message):
        lora_stem(name)
