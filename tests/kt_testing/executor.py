"""Run nodes the way ComfyUI runs them: through its own executor, in this process.

The server validates a prompt and queues it; its prompt worker thread calls
`execution.PromptExecutor.execute`, which runs every node inside `torch.inference_mode()`.
Calling a node's `execute` from a test skips all of that, and bugs that only exist there
(inference tensors, the prompt thread, hidden inputs, widget coercion) pass unseen. So node
tests go through here:

    result = run_node("KontextTrainer_TrainLoRA", {"model": patcher, "dataset": data, "steps": 2})
    model, lora_name, *_ = result.outputs
    result.ui                      # what /history shows for the node
    result.events("executed")      # messages the node and the executor sent

Widget values (str, int, float, bool) go into the prompt as the frontend would send them and
pass ComfyUI's validation (`execution.validate_inputs`: conversion, min/max, combo options).
Any other value (a MODEL, a dataset, a tensor, a list) is handed over by a test-only stash
node linked to the input, the way a loader node's output arrives; `InGraph(factory)` builds
the value inside the executor instead, so its tensors are inference tensors like a loader's.
`None` leaves the input unconnected. A node that raises re-raises its ORIGINAL exception
here (also `comfy.model_management.InterruptProcessingException`). Each call has a fresh
executor, so nothing is served from a previous call's cache.

Requires the session's `comfy_runtime` fixture (ComfyUI booted in-process, pack loaded).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import itertools
import threading
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

STASH_NODE = "KTTest_Stash"
TEST_NODE_PREFIX = "KTTest_"
CLIENT_ID = "kt-test-client"


class AnyType(str):
    """A socket type that links to every input type: ComfyUI compares a link's types with
    `received_type != input_type` (comfy_execution/validation.py), so a type that is never
    unequal matches all of them."""

    def __ne__(self, other):
        return False

    __hash__ = str.__hash__


ANY = AnyType("*")


@dataclass(frozen=True)
class InGraph:
    """A value the stash node builds when it runs: inside the executor, under inference mode, on
    the prompt thread, exactly where a loader node would build it."""

    factory: Callable[[], Any]


@dataclass(frozen=True)
class Widget:
    """Force a value into the prompt as a widget value (lists are wrapped as `__value__`)."""

    value: Any


@dataclass(frozen=True)
class Message:
    event: str
    data: Any
    client_id: str | None


@dataclass
class GraphResult:
    outputs: dict[str, tuple]  # node id -> output tuple, for every node that ran
    ui: dict[str, dict]  # node id -> the node's ui dict, as in /history
    messages: list[Message]
    prompt_id: str

    def events(self, name: str) -> list[Any]:
        return [m.data for m in self.messages if m.event == name]


@dataclass
class NodeResult:
    outputs: tuple
    ui: dict | None
    messages: list[Message] = field(default_factory=list)
    prompt_id: str = ""

    def events(self, name: str) -> list[Any]:
        return [m.data for m in self.messages if m.event == name]


class PromptRejected(Exception):
    """ComfyUI's validation refused the prompt (what POST /prompt answers with a 400)."""

    def __init__(self, errors: dict[str, list[dict]]):
        self.errors = errors
        lines = [f"{node}: {e['message']}: {e['details']}" for node, errs in errors.items() for e in errs]
        super().__init__("\n".join(lines) or "prompt rejected")


_STASH: dict[str, Any] = {}
_STASH_IDS = itertools.count()


class StashNode:
    """Test-only node (never shipped): hands on the object the helper stashed under `key`."""

    RETURN_TYPES = (ANY,)
    FUNCTION = "load"
    CATEGORY = "kontext_trainer_tests"
    NOT_IDEMPOTENT = True

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"key": ("STRING", {"default": ""})}}

    @classmethod
    def IS_CHANGED(cls, key):
        return float("nan")  # never equal: never served from a cache

    def load(self, key):
        value = _STASH[key]
        return (value.factory() if isinstance(value, InGraph) else value,)


class RecordingServer:
    """Stands in for `PromptServer.instance`: the executor and the nodes send through it."""

    def __init__(self):
        self.client_id: str | None = None
        self.last_node_id: str | None = None
        self.last_prompt_id: str | None = None
        self.sockets_metadata: dict = {}
        self.messages: list[Message] = []
        self._lock = threading.Lock()

    def send_sync(self, event, data, sid=None):
        with self._lock:
            self.messages.append(Message(event, data, sid))

    def send_progress_text(self, text, node_id, sid=None):
        self.send_sync("progress_text", {"text": text, "node": node_id}, sid)


def register_test_node(node_type: str, cls: type) -> None:
    """Make a test-only node class runnable (in this test process only, never shipped)."""
    import nodes

    if not node_type.startswith(TEST_NODE_PREFIX):
        raise ValueError(f"test node ids start with {TEST_NODE_PREFIX!r}: {node_type}")
    nodes.NODE_CLASS_MAPPINGS[node_type] = cls


def run_node(
    node_type: str | type,
    inputs: dict[str, Any],
    *,
    node_id: str = "1",
    extra_pnginfo: dict | None = None,
    validate: bool = True,
) -> NodeResult:
    """Run one node through ComfyUI's executor and return its outputs, ui and messages."""
    class_type = _class_type(node_type)
    prompt = {node_id: {"class_type": class_type, "inputs": inputs}}
    graph = _run(prompt, [node_id], extra_pnginfo, validate, links=False)
    return NodeResult(graph.outputs[node_id], graph.ui.get(node_id), graph.messages, graph.prompt_id)


def run_graph(
    prompt: dict[str, dict],
    outputs: Iterable[str] | None = None,
    *,
    extra_pnginfo: dict | None = None,
    validate: bool = True,
) -> GraphResult:
    """Run an API-format prompt (`{id: {"class_type", "inputs"}}`) through ComfyUI's executor.

    `[node_id, slot]` inputs are links; other values as in `run_node`. `outputs` are the nodes
    to execute (with what they depend on); by default every output node, like the server.
    """
    return _run(prompt, outputs, extra_pnginfo, validate, links=True)


def _run(
    prompt: dict[str, dict],
    outputs: Iterable[str] | None,
    extra_pnginfo: dict | None,
    validate: bool,
    links: bool,
) -> GraphResult:
    import nodes

    from .comfy_runtime import _RUNTIME

    if _RUNTIME is None:
        raise RuntimeError("ComfyUI is not booted: use the comfy_runtime fixture")
    nodes.NODE_CLASS_MAPPINGS.setdefault(STASH_NODE, StashNode)
    lowered, keys = _lower(prompt, links=links)
    if outputs is None:
        outputs = [i for i, node in lowered.items() if _is_output_node(node["class_type"])]
    targets = [str(o) for o in outputs]
    if not targets:
        raise ValueError("nothing to execute: name the outputs (no output node in the prompt)")
    try:
        return _on_prompt_thread(lambda: _execute(lowered, targets, extra_pnginfo, validate))
    finally:
        for key in keys:
            _STASH.pop(key, None)


def _class_type(node_type: str | type) -> str:
    if isinstance(node_type, str):
        return node_type
    import nodes

    for name, cls in nodes.NODE_CLASS_MAPPINGS.items():
        if cls is node_type:
            return name
    raise KeyError(f"{node_type!r} is not registered with ComfyUI (is it the class ComfyUI loaded?)")


def _is_output_node(class_type: str) -> bool:
    import nodes

    return getattr(nodes.NODE_CLASS_MAPPINGS[class_type], "OUTPUT_NODE", False) is True


def _is_link(value: Any) -> bool:
    return (
        isinstance(value, list)
        and len(value) == 2
        and isinstance(value[0], str)
        and isinstance(value[1], int)
    )


def _lower(prompt: dict[str, dict], links: bool) -> tuple[dict, list[str]]:
    """A copy of `prompt` in which every object input is linked to a stash node holding it."""
    lowered: dict[str, dict] = {}
    keys: list[str] = []
    for node_id, node in prompt.items():
        inputs = {}
        for name, value in node["inputs"].items():
            if value is None:
                continue
            if isinstance(value, Widget):
                inputs[name] = {"__value__": value.value} if isinstance(value.value, list) else value.value
            elif isinstance(value, (str, int, float, bool)) or (links and _is_link(value)):
                inputs[name] = value
            else:
                key = f"kt_stash_{next(_STASH_IDS)}"
                _STASH[key] = value
                keys.append(key)
                lowered[key] = {"class_type": STASH_NODE, "inputs": {"key": key}}
                inputs[name] = [key, 0]
        lowered[str(node_id)] = {**node, "inputs": inputs}
    return lowered, keys


def _on_prompt_thread(work: Callable[[], Any]) -> Any:
    """Run `work` on a fresh thread, as the server's prompt worker does (thread-local state such
    as inference mode starts clean; it also works while an event loop runs in this thread)."""
    box: dict[str, Any] = {}

    def worker():
        try:
            box["value"] = work()
        except BaseException as ex:  # handed to the caller's thread below
            box["error"] = ex

    thread = threading.Thread(target=worker, name="kt-test-prompt-worker")
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]
    return box["value"]


def _capturing_executor_class():
    import execution

    class CapturingExecutor(execution.PromptExecutor):
        """Keeps the exception ComfyUI turned into an `execution_error` message."""

        error: dict | None = None
        exception: BaseException | None = None

        def handle_execution_error(self, prompt_id, prompt, current_outputs, executed, error, ex):
            self.error, self.exception = error, ex
            super().handle_execution_error(prompt_id, prompt, current_outputs, executed, error, ex)

    return CapturingExecutor


async def _validate(prompt_id: str, prompt: dict, targets: list[str]) -> dict[str, list[dict]]:
    import execution

    validated: dict = {}
    for target in targets:
        await execution.validate_inputs(prompt_id, prompt, target, validated)
    return {node: result[1] for node, result in validated.items() if result[0] is not True and result[1]}


def _execute(prompt: dict, targets: list[str], extra_pnginfo: dict | None, validate: bool) -> GraphResult:
    import execution

    prompt_id = str(uuid.uuid4())
    if validate:
        errors = asyncio.run(_validate(prompt_id, prompt, targets))
        if errors:
            raise PromptRejected(errors)
    server = RecordingServer()
    server.last_prompt_id = prompt_id  # as main.py's prompt_worker does
    executor = _capturing_executor_class()(
        server, cache_type=execution.CacheType.CLASSIC, cache_args={"lru": 0, "ram": 0, "ram_inactive": 0}
    )
    extra_data = {"client_id": CLIENT_ID}
    if extra_pnginfo is not None:
        extra_data["extra_pnginfo"] = extra_pnginfo
    with _serving(server):
        executor.execute(prompt, prompt_id, extra_data, targets)
    if executor.exception is not None:
        raise executor.exception
    if not executor.success or executor.error is not None:
        raise RuntimeError(f"ComfyUI reported an execution error: {executor.error}")
    outputs = {}
    for node_id, node in prompt.items():
        entry = executor.caches.outputs.get(node_id)
        if inspect.iscoroutine(entry):  # ComfyUI 0.33's caches are read asynchronously
            entry = asyncio.run(entry)
        if entry is not None and node["class_type"] != STASH_NODE:
            outputs[node_id] = _output_tuple(entry.outputs, node["class_type"])
    return GraphResult(outputs, executor.history_result["outputs"], server.messages, prompt_id)


def _output_tuple(slots: list[list], class_type: str) -> tuple:
    import nodes

    is_list = getattr(nodes.NODE_CLASS_MAPPINGS[class_type], "OUTPUT_IS_LIST", None) or ()
    return tuple(
        slot[0] if len(slot) == 1 and not (i < len(is_list) and is_list[i]) else list(slot)
        for i, slot in enumerate(slots)
    )


@contextlib.contextmanager
def _serving(server: RecordingServer):
    """Make `server` what the nodes reach: `PromptServer.instance` and the progress-bar hook that
    main.py installs (it sends `progress` and raises on Cancel, like `hijack_progress`)."""
    import comfy.utils
    from server import PromptServer

    missing = object()
    previous_instance = PromptServer.__dict__.get("instance", missing)
    previous_hook = comfy.utils.PROGRESS_BAR_HOOK
    PromptServer.instance = server
    comfy.utils.set_progress_bar_global_hook(_progress_hook(server))
    try:
        yield
    finally:
        comfy.utils.set_progress_bar_global_hook(previous_hook)
        if previous_instance is missing:
            del PromptServer.instance
        else:
            PromptServer.instance = previous_instance


def _progress_hook(server: RecordingServer):
    import comfy.model_management
    from comfy_execution.progress import get_progress_state
    from comfy_execution.utils import get_executing_context

    def hook(value, total, preview_image, prompt_id=None, node_id=None):
        context = get_executing_context()
        if context is not None:
            prompt_id = prompt_id or context.prompt_id
            node_id = node_id or context.node_id
        comfy.model_management.throw_exception_if_processing_interrupted()
        prompt_id = prompt_id or server.last_prompt_id
        node_id = node_id or server.last_node_id
        get_progress_state().update_progress(node_id, value, total, preview_image)
        progress = {"value": value, "max": total, "prompt_id": prompt_id, "node": node_id}
        server.send_sync("progress", progress, server.client_id)

    return hook
