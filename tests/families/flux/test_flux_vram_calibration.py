"""The Flux family's VRAM estimate against peaks measured on a GPU (bench/vram_peaks.json): never below a
measured peak, and within 15% of it. A new measurement is a new row in that file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kt_testing.comfy_runtime import from_the_pack

TABLE = json.loads((Path(__file__).resolve().parents[3] / "bench" / "vram_peaks.json").read_text())
ROWS = TABLE["rows"]


def test_the_table_has_measurements():
    assert ROWS and all(row["measured_gib"] > 0 and row["source"] for row in ROWS)


@pytest.mark.parametrize("row", ROWS, ids=[row["name"] for row in ROWS])
def test_the_estimate_is_at_or_above_the_measured_peak_and_within_15_percent(row, comfy_runtime):
    estimate_vram = from_the_pack("comfy_adapter.families.flux.vram").estimate_vram
    estimate = estimate_vram(**TABLE["common"]["settings"], **row["settings"])
    measured = row["measured_gib"]
    print(f"\n{row['name']}: estimate {estimate.peak:.1f} GiB, measured {measured:.1f} GiB")
    # legitimate: 1.005 to 1.073 times the measured peak (the 5 rows, measured). The estimate
    # with one term broken (in a scratch copy, measured): without OVERHEAD_GIB 0.958 of a peak,
    # without the activations 0.57; a checkpointed block's input counted in fp32 1.22,
    # BLOCK_WORKING_BYTES doubled 1.44, fp8 weights counted as bf16 1.71
    assert measured <= estimate.peak <= 1.15 * measured
