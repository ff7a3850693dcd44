"""Row-scaled e4m3 against hand computations: one scale per row mapping the row's largest
magnitude to 448, values rounded to e4m3's grid, dequantisation in the compute dtype, and the
layers that get this storage."""

from __future__ import annotations

import torch

from trainer_core.fp8_rows import (
    E4M3,
    ScaleRows,
    dequantize_rows,
    quantize_rows,
    row_scales,
    scaled_layer_names,
)


def test_each_rows_largest_magnitude_maps_to_448():
    weight = torch.tensor([[1.0, -2.0, 0.5], [0.0, 0.0, 0.0], [1344.0, 1.0, -1.0]])
    # by hand: 2 / 448; an all-zero row gets the floor 1e-12 / 448; 1344 / 448 = 3
    expected = torch.tensor([2.0 / 448.0, 1e-12 / 448.0, 3.0])
    torch.testing.assert_close(row_scales(weight), expected, rtol=1e-7, atol=0.0)
    assert row_scales(weight.bfloat16()).dtype == torch.float32


def test_values_are_the_row_over_its_scale_on_e4m3s_grid():
    weight = torch.tensor(
        [
            [1.0, -2.0, 0.5, 0.0],  # / (2/448): 224, -448, 112, 0, all on the grid
            [0.0, 0.0, 0.0, 0.0],  # stays zero, no division by zero
            [448.0, 300.0, 272.0, 304.0],  # scale 1; on [256, 512) the grid step is 32
        ]
    )
    values, scale = quantize_rows(weight)
    assert values.dtype == E4M3 and values.shape == weight.shape
    assert scale.dtype == torch.float32 and scale.shape == (3,)
    expected = torch.tensor(
        [
            [224.0, -448.0, 112.0, 0.0],
            [0.0, 0.0, 0.0, 0.0],
            # 300 -> 288 (nearest); the ties 272 and 304 go to the even mantissa: 256 and 320
            [448.0, 288.0, 256.0, 320.0],
        ]
    )
    assert torch.equal(values.float(), expected)


def test_dequantized_rows_give_the_weight_back_within_e4m3s_rounding():
    weight = torch.tensor([[1.0, -2.0, 0.5]])
    values, scale = quantize_rows(weight)
    assert torch.equal(dequantize_rows(values.float(), scale), weight)  # exact on the grid

    weight = (
        torch.randn(16, 256, generator=torch.Generator().manual_seed(0)) * torch.logspace(-3, 2, 16)[:, None]
    )
    values, scale = quantize_rows(weight)
    error = (dequantize_rows(values.float(), scale) - weight).abs()
    # 3 mantissa bits: at most half a step, |w| / 16, for normal numbers; below e4m3's smallest
    # normal (2^-6) the step is the smallest subnormal, 2^-9, times the row's scale
    bound = torch.maximum(weight.abs() / 16, scale[:, None] * 2.0**-10)
    assert bool((error <= bound * (1 + 1e-6)).all())


def test_dequantizing_computes_in_the_weights_dtype_and_device():
    values = torch.tensor([[224.0, -448.0], [448.0, 32.0]], dtype=torch.bfloat16)
    scale = torch.tensor([2.0 / 448.0, 0.5])
    out = dequantize_rows(values, scale)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out[1], torch.tensor([224.0, 16.0], dtype=torch.bfloat16))  # exact in bf16
    meta = dequantize_rows(torch.empty(2, 2, device="meta"), scale)  # the scale follows the weight
    assert meta.device.type == "meta"
    assert torch.equal(ScaleRows(scale)(values), out)


def test_storage_is_one_byte_per_weight_plus_one_float_per_row():
    values, scale = quantize_rows(torch.randn(12, 3072, generator=torch.Generator().manual_seed(0)))
    assert (values.element_size(), values.shape) == (1, (12, 3072))
    assert (scale.element_size(), scale.shape) == (4, (12,))


class _Block(torch.nn.Module):
    def __init__(self, names):
        super().__init__()
        for name in names:
            parent = self
            *path, leaf = name.split(".")
            for part in path:
                if not hasattr(parent, part):
                    parent.add_module(part, torch.nn.Module())
                parent = getattr(parent, part)
            parent.add_module(leaf, torch.nn.Linear(2, 2))


class _LoraWrapped(torch.nn.Module):
    """The shape peft gives a wrapped layer: `base_layer` plus Linear factors."""

    def __init__(self):
        super().__init__()
        self.base_layer = torch.nn.Linear(2, 2)
        self.lora_A = torch.nn.ModuleDict({"default": torch.nn.Linear(2, 1)})
        self.lora_B = torch.nn.ModuleDict({"default": torch.nn.Linear(1, 2)})


def test_scaled_layers_are_the_block_attention_and_mlp_linears():
    double = ["img_mod.lin", "img_attn.qkv", "img_attn.proj", "img_mlp.0", "img_mlp.2", "txt_attn.qkv"]
    flux = torch.nn.Module()
    flux.img_in = torch.nn.Linear(2, 2)
    flux.double_blocks = torch.nn.ModuleList([_Block(double)])
    flux.single_blocks = torch.nn.ModuleList([_Block(["linear1", "linear2", "modulation.lin"])])
    flux.final_layer = _Block(["linear"])
    flux.double_blocks[0].img_attn.qkv = _LoraWrapped()  # counted once, by its own name
    seen = []

    def attention_mlp(names):  # the family's choice (Flux's: block attention and MLP)
        seen.append(names)
        return [n for n in names if n.rsplit(".", 1)[0].endswith(("attn", "mlp")) or "linear" in n[-8:-1]]

    # the family chooses among every Linear layer, in model order, a LoRA-wrapped one once
    assert scaled_layer_names(flux, attention_mlp) == [
        "double_blocks.0.img_attn.qkv",
        "double_blocks.0.img_attn.proj",
        "double_blocks.0.img_mlp.0",
        "double_blocks.0.img_mlp.2",
        "double_blocks.0.txt_attn.qkv",
        "single_blocks.0.linear1",
        "single_blocks.0.linear2",
    ]
    assert seen == [
        [
            "img_in",
            *(f"double_blocks.0.{name}" for name in double),
            "single_blocks.0.linear1",
            "single_blocks.0.linear2",
            "single_blocks.0.modulation.lin",
            "final_layer.linear",
        ]
    ]
