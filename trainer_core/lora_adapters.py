"""peft LoRA layers on a torch module, for the lifetime of one training run.

`attach_lora` wraps the named Linear layers with peft's LoRA layers (forward
`base(x) + lora_B(lora_A(dropout(x))) * alpha / rank`: no full-size weight is ever formed),
freezes everything else and returns an `AttachedLora`. `AttachedLora.detach()` puts the
original Linear objects back and restores every `requires_grad` flag, so the module is
exactly what it was before (same objects, same parameters, same state-dict keys).

LoRA weights are kept in float32 whatever the base weights are (bf16, fp16, fp8; float64 stays
float64 for exact gradient checks): peft would create them in the base dtype, and fp8 cannot
be trained.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from .lora_file import LoraModule

ADAPTER = "default"


def _lora_config(
    names: Sequence[str], rank: int, alpha: float, dropout: float, per_module=None, linear_types=()
):
    from peft import LoraConfig
    from peft.tuners.lora import Linear as LoraLinear

    config = {"r": rank, "lora_alpha": alpha, "lora_dropout": dropout, "target_modules": list(names)}
    if per_module:
        # peft matches pattern keys as regular expressions against the module name.
        config["rank_pattern"] = {re.escape(n): m.rank for n, m in per_module.items()}
        config["alpha_pattern"] = {re.escape(n): m.alpha for n, m in per_module.items()}
    config = LoraConfig(**config)
    if linear_types:
        # peft's own LoRA Linear (forward `base(x) + lora_B(lora_A(dropout(x))) * scaling`) around
        # Linear layers that are not `nn.Linear` (a quantized Linear holding a packed weight):
        # the base layer computes with its own weight, peft never reads it
        config._register_custom_module({cls: LoraLinear for cls in linear_types})
    return config


@dataclass
class AttachedLora:
    model: torch.nn.Module
    names: list[str]
    _grad_flags: dict[str, bool] = field(repr=False)
    _attributes: frozenset[str] = field(default=frozenset(), repr=False)

    def layers(self):
        """(name, peft LoRA layer) pairs, in model order."""
        return [(name, self.model.get_submodule(name)) for name in self.names]

    def parameters(self) -> list[torch.nn.Parameter]:
        params = []
        for _, layer in self.layers():
            params += [layer.lora_A[ADAPTER].weight, layer.lora_B[ADAPTER].weight]
        return params

    def modules(self) -> dict[str, LoraModule]:
        """The current LoRA as `LoraModule`s (detached copies), ready for `lora_file`."""
        out = {}
        for name, layer in self.layers():
            out[name] = LoraModule(
                layer.lora_A[ADAPTER].weight.detach().clone(),
                layer.lora_B[ADAPTER].weight.detach().clone(),
                float(layer.lora_alpha[ADAPTER]),
            )
        return out

    def load_modules(self, modules: Mapping[str, LoraModule]) -> None:
        """Copy saved LoRA weights in (rank and alpha must already match)."""
        with torch.no_grad():
            for name, layer in self.layers():
                module = modules[name]
                if layer.r[ADAPTER] != module.rank or float(layer.lora_alpha[ADAPTER]) != module.alpha:
                    raise ValueError(f"{name}: the LoRA was attached with a different rank or alpha")
                layer.lora_A[ADAPTER].weight.copy_(module.down)
                layer.lora_B[ADAPTER].weight.copy_(module.up)

    def detach(self) -> None:
        """Put the original Linear layers back and restore `requires_grad` everywhere."""
        from peft.tuners.lora import LoraLayer

        for name, layer in list(self.model.named_modules()):
            if isinstance(layer, LoraLayer):
                parent_name, _, child = name.rpartition(".")
                parent = self.model.get_submodule(parent_name) if parent_name else self.model
                setattr(parent, child, layer.get_base_layer())
        for name, param in self.model.named_parameters():
            param.requires_grad_(self._grad_flags.get(name, param.requires_grad))
        for attribute in set(vars(self.model)) - self._attributes:  # peft's bookkeeping (peft_config)
            delattr(self.model, attribute)
        self.names = []


def attach_lora(
    model: torch.nn.Module,
    names: Sequence[str],
    rank: int,
    alpha: float,
    dropout: float = 0.0,
    initial: Mapping[str, LoraModule] | None = None,
    device: torch.device | str | None = None,
    linear_types: Sequence[type] = (),
) -> AttachedLora:
    """Wrap `names` (Linear layers of `model`) with trainable float32 LoRA layers.

    A layer is an `nn.Linear` or one of `linear_types`: other classes that compute a linear map
    and have `in_features` / `out_features` (e.g. a quantized Linear whose weight is packed);
    both get the same peft LoRA layer, whose base call is the layer's own forward.

    The LoRA factors live on `device` (the compute device), or where each base weight is if
    None. A partial load leaves some base weights on the CPU (cast to the GPU per use): their
    factors still belong on the GPU with the activations.

    With `initial` (e.g. a LoRA file read by `lora_file.from_state_dict`), its modules are
    the targets and their rank, alpha and weights are used; otherwise peft's initialisation
    (lora_A Kaiming-uniform from torch's global CPU RNG, lora_B zero: the model is unchanged).
    lora_A is drawn in float32 on the CPU after peft has built the layers, so the start is the
    same for fp32, bf16 and fp8 base weights and on every device (peft creates the factors in
    the base weight's dtype, which would round the start to bf16 or e4m3).
    """
    from peft import inject_adapter_in_model
    from peft.tuners.lora import LoraLayer

    from .lora_dropout import per_sample_dropout_

    if any(isinstance(m, LoraLayer) for m in model.modules()):
        raise RuntimeError("this model already has LoRA layers attached; detach them first")
    if initial is not None:
        unknown = [name for name in initial if name not in dict(model.named_modules())]
        if unknown:
            raise ValueError(
                f"the LoRA has layers this model does not: {', '.join(unknown[:5])}; "
                "was it trained for another model?"
            )
        # model order, whatever order the file listed them in (optimizer state depends on it)
        names = [name for name, _ in model.named_modules() if name in initial]
    names = list(names)
    if not names:
        raise ValueError("no layers to train: the target preset matched nothing in this model")
    modules = dict(model.named_modules())
    linear_types = tuple(linear_types)
    for name in names:
        if not isinstance(modules.get(name), (torch.nn.Linear, *linear_types)):
            raise ValueError(f"{name!r} is not a Linear layer of this model")
    if initial is not None:
        for name, module in initial.items():
            base = modules[name]
            if module.down.shape[1] != base.in_features or module.up.shape[0] != base.out_features:
                raise ValueError(
                    f"{name}: the LoRA is {module.up.shape[0]}x{module.down.shape[1]} but the layer is "
                    f"{base.out_features}x{base.in_features}; was it trained for another model?"
                )

    grad_flags = {name: p.requires_grad for name, p in model.named_parameters()}
    attached = AttachedLora(model, names, grad_flags, frozenset(vars(model)))
    try:
        inject_adapter_in_model(_lora_config(names, rank, alpha, dropout, initial, linear_types), model)
        for name, layer in attached.layers():
            base_dtype = modules[name].weight.dtype  # a packed weight reports its compute dtype
            dtype = torch.float64 if base_dtype == torch.float64 else torch.float32
            layer.lora_A.to(device=device, dtype=dtype)
            layer.lora_B.to(device=device, dtype=dtype)
            if initial is None:
                weight = layer.lora_A[ADAPTER].weight
                start = torch.empty(weight.shape, dtype=dtype)
                torch.nn.init.kaiming_uniform_(start, a=math.sqrt(5))  # peft's (and nn.Linear's) init
                with torch.no_grad():
                    weight.copy_(start)
        for param in model.parameters():
            param.requires_grad_(False)
        for param in attached.parameters():
            param.requires_grad_(True)
        if initial is not None:
            attached.load_modules(initial)
        # masks per global sample, not per batch or process (`lora_dropout`)
        per_sample_dropout_([layer for _, layer in attached.layers()], dropout)
    except BaseException:
        attached.detach()
        raise
    return attached
