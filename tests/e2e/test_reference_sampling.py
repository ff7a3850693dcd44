"""MultiImageConditioning in a real server graph with the stock loaders and KSampler."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.slow


def test_dreamomni2_graph_samples_with_stock_loaders(server, stock_assets):
    import demo_assets

    demo_assets.link_into_models(stock_assets, server.base_dir / "models")
    graph = {
        "unet": {
            "class_type": "UNETLoader",
            "inputs": {"unet_name": stock_assets["flux"].name, "weight_dtype": "default"},
        },
        "vae": {"class_type": "VAELoader", "inputs": {"vae_name": stock_assets["vae"].name}},
        "clip": {
            "class_type": "CLIPLoader",
            "inputs": {"clip_name": stock_assets["clip"].name, "type": "stable_diffusion"},
        },
        "text": {"class_type": "CLIPTextEncode", "inputs": {"clip": ["clip", 0], "text": "swap the hats"}},
        "ref1": {
            "class_type": "EmptyImage",
            "inputs": {"width": 64, "height": 48, "batch_size": 1, "color": 255},
        },
        "ref2": {
            "class_type": "EmptyImage",
            "inputs": {"width": 32, "height": 64, "batch_size": 1, "color": 65280},
        },
        "refs": {
            "class_type": "KontextTrainer_MultiImageConditioning",
            "inputs": {
                "model": ["unet", 0],
                "conditioning": ["text", 0],
                "vae": ["vae", 0],
                "layout": "dreamomni2",
                "reference_resolution": 0,
                "image_1": ["ref1", 0],
                "image_2": ["ref2", 0],
            },
        },
        "latent": {
            "class_type": "EmptySD3LatentImage",
            "inputs": {"width": 32, "height": 32, "batch_size": 1},
        },
        "sample": {
            "class_type": "KSampler",
            "inputs": {
                "model": ["refs", 0],
                "positive": ["refs", 1],
                "negative": ["refs", 1],
                "latent_image": ["latent", 0],
                "seed": 1,
                "steps": 1,
                "cfg": 1.0,
                "sampler_name": "euler",
                "scheduler": "simple",
                "denoise": 1.0,
            },
        },
        "decode": {"class_type": "VAEDecode", "inputs": {"samples": ["sample", 0], "vae": ["vae", 0]}},
        "preview": {"class_type": "PreviewImage", "inputs": {"images": ["decode", 0]}},
    }
    prompt_id, messages = server.run_prompt(graph, timeout=600)
    assert messages[-1]["type"] == "execution_success", messages[-1]
    images = server.history(prompt_id)["outputs"]["preview"]["images"]
    assert len(images) == 1 and images[0]["type"] == "temp"
