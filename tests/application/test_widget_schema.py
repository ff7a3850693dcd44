"""The widget schema (application/widget_schema.py) against the settings it presents: each
table names every field of its dataclasses exactly once, the nodes show what it says, and the
run file of the command line carries the same text."""

from __future__ import annotations

import dataclasses

import pytest


@pytest.fixture(scope="module")
def schema(pack_import):
    return pack_import("application.widget_schema")


def field_names(*owners) -> list[str]:
    return [f.name for owner in owners for f in dataclasses.fields(owner)]


def test_each_table_names_every_field_of_its_settings_once(schema, pack_import):
    config = pack_import("trainer_core.config").TrainConfig
    run_config = pack_import("trainer_core.run_config")
    tables = {
        "TRAIN_LORA": (config, run_config.TrainerOptions),
        "LOAD_KONTEXT_DATASET": (pack_import("trainer_core.dataset_options").DatasetOptions,),
        "PREVIEW_SAMPLER": (pack_import("trainer_core.preview_options").PreviewOptions,),
        "MODEL_FILES": (run_config.ModelFiles,),
        "COMFYUI": (run_config.ComfyUISection,),
    }
    for table, owners in tables.items():
        names = [row.name for row in getattr(schema, table)]
        assert sorted(names) == sorted(field_names(*owners)), table
        assert all(row.tooltip.strip() for row in getattr(schema, table)), table


@pytest.mark.parametrize(
    ("node", "table"),
    [
        ("KontextTrainer_TrainLoRA", "TRAIN_LORA"),
        ("KontextTrainer_LoadKontextDataset", "LOAD_KONTEXT_DATASET"),
        ("KontextTrainer_PreviewSampler", "PREVIEW_SAMPLER"),
    ],
)
def test_each_node_shows_its_table_in_order(comfy_runtime, schema, node, table):
    """What ComfyUI lists for the node (/object_info's source): the table's widgets, in its
    order (a saved workflow's widget values are positional), each with its tooltip and flag."""
    spec = comfy_runtime.nodes.NODE_CLASS_MAPPINGS[node].INPUT_TYPES()
    declared = {**spec["required"], **spec.get("optional", {})}
    rows = getattr(schema, table)
    order = [name for name in declared if name in {row.name for row in rows}]
    assert order == [row.name for row in rows]
    for row in rows:
        options = declared[row.name][1]
        assert options["tooltip"] == row.tooltip, row.name
        assert options.get("advanced", False) == row.advanced, row.name
        assert (row.name in spec.get("optional", {})) == row.optional, row.name


def test_the_run_file_carries_the_same_tooltips(schema, pack_import, tmp_path):
    run_config = pack_import("trainer_core.run_config")
    config = run_config.parse_run_config(
        {"model": {"diffusion_model": "m.safetensors", "vae": "ae.safetensors", "text_encoders": ["t5"]}},
        "run.toml",
        tmp_path,
    )
    text = " ".join(line[2:] for line in run_config.dump_run_config(config, schema.RUN_FILE).splitlines())
    for section, rows in schema.RUN_FILE.items():
        for row in rows.values():
            described = ("(advanced) " if row.advanced else "") + row.tooltip
            assert " ".join(described.split()) in " ".join(text.split()), (section, row.name)


def test_the_basic_settings_say_their_typical_values_and_what_each_preset_adapts(schema, pack_import):
    """Issue 45 item 5: steps, learning_rate and rank gave no typical value, and targets did not
    say how its presets differ. Each preset the node offers is named with what it adapts."""
    rows = {row.name: row.tooltip for row in schema.TRAIN_LORA}
    for name in ("steps", "learning_rate", "rank"):
        assert "Typical" in rows[name] and any(c.isdigit() for c in rows[name]), (name, rows[name])
    presets = [preset.value for preset in pack_import("trainer_core.choices").TargetPreset]
    assert presets and all(f"{preset}: " in rows["targets"] for preset in presets), rows["targets"]
