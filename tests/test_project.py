"""The pack's packaging promises: requirements, pyproject, imports, web version."""

from __future__ import annotations

import ast
import re
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACK_DIRS = ("nodes", "application", "comfy_adapter", "trainer_core")


def _requirement_lines(path: Path) -> list[str]:
    lines = (line.split("#", 1)[0].strip() for line in path.read_text().splitlines())
    return [line for line in lines if line]


def _name(requirement: str) -> str:
    return re.split(r"[<>=!~\[; ]", requirement, maxsplit=1)[0].lower()


def test_requirements_never_name_the_torch_family():
    names = {_name(r) for r in _requirement_lines(REPO / "requirements.txt")}
    assert names and not names & {"torch", "torchvision", "torchaudio"}


def test_pyproject_dependencies_match_requirements():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert sorted(project["dependencies"]) == sorted(_requirement_lines(REPO / "requirements.txt"))


def test_pyproject_registry_fields():
    data = tomllib.loads((REPO / "pyproject.toml").read_text())
    project, comfy = data["project"], data["tool"]["comfy"]
    assert "comfyui" not in project["name"].lower()
    assert re.fullmatch(r"\d+\.\d+\.\d+", project["version"])
    assert comfy["DisplayName"] == "Kontext Trainer" and comfy["PublisherId"]
    assert re.fullmatch(r">=\s*\d+\.\d+\.\d+", comfy["requires-comfyui"])
    # the registry publishes only with a repository address (an https URL of a GitHub repository)
    assert re.fullmatch(r"https://github\.com/[\w.-]+/[\w.-]+", project["urls"]["Repository"])


def test_pack_never_imports_nodes_absolutely():
    """ComfyUI owns the top-level `nodes`; inside the pack only relative imports reach ours."""
    files = [REPO / "__init__.py"] + [f for d in PACK_DIRS for f in sorted((REPO / d).rglob("*.py"))]
    offenders = []
    for path in files:
        for node in ast.walk(ast.parse(path.read_text())):
            absolute = (
                isinstance(node, ast.Import)
                and any(a.name.split(".")[0] in PACK_DIRS for a in node.names)
            ) or (
                isinstance(node, ast.ImportFrom)
                and node.level == 0
                and (node.module or "").split(".")[0] in PACK_DIRS
            )
            if absolute:
                offenders.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert not offenders


def test_web_badge_version_matches_pyproject():
    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    js = (REPO / "web" / "js" / "about.js").read_text()
    assert re.search(r'PACK_VERSION = "([^"]+)"', js).group(1) == version


# Node tests that still call nodes directly, until converted to kt_testing.executor.
DIRECT_NODE_CALLS_ALLOWED = {}


def _direct_node_calls(source: str) -> list[int]:
    """Lines that run a node outside ComfyUI's executor: `X.execute(...)` (a V3 node), or a
    FUNCTION on a node made from ComfyUI's `nodes` module (`nodes.CLIPTextEncode().encode(...)`)."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        owner = node.func.value
        made_from_nodes = (
            isinstance(owner, ast.Call)
            and isinstance(owner.func, ast.Attribute)
            and ast.unparse(owner.func.value).split(".")[-1] == "nodes"
        )
        if node.func.attr == "execute" or made_from_nodes:
            lines.append(node.lineno)
    return sorted(lines)


def test_guard_recognises_direct_node_calls():
    source = (
        "TrainLoRA.execute(model)\n"
        "node.LoadKontextDataset.execute(vae, clip).args\n"
        "comfy_runtime.nodes.LoraLoaderModelOnly().load_lora_model_only(m, 'a', 1.0)\n"
        "nodes.CLIPTextEncode().encode(clip, 'x')\n"
        "run_node('CLIPTextEncode', {'text': 'x'})\n"
    )
    assert _direct_node_calls(source) == [1, 2, 3, 4]


def test_node_tests_run_nodes_through_comfyuis_executor():
    """ComfyUI runs nodes in its prompt thread under torch.inference_mode(); a test that calls
    a node directly cannot see the bugs that only exist there (a resume that updated inference
    tensors in place passed such tests and failed on every real run). Use kt_testing.executor's
    run_node / run_graph."""
    tests = REPO / "tests"
    in_process = ("nodes", "application", "comfy_adapter", "families", "kt_testing")
    files = [p for folder in in_process for p in sorted((tests / folder).rglob("*.py"))]
    offenders = []
    for path in files:
        name = path.relative_to(REPO).as_posix()
        if name == "tests/kt_testing/executor.py" or name in DIRECT_NODE_CALLS_ALLOWED:
            continue
        offenders += [f"{name}:{line}" for line in _direct_node_calls(path.read_text())]
    assert not offenders, "call nodes through kt_testing.executor.run_node / run_graph"


def test_a_base_directory_links_this_checkout_even_after_a_move(tmp_path):
    """The demo's and the tests' base directory installs the pack as a link in custom_nodes; a
    link left by a checkout that moved (or another checkout) is replaced by this one, a real
    folder of that name is not touched."""
    from comfy_server import PACK_DIR_NAME, REPO_ROOT, make_base_directory

    link = tmp_path / "custom_nodes" / PACK_DIR_NAME
    link.parent.mkdir(parents=True)
    link.symlink_to(tmp_path / "gone", target_is_directory=True)  # the old checkout, moved away
    make_base_directory(tmp_path)
    assert link.resolve() == REPO_ROOT.resolve()
    other = tmp_path / "other"
    other.mkdir()
    link.unlink()
    link.symlink_to(other, target_is_directory=True)  # another checkout
    make_base_directory(tmp_path)
    assert link.resolve() == REPO_ROOT.resolve()
    link.unlink()
    link.mkdir()  # a user's own copy: refused with its path, left as it is
    with pytest.raises(RuntimeError, match="exists and is not a link"):
        make_base_directory(tmp_path)
    assert link.is_dir() and not link.is_symlink()
