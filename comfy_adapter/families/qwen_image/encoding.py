"""A Qwen-Image-Edit sample encoded as sampling encodes it: by ComfyUI's own
`TextEncodeQwenImageEditPlus` node class (`comfy_extras/nodes_qwen.py`), run on the caption and
the sample's reference images. The node puts each image into the text as vision tokens
("Picture N: ...", the image at about 384 x 384 px) and, given the VAE, encodes it at about
1024 x 1024 px (sides multiples of 8) into the conditioning's `reference_latents`: training
gets exactly that text and those latents. The empty prompt (caption dropout) is the same node
with the same images and no VAE (its reference latents are the sample's, already encoded).
"""

from __future__ import annotations

import numpy as np
import torch

from ...comfy_registry import node_class

NODE = "TextEncodeQwenImageEditPlus"
NODE_FILE = "nodes_qwen.py"  # where ComfyUI keeps it (comfy_extras/)
MAX_REFERENCES = 3  # the node's image1 .. image3


def encodes_for_qwen_image(clip) -> bool:
    """The CLIP is Qwen-Image's text encoder (CLIPLoader type qwen_image: `QwenImageTEModel`)."""
    import comfy.text_encoders.qwen_image

    return isinstance(clip.cond_stage_model, comfy.text_encoders.qwen_image.QwenImageTEModel)


def sample_encoder(vae, clip):
    """`trainer_core.dataset.SampleEncoder` running the node class with `clip` and `vae`."""
    node = node_class(NODE, NODE_FILE)

    def encode(caption: str, images: list[np.ndarray], with_references: bool):
        if len(images) > MAX_REFERENCES:
            raise ValueError(
                f"a sample has {len(images)} reference images; Qwen-Image-Edit's encoder "
                f"({NODE}) takes at most {MAX_REFERENCES}: keep 3 control images per sample"
            )
        tensors = [torch.from_numpy(np.ascontiguousarray(pixels))[None] for pixels in images]
        inputs = {f"image{i + 1}": tensor for i, tensor in enumerate(tensors)}
        output = node.execute(clip=clip, prompt=caption, vae=vae if with_references else None, **inputs)
        ((context, extras),) = output.result[0]
        pooled = extras.get("pooled_output")
        latents = (
            [latent[0].cpu() for latent in extras.get("reference_latents", [])] if with_references else []
        )
        return context[0].cpu(), (pooled[0].cpu() if pooled is not None else torch.zeros(0)), latents

    return encode
