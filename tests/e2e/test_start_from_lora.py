"""TrainLoRA's `start_from_lora` through a real ComfyUI server: a kohya-named and a
diffusers-named (ai-toolkit / SimpleTuner) LoRA in models/loras seed a new run. With a learning
rate of 1e-7 and two steps, the saved LoRA must be the seed up to lr-sized changes, on the seed's
layers with the seed's ranks (a diffusers q/k/v becomes one fused qkv of rank 3 x 2); a seed of
another rank is refused with the node's own message."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from kt_testing.datasets import write_one_folder
from kt_testing.graphs import training_graph
from kt_testing.runs import error_of
from trainer_core.lora_file import from_state_dict, load

TRAIN_LORA = "KontextTrainer_TrainLoRA"
RANK = 2
H, MLP = 64, 256  # the tiny Flux of KTTest_TinyFluxModel: hidden 64, mlp_ratio 4
# fp32 files: the saved weights are compared with the seed to a few learning-rate steps
SETTINGS = {
    "steps": 2,
    "learning_rate": 1e-7,
    "seed": 5,
    "rank": RANK,
    "alpha": 2.0,
    "save_precision": "fp32",
}
LR_SIZED = 1e-5  # two AdamW steps move each weight by about 2e-7


@pytest.fixture(scope="module")
def dataset(server):
    return write_one_folder(
        server.base_dir / "input" / "kt_start_set", ["a", "b"], references=1, size=(64, 64)
    )


def factors(gen, out, inp, rank=RANK):
    return torch.randn(rank, inp, generator=gen) * 0.5, torch.randn(out, rank, generator=gen) * 0.5


def saved_modules(path, names) -> dict[str, tuple[torch.Tensor, torch.Tensor, float]]:
    state, _ = load(path)
    return {name: (m.down, m.up, m.alpha) for name, m in from_state_dict(state, names).items()}


def start_choices(server) -> list[str]:
    spec = server.get_json(f"/object_info/{TRAIN_LORA}")[TRAIN_LORA]["input"]
    entry = {**spec.get("optional", {}), **spec["required"]}["start_from_lora"]
    return entry[0] if isinstance(entry[0], list) else entry[1]["options"]


def train_from(server, dataset, seed_file: str, name: str, **overrides):
    graph = training_graph(dataset, name, **{**SETTINGS, **overrides})
    graph["5"]["inputs"]["start_from_lora"] = seed_file
    return server.run_prompt(graph)


def succeeded(messages) -> None:
    assert messages[-1]["type"] == "execution_success", messages[-1]["data"].get("exception_message")


def test_kohya_seed(server, dataset):
    gen = torch.Generator().manual_seed(1)
    seed = {  # Flux layer -> (lora_down, lora_up, alpha)
        "double_blocks.0.img_attn.qkv": (*factors(gen, 3 * H, H), 1.0),
        "double_blocks.1.txt_mlp.2": (*factors(gen, H, MLP), 4.0),
        "single_blocks.1.linear2": (*factors(gen, H, H + MLP), 2.0),
    }
    state = {}
    for name, (down, up, alpha) in seed.items():
        stem = "lora_unet_" + name.replace(".", "_")
        state[f"{stem}.lora_down.weight"] = down
        state[f"{stem}.lora_up.weight"] = up
        state[f"{stem}.alpha"] = torch.tensor(alpha)
    loras = server.base_dir / "models" / "loras"
    loras.mkdir(parents=True, exist_ok=True)
    save_file(state, str(loras / "kt_seed_kohya.safetensors"))
    assert "kt_seed_kohya.safetensors" in start_choices(server)

    _, messages = train_from(server, dataset, "kt_seed_kohya.safetensors", "kt_from_kohya")
    succeeded(messages)
    saved = saved_modules(loras / "kt_from_kohya.safetensors", list(seed))
    assert set(saved) == set(seed)  # the seed's layers, not the target preset's
    for name, (down, up, alpha) in seed.items():
        got_down, got_up, got_alpha = saved[name]
        assert got_down.shape == down.shape and got_up.shape == up.shape  # the seed's rank
        assert got_alpha == alpha
        assert (got_down - down).abs().max() <= LR_SIZED and (got_up - up).abs().max() <= LR_SIZED

    # the same file with the rank widget at 4 is refused with what to do
    _, refused = train_from(server, dataset, "kt_seed_kohya.safetensors", "kt_from_kohya_r4", rank=4)
    assert "the LoRA file has rank 2 but rank is set to 4; set rank to 2 to start from it" in error_of(
        refused
    )
    assert not (loras / "kt_from_kohya_r4.safetensors").exists()


def test_diffusers_seed_is_fused(server, dataset):
    gen = torch.Generator().manual_seed(2)
    q, k, v = factors(gen, H, H), factors(gen, H, H), factors(gen, H, H)
    mlp_in, proj = factors(gen, MLP, H), factors(gen, H, H)
    parts = {  # diffusers layer -> (lora_A, lora_B); peft files carry no alpha (alpha = rank)
        "transformer_blocks.1.attn.to_q": q,
        "transformer_blocks.1.attn.to_k": k,
        "transformer_blocks.1.attn.to_v": v,
        "single_transformer_blocks.0.proj_mlp": mlp_in,  # linear1's MLP rows only
        "transformer_blocks.0.attn.to_out.0": proj,
    }
    state = {}
    for layer, (down, up) in parts.items():
        state[f"transformer.{layer}.lora_A.weight"] = down
        state[f"transformer.{layer}.lora_B.weight"] = up
    loras = server.base_dir / "models" / "loras"
    loras.mkdir(parents=True, exist_ok=True)
    save_file(state, str(loras / "kt_seed_diffusers.safetensors"))

    _, messages = train_from(server, dataset, "kt_seed_diffusers.safetensors", "kt_from_diffusers")
    succeeded(messages)
    fused = ["double_blocks.1.img_attn.qkv", "single_blocks.0.linear1", "double_blocks.0.img_attn.proj"]
    saved = saved_modules(loras / "kt_from_diffusers.safetensors", [*fused, "double_blocks.1.img_attn.proj"])
    assert set(saved) == set(fused)

    def delta(name):
        down, up, alpha = saved[name]
        return (alpha / down.shape[0]) * up @ down

    # expected deltas by hand: each part in its rows (q 0:64, k 64:128, v 128:192; MLP 192:448)
    qkv = torch.zeros(3 * H, H)
    qkv[0:64], qkv[64:128], qkv[128:192] = q[1] @ q[0], k[1] @ k[0], v[1] @ v[0]
    linear1 = torch.zeros(3 * H + MLP, H)
    linear1[192:448] = mlp_in[1] @ mlp_in[0]
    expected = {
        "double_blocks.1.img_attn.qkv": (qkv, 3 * RANK),
        "single_blocks.0.linear1": (linear1, RANK),
        "double_blocks.0.img_attn.proj": (proj[1] @ proj[0], RANK),
    }
    for name, (want, rank) in expected.items():
        assert saved[name][0].shape[0] == rank
        assert (delta(name) - want).abs().max() <= 1e-4 * want.abs().max(), name
