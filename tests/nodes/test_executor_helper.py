"""kt_testing.executor runs nodes on ComfyUI's own executor path: prompt thread, inference mode,
validation, hidden inputs, messages; a node's exception reaches the test unchanged."""

from __future__ import annotations

import threading

import pytest
import torch

from kt_testing.executor import InGraph, PromptRejected, register_test_node, run_graph, run_node

PROBE = "KTTest_Probe"
COUNTER = "KTTest_Counter"


class ProbeFailure(Exception):
    """Raised by the probe on request: its type and message must reach the test unchanged."""


class Probe:
    """Test-only node: reports where it runs and does what `action` says with `payload`."""

    RETURN_TYPES = ("BOOLEAN", "KT_PROBE", "KT_PROBE", "STRING")
    RETURN_NAMES = ("inference_mode", "made", "payload", "thread")
    FUNCTION = "probe"
    OUTPUT_NODE = True
    CATEGORY = "kontext_trainer_tests"

    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {
                "action": ("STRING", {"default": "report"}),
                "size": ("INT", {"default": 2, "max": 8}),
            },
            "optional": {"payload": ("KT_PROBE",)},
            "hidden": {"unique_id": "UNIQUE_ID", "extra_pnginfo": "EXTRA_PNGINFO"},
        }

    def probe(self, action, size, payload=None, unique_id=None, extra_pnginfo=None):
        import comfy.model_management
        import comfy.utils
        from server import PromptServer

        if action == "raise":
            raise ProbeFailure(f"probe {unique_id} failed on purpose")
        if action == "interrupt":
            comfy.model_management.interrupt_current_processing()
            comfy.model_management.throw_exception_if_processing_interrupted()
        if action == "update_in_new_thread":  # the resume bug: a loaded tensor updated by a worker
            failures = []

            def update():
                try:
                    payload.add_(1)
                except RuntimeError as ex:
                    failures.append(ex)

            worker = threading.Thread(target=update)
            worker.start()
            worker.join()
            if failures:
                raise failures[0]
        if action == "progress":
            comfy.utils.ProgressBar(size).update(1)
            PromptServer.instance.send_sync("kt_test.event", {"node": unique_id, "extra": extra_pnginfo})
        made = torch.zeros(size)
        return {
            "ui": {"probe": [unique_id]},
            "result": (torch.is_inference_mode_enabled(), made, payload, threading.current_thread().name),
        }


class Counter:
    """Test-only node without NOT_IDEMPOTENT: counts its runs (a cached output would not)."""

    RETURN_TYPES = ("INT",)
    FUNCTION = "count"
    CATEGORY = "kontext_trainer_tests"
    calls = 0

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"value": ("INT", {"default": 0})}}

    def count(self, value):
        type(self).calls += 1
        return (value + type(self).calls,)


@pytest.fixture(scope="module", autouse=True)
def probes(comfy_runtime):
    register_test_node(PROBE, Probe)
    register_test_node(COUNTER, Counter)


def test_a_node_runs_under_inference_mode_on_a_prompt_thread():
    inference_mode, made, _, thread = run_node(PROBE, {"action": "report", "size": 3}).outputs
    assert inference_mode is True
    assert made.is_inference() and made.shape == (3,)
    assert thread != threading.current_thread().name


def test_objects_reach_the_node_unchanged_and_in_graph_values_are_built_under_inference_mode():
    tensor = torch.ones(2)
    *_, payload, _ = run_node(PROBE, {"action": "report", "size": 2, "payload": tensor}).outputs
    assert payload is tensor and not payload.is_inference()
    *_, built, _ = run_node(
        PROBE, {"action": "report", "size": 2, "payload": InGraph(lambda: torch.ones(2))}
    ).outputs
    assert built.is_inference()


def test_in_place_update_of_a_loaded_tensor_in_another_thread_fails_like_on_the_server():
    with pytest.raises(RuntimeError, match="Inplace update to inference tensor outside InferenceMode"):
        run_node(
            PROBE, {"action": "update_in_new_thread", "size": 2, "payload": InGraph(lambda: torch.ones(2))}
        )


def test_the_original_exception_reaches_the_test():
    with pytest.raises(ProbeFailure, match="probe 7 failed on purpose") as caught:
        run_node(PROBE, {"action": "raise", "size": 2}, node_id="7")
    assert type(caught.value) is ProbeFailure


def test_an_interrupt_surfaces_as_comfyuis_interrupt_exception():
    import comfy.model_management

    with pytest.raises(comfy.model_management.InterruptProcessingException):
        run_node(PROBE, {"action": "interrupt", "size": 2})
    assert run_node(PROBE, {"action": "report", "size": 2}).outputs[0] is True  # the next run is clean


def test_ui_messages_hidden_inputs_and_progress_arrive_as_on_the_server():
    result = run_node(
        PROBE, {"action": "progress", "size": 4}, node_id="5", extra_pnginfo={"workflow": {"id": "w"}}
    )
    assert result.ui == {"probe": ["5"]}
    assert result.events("kt_test.event") == [{"node": "5", "extra": {"workflow": {"id": "w"}}}]
    assert [(p["value"], p["max"], p["node"]) for p in result.events("progress")] == [(1, 4, "5")]
    assert [e["node"] for e in result.events("executed")] == ["5"]
    assert [e["prompt_id"] for e in result.events("execution_success")] == [result.prompt_id]


def test_widgets_pass_comfyuis_validation():
    with pytest.raises(PromptRejected, match="bigger than max"):
        run_node(PROBE, {"action": "report", "size": 9})


def test_no_output_is_served_from_an_earlier_call():
    before = Counter.calls
    assert run_node(COUNTER, {"value": 10}).outputs == (10 + before + 1,)
    assert run_node(COUNTER, {"value": 10}).outputs == (10 + before + 2,)


def test_a_graph_links_nodes_and_returns_every_output():
    prompt = {
        "1": {"class_type": COUNTER, "inputs": {"value": 1}},
        "2": {"class_type": PROBE, "inputs": {"action": "report", "size": ["1", 0]}},
    }
    result = run_graph(prompt)
    (counted,) = result.outputs["1"]
    assert result.outputs["2"][1].shape == (counted,)
    assert result.ui == {"2": {"probe": ["2"]}}
