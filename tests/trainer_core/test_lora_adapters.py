"""peft LoRA layers attach, compute base + (alpha / rank) B A x, and detach without a trace."""

from __future__ import annotations

import pytest
import torch

from trainer_core.lora_adapters import attach_lora
from trainer_core.lora_file import LoraModule


class Toy(torch.nn.Module):
    def __init__(self, dtype=torch.float32):
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.attn = torch.nn.Linear(6, 6, dtype=dtype)
        self.mlp = torch.nn.Sequential(
            torch.nn.Linear(6, 8, dtype=dtype), torch.nn.GELU(), torch.nn.Linear(8, 6, dtype=dtype)
        )
        self.norm = torch.nn.LayerNorm(6, dtype=dtype)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=gen))
        self.norm.weight.requires_grad_(False)  # a flag detach must restore as it was

    def forward(self, x):
        return self.mlp(self.norm(self.attn(x)))


def test_zero_init_leaves_output_bit_identical_and_trains_only_lora():
    toy, x = Toy(), torch.randn(3, 6)
    before = toy(x)
    lora = attach_lora(toy, ["attn", "mlp.0"], rank=2, alpha=4.0)
    assert torch.equal(toy(x), before)
    trainable = {n for n, p in toy.named_parameters() if p.requires_grad}
    assert trainable == {
        "attn.lora_A.default.weight",
        "attn.lora_B.default.weight",
        "mlp.0.lora_A.default.weight",
        "mlp.0.lora_B.default.weight",
    }
    assert len(lora.parameters()) == 4


def test_forward_is_base_plus_scaled_low_rank_product():
    toy, x = Toy(), torch.randn(3, 6)
    attn_weight, attn_bias = toy.attn.weight.detach().clone(), toy.attn.bias.detach().clone()
    gen = torch.Generator().manual_seed(1)
    down, up = torch.randn(2, 6, generator=gen), torch.randn(6, 2, generator=gen)
    lora = attach_lora(toy, ["attn"], rank=2, alpha=4.0)
    lora.load_modules({"attn": LoraModule(down, up, 4.0)})
    expected = x @ attn_weight.T + attn_bias + (4.0 / 2) * (x @ down.T @ up.T)
    torch.testing.assert_close(toy.attn(x), expected, rtol=1e-6, atol=1e-6)


def test_detach_restores_modules_flags_and_attributes():
    toy = Toy()
    originals = {name: toy.get_submodule(name) for name in ("attn", "mlp.0", "mlp.2")}
    keys = list(toy.state_dict())
    attributes = set(vars(toy))
    lora = attach_lora(toy, ["attn", "mlp.0", "mlp.2"], rank=2, alpha=2.0, dropout=0.1)
    assert toy.attn is not originals["attn"]
    lora.detach()
    for name, module in originals.items():
        assert toy.get_submodule(name) is module
    assert list(toy.state_dict()) == keys
    assert {n for n, p in toy.named_parameters() if not p.requires_grad} == {"norm.weight"}
    assert set(vars(toy)) == attributes  # no peft_config left behind
    attach_lora(toy, ["attn"], rank=1, alpha=1.0).detach()  # attachable again


def test_low_precision_base_gets_float32_adapters():
    toy = Toy(torch.bfloat16)
    lora = attach_lora(toy, ["attn"], rank=2, alpha=2.0)
    assert {p.dtype for p in lora.parameters()} == {torch.float32}
    assert toy.attn.get_base_layer().weight.dtype == torch.bfloat16
    out = toy(torch.randn(2, 6, dtype=torch.bfloat16))
    out.float().sum().backward()
    assert toy.attn.lora_B.default.weight.grad is not None


def test_initial_lora_sets_targets_rank_alpha_and_weights():
    toy = Toy()
    gen = torch.Generator().manual_seed(2)
    initial = {
        "attn": LoraModule(torch.randn(3, 6, generator=gen), torch.randn(6, 3, generator=gen), 1.5),
        "mlp.2": LoraModule(torch.randn(1, 8, generator=gen), torch.randn(6, 1, generator=gen), 0.5),
    }
    lora = attach_lora(toy, ["mlp.0"], rank=8, alpha=8.0, initial=initial)
    assert lora.names == ["attn", "mlp.2"]
    exported = lora.modules()
    for name, module in initial.items():
        assert exported[name].rank == module.rank and exported[name].alpha == module.alpha
        assert torch.equal(exported[name].down, module.down) and torch.equal(exported[name].up, module.up)
    x = torch.randn(2, 8)
    base = toy.mlp[2].get_base_layer()
    expected = base(x) + 0.5 * (x @ initial["mlp.2"].down.T @ initial["mlp.2"].up.T)
    torch.testing.assert_close(toy.mlp[2](x), expected, rtol=1e-6, atol=1e-6)


def test_errors_name_the_layer():
    toy = Toy()
    with pytest.raises(ValueError, match="'norm' is not a Linear"):
        attach_lora(toy, ["norm"], rank=2, alpha=2.0)
    with pytest.raises(ValueError, match="nothing"):
        attach_lora(toy, [], rank=2, alpha=2.0)
    wrong = {"attn": LoraModule(torch.zeros(2, 5), torch.zeros(6, 2), 2.0)}
    with pytest.raises(ValueError, match="attn: the LoRA is 6x5 but the layer is 6x6"):
        attach_lora(toy, [], rank=2, alpha=2.0, initial=wrong)
    assert isinstance(toy.attn, torch.nn.Linear)  # a refused attach leaves nothing behind
    lora = attach_lora(toy, ["attn"], rank=2, alpha=2.0)
    with pytest.raises(RuntimeError, match="already has LoRA layers"):
        attach_lora(toy, ["mlp.0"], rank=2, alpha=2.0)
    lora.detach()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_the_start_is_the_same_float32_draw_whatever_the_base_dtype(dtype):
    torch.manual_seed(5)
    reference = attach_lora(Toy(), ["attn", "mlp.0"], rank=2, alpha=2.0).modules()
    torch.manual_seed(5)
    low = Toy().to(dtype)
    modules = attach_lora(low, ["attn", "mlp.0"], rank=2, alpha=2.0).modules()
    for name, module in modules.items():
        assert module.down.dtype == torch.float32
        assert torch.equal(module.down, reference[name].down), name  # not rounded to the base dtype
        assert not torch.equal(module.down.to(dtype).float(), module.down)
