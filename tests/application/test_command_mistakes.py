"""A user's mistakes with the headless command, run as the user runs it (a subprocess): each
ends in one line naming the file or the key, what is wrong and what to do, never a traceback
(issue 62 item 3). All but the last are refused before ComfyUI's runtime boots; the last, a
resume whose checkpoint keep_last prunes, trains twice (one step, then one more).
"""

from __future__ import annotations

import importlib.util
import sys

import pytest

from kt_testing.datasets import write_one_folder
from kt_testing.headless import TINY_COMMAND, command, refused_before_the_boot, run, write_config

pytestmark = pytest.mark.version_independent


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("mistakes")
    dataset = write_one_folder(root / "data", ["a", "b"], references=1, size=(64, 64))
    return type(
        "Files", (), {"root": root, "dataset": dataset, "cache": root / "cache", "base": root / "base"}
    )


def run_file(files, name: str):
    """A run file that is fine but for what a test changes (it refuses before the dataset)."""
    path = files.root / f"{name}.toml"
    return write_config(path, files.base, files.dataset, files.cache, {"lora_name": name})


def one_line(result) -> str:
    """The command's refusal: its only line on stderr, no traceback."""
    lines = result.stderr.strip().splitlines()
    assert "Traceback" not in result.stderr and len(lines) == 1, result.stderr
    return lines[0]


def extra_paths(root, kind: str):
    """An `--extra-model-paths-config` file that ComfyUI cannot read, and the words naming why."""
    path = root / f"paths_{kind}.yaml"
    if kind == "missing":
        return path, f"--extra-model-paths-config: {path} does not exist"
    if kind == "folder":
        path.mkdir(exist_ok=True)
        return path, f"--extra-model-paths-config: {path} is a folder, not a YAML file"
    if kind == "not yaml":
        path.write_text("shared:\n  vae: models/vae\n  loras: [unclosed\n", encoding="utf-8")
        return path, f"--extra-model-paths-config: {path}: line 4, column 1: not valid YAML"
    path.write_text("- models/vae\n- models/loras\n", encoding="utf-8")  # a list at the top
    return path, f"--extra-model-paths-config: {path}: its top level must be a mapping of names to folders"


@pytest.mark.parametrize("kind", ["missing", "folder", "not yaml", "list"])
def test_an_extra_model_paths_file_comfyui_cannot_read_is_one_line(files, kind):
    """ComfyUI's flag after `--`: on c1ab39f each was a traceback of 11 to 55 lines (the folder
    one said "does not exist")."""
    config = run_file(files, "paths")
    path, words = extra_paths(files.root, kind)
    result = run(command(config, "--", "--extra-model-paths-config", str(path), cpu_attention=False))
    assert result.returncode == 2, result.stdout + result.stderr
    line = one_line(result)
    assert words in line, line
    fixes = {"missing": "give the path of", "folder": "give the path of", "not yaml": "fix the syntax"}
    assert fixes.get(kind, "extra_model_paths.yaml.example") in line, line
    assert refused_before_the_boot(result), result.stdout


@pytest.mark.parametrize("value", ['"--cpu"', "[2]", "true", "{a = 1}"])
def test_comfyui_flags_that_are_not_a_list_of_text_are_one_line(files, value):
    """On c1ab39f: `TypeError: no TOML form for <dataclasses._MISSING_TYPE ...>` while the
    hint was built (the key has a default factory and no example)."""
    config = run_file(files, "flags")
    text = config.read_text(encoding="utf-8")
    config.write_text(text.replace("[comfyui]\n", f"[comfyui]\nflags = {value}\n"), encoding="utf-8")
    result = run(command(config, cpu_attention=False))
    assert result.returncode == 2, result.stdout + result.stderr
    line = one_line(result)
    assert f"{config}: [comfyui] flags: expected a list of text, got " in line, line
    assert line.endswith('write it like flags = ["--cpu"]'), line
    assert refused_before_the_boot(result), result.stdout


def test_a_workflow_that_is_not_json_is_named_with_what_to_do(files):
    """On c1ab39f: `error: Expecting value: line 1 column 1 (char 0)`, naming neither the file
    nor what it should be (after ComfyUI's boot)."""
    picture = files.root / "workflow.json"
    picture.write_text("\n  not a workflow\n", encoding="utf-8")
    result = run([sys.executable, str(TINY_COMMAND), "config", "--from-workflow", str(picture)])
    assert result.returncode == 2, result.stdout + result.stderr
    line = one_line(result)
    assert f"{picture}: line 2, column 3: not a JSON workflow" in line, line
    assert "Workflow > Export" in line and "Export (API)" in line, line
    assert refused_before_the_boot(result), result.stdout


def test_a_flag_whose_package_is_missing_names_the_package(files):
    """`--directml` without torch-directml: on c1ab39f ComfyUI's traceback from its device
    selection (`import torch_directml`), after the boot had begun."""
    if importlib.util.find_spec("torch_directml") is not None:  # the command's Python is this one
        pytest.skip("torch_directml is installed here")
    config = run_file(files, "directml")
    result = run(command(config, "--", "--directml", cpu_attention=False))
    assert result.returncode == 2, result.stdout + result.stderr
    line = one_line(result)
    assert "--directml needs the Python package torch_directml" in line, line
    assert "pip install torch-directml" in line and "leave out --directml" in line, line
    assert refused_before_the_boot(result), result.stdout


def test_comfyuis_help_is_shown_and_nothing_trains(files):
    """`-- --help`: ComfyUI's parser prints its help; on c1ab39f the command swallowed it and
    refused ("ComfyUI's parser stopped", exit 2)."""
    config = run_file(files, "help")
    result = run(command(config, "--", "--help", cpu_attention=False))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "usage: main.py" in result.stdout and "--reserve-vram" in result.stdout, result.stdout
    assert "error" not in result.stderr, result.stderr
    assert refused_before_the_boot(result), result.stdout
