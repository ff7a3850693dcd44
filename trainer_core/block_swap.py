"""Block swapping: the frozen weights of N transformer blocks live on an offload device (CPU)
and visit the compute device only while their block runs.

Which blocks: the first N of an order the model's family gives (`first_swapped`); blocks are
numbered in execution order.

When: the block forwards call `before(i)` and `after(i)`. `before` makes block i resident
(waiting for its prefetch if one is in flight) and starts prefetching the next swapped block
in the current direction: increasing indices in the forward pass, decreasing in backward
(gradient checkpointing recomputes blocks during backward, last block first). In the
forward pass `after` sends the block back at once. In backward the recomputed block's own
backward still needs its weights after `after`, so it leaves when the next (lower) block
starts, by which time autograd has finished with it. At most two swapped blocks are
resident at any moment: the one computing and the one arriving. This needs gradient
checkpointing: without it autograd would keep the weights of every block for backward.

How: tensor by tensor. A tensor moves only if it does not require grad (the base weights;
the LoRA parameters stay on the compute device, so the optimizer never sees a device change),
it sits on the compute device when swapping starts, and its module is not one the host
application keeps elsewhere (`keeps_placement`: ComfyUI's partial "lowvram" loads leave some
layers on the CPU and cast them per use; those stay exactly where ComfyUI put them). Each
moved tensor gets one host buffer for the whole run (pinned on CUDA), filled once in
`prepare`. Base weights are frozen, so a departing block is not copied back: its tensors
point at their host buffers again and the device copies are freed. An arriving block is
copied from its host buffers on a side stream into fresh device memory; the compute stream
waits for that copy's event before the block runs, and the device memory is recorded as used
by the compute stream, so the allocator reuses it only after the block's kernels are done.
The host buffers live until `restore`, which waits for every copy and puts each moved tensor
back on the device it came from. On CPU both devices are the CPU: the same scheduler runs
and every transfer is recorded; nothing is copied, except with `poison=True` (tests), where a
departed block's weights are replaced by NaN until it returns, so any use of a block that is
not resident shows up in the results.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

TransferHook = Callable[[str, int], None]  # ("in" | "out", block index)


def first_swapped(order: Sequence[int], blocks_to_swap: int) -> list[int]:
    """The first `blocks_to_swap` block indices of `order` (every block, the one to swap first
    first), sorted."""
    if blocks_to_swap < 0:
        raise ValueError("blocks_to_swap cannot be negative")
    if blocks_to_swap > len(order):
        raise ValueError(f"blocks_to_swap is {blocks_to_swap} but the model has only {len(order)} blocks")
    return sorted(order[:blocks_to_swap])


def in_backward() -> bool:
    """True while autograd runs a backward pass (checkpoint recomputation happens there)."""
    return torch._C._current_graph_task_id() != -1


class _Slot:
    """One moved tensor: the Parameter/buffer object (its `.data` is switched), its host
    buffer and the device it came from."""

    __slots__ = ("home", "host", "tensor")

    def __init__(self, tensor: torch.Tensor, host: torch.Tensor, home: torch.device):
        self.tensor, self.host, self.home = tensor, host, home


class BlockSwapper:
    def __init__(
        self,
        blocks: Sequence[torch.nn.Module],
        swapped: Sequence[int],
        compute_device: torch.device,
        offload_device: torch.device,
        on_transfer: TransferHook | None = None,
        poison: bool = False,
        keeps_placement: Callable[[torch.nn.Module], bool] | None = None,
    ):
        self.blocks = list(blocks)
        self.swapped = sorted(set(swapped))
        self.compute = torch.device(compute_device)
        self.offload = torch.device(offload_device)
        self.on_transfer = on_transfer
        self.poison = poison
        self.keeps_placement = keeps_placement or (lambda module: False)
        self.cuda = self.compute.type == "cuda"
        self.copies = self.compute != self.offload  # False on CPU-only runs: bookkeeping only
        self.stream = torch.cuda.Stream(device=self.compute) if self.cuda else None
        self.resident: set[int] = set()  # swapped blocks currently on the compute device
        self._arrivals: dict[int, object] = {}  # block -> CUDA event of its in-flight copy
        self.slots: dict[int, list[_Slot]] = {}  # filled by prepare()

    def moving_tensors(self, block: torch.nn.Module) -> list[torch.Tensor]:
        """The tensors of `block` that swapping moves (see the module docstring)."""
        seen, chosen = set(), []
        for module in block.modules():
            if self.keeps_placement(module):
                continue
            own = [p for p in module.parameters(recurse=False) if not p.requires_grad]
            for tensor in own + list(module.buffers(recurse=False)):
                if id(tensor) not in seen and tensor.device == self.compute:
                    seen.add(id(tensor))
                    chosen.append(tensor)
        return chosen

    def _host_buffer(self, value: torch.Tensor) -> torch.Tensor:
        if not self.copies:
            return value
        host = torch.empty_like(value, device=self.offload, pin_memory=self.cuda)
        host.copy_(value)
        return host

    # -- moving one block ------------------------------------------------------------------
    def _move(self, index: int, direction: str) -> None:
        if self.on_transfer is not None:
            self.on_transfer(direction, index)
        slots = self.slots[index]
        if direction == "out":  # frozen weights: the host buffer already holds the values
            for slot in slots:
                slot.tensor.data = torch.full_like(slot.host, float("nan")) if self.poison else slot.host
            return
        if not self.copies or not self.cuda:
            for slot in slots:
                slot.tensor.data = slot.host.to(self.compute) if self.copies else slot.host
            return
        compute_stream = torch.cuda.current_stream(self.compute)
        with torch.cuda.stream(self.stream):
            for slot in slots:
                arrived = torch.empty_like(slot.host, device=self.compute)
                arrived.copy_(slot.host, non_blocking=True)  # the host buffer outlives the copy
                arrived.record_stream(compute_stream)  # freed only after the block's kernels
                slot.tensor.data = arrived
            event = torch.cuda.Event()
            event.record(self.stream)
        self._arrivals[index] = event

    def _arrive(self, index: int) -> None:
        if index in self.resident:
            return
        self._move(index, "in")
        self.resident.add(index)

    def _depart(self, index: int) -> None:
        if index not in self.resident:
            return
        self._arrivals.pop(index, None)
        self._move(index, "out")
        self.resident.discard(index)

    # -- the schedule ------------------------------------------------------------------------
    def prepare(self) -> None:
        """Give every moving tensor its host buffer and send the swapped blocks there (once,
        before training)."""
        for index in self.swapped:
            tensors = self.moving_tensors(self.blocks[index])
            self.slots[index] = [_Slot(t, self._host_buffer(t.data), t.device) for t in tensors]
            self.resident.add(index)
            self._depart(index)

    def before(self, index: int, backward: bool | None = None) -> None:
        backward = in_backward() if backward is None else backward
        upcoming = [i for i in self.swapped if (i < index if backward else i > index)]
        following = (max(upcoming) if backward else min(upcoming)) if upcoming else None
        if backward:  # every block but this one and the next has finished its backward: those
            # above this one, and those of an earlier backward pass that began at the top again
            # (a batch split by caption length runs its forwards, then each one's backward)
            for done in [i for i in self.resident if i not in (index, following)]:
                self._depart(done)
        if index in self.slots:
            self._arrive(index)
            event = self._arrivals.pop(index, None)
            if event is not None:
                torch.cuda.current_stream(self.compute).wait_event(event)
        if following is not None:
            self._arrive(following)  # prefetch the next one

    def after(self, index: int, backward: bool | None = None) -> None:
        backward = in_backward() if backward is None else backward
        if index in self.slots and not backward:
            self._depart(index)

    def restore(self) -> None:
        """Put every moved tensor back on the device it came from, as the host application
        placed it (tensors swapping did not move were never touched), and free the host
        buffers."""
        if self.cuda:
            self.stream.synchronize()  # no copy may still read a host buffer
        for index, slots in self.slots.items():
            for slot in slots:
                if index not in self.resident or self.poison:
                    slot.tensor.data = slot.host.to(slot.home) if self.copies else slot.host
        self.resident = set(self.slots)
        self._arrivals.clear()
        self.slots = {}
