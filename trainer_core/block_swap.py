"""Block swapping: the frozen weights of N transformer blocks live on an offload device (CPU)
and visit the compute device only while their block runs.

Which blocks: single blocks first (a Flux single block is about 0.42 of a double block, so
swapping them costs less transfer per byte saved), taken from the end of the single stack,
then double blocks from the end of theirs (`choose_swapped`).

When: the block forwards call `before(i)` and `after(i)`. `before` makes block i resident
(waiting for its prefetch if one is in flight) and starts prefetching the next swapped block
in the current direction: increasing indices in the forward pass, decreasing in backward
(gradient checkpointing recomputes blocks during backward, last block first). In the
forward pass `after` sends the block back at once. In backward the recomputed block's own
backward still needs its weights after `after`, so it leaves when the next (lower) block
starts, by which time autograd has finished with it. At most two swapped blocks are
resident at any moment: the one computing and the one arriving. This needs gradient
checkpointing: without it autograd would keep the weights of every block for backward.

How: only tensors that do not require grad move (the base weights); the LoRA parameters stay
on the compute device, so the optimizer never sees a device change. On CUDA, the host copies
are pinned, copies run on a side stream, and events order them against the compute stream
(the block waits for its arrival; a departure waits for the block's kernels). On CPU both
devices are the CPU: the same scheduler runs and every transfer is recorded; nothing is
copied, except with `poison=True` (tests), where a departed block's weights are replaced by
NaN until it returns, so any use of a block that is not resident shows up in the results.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

TransferHook = Callable[[str, int], None]  # ("in" | "out", block index)


def choose_swapped(double_count: int, single_count: int, blocks_to_swap: int) -> list[int]:
    """Indices into the execution order [double_0 .. double_{D-1}, single_0 .. single_{S-1}]."""
    if blocks_to_swap < 0:
        raise ValueError("blocks_to_swap cannot be negative")
    limit = double_count + single_count
    if blocks_to_swap > limit:
        raise ValueError(f"blocks_to_swap is {blocks_to_swap} but the model has only {limit} blocks")
    singles = min(blocks_to_swap, single_count)
    doubles = blocks_to_swap - singles
    chosen = [double_count + single_count - 1 - i for i in range(singles)]
    chosen += [double_count - 1 - i for i in range(doubles)]
    return sorted(chosen)


def in_backward() -> bool:
    """True while autograd runs a backward pass (checkpoint recomputation happens there)."""
    return torch._C._current_graph_task_id() != -1


class BlockSwapper:
    def __init__(
        self,
        blocks: Sequence[torch.nn.Module],
        swapped: Sequence[int],
        compute_device: torch.device,
        offload_device: torch.device,
        on_transfer: TransferHook | None = None,
        poison: bool = False,
    ):
        self.blocks = list(blocks)
        self.swapped = sorted(set(swapped))
        self.compute = torch.device(compute_device)
        self.offload = torch.device(offload_device)
        self.on_transfer = on_transfer
        self.poison = poison
        self._stash: dict[int, list[torch.Tensor]] = {}  # poison mode: the real values
        self.cuda = self.compute.type == "cuda"
        self.stream = torch.cuda.Stream(device=self.compute) if self.cuda else None
        self.resident: set[int] = set()  # swapped blocks currently on the compute device
        self._arrivals: dict[int, object] = {}  # block -> CUDA event of its in-flight copy
        self._frozen = {i: self._frozen_tensors(self.blocks[i]) for i in self.swapped}

    @staticmethod
    def _frozen_tensors(block: torch.nn.Module) -> list[torch.Tensor]:
        tensors = [p for p in block.parameters() if not p.requires_grad]
        return tensors + list(block.buffers())

    # -- moving one block ------------------------------------------------------------------
    def _move(self, index: int, device: torch.device, direction: str) -> None:
        if self.on_transfer is not None:
            self.on_transfer(direction, index)
        tensors = self._frozen[index]
        if self.poison:
            if direction == "out":
                self._stash[index] = [t.data for t in tensors]
                for tensor in tensors:
                    tensor.data = torch.full_like(tensor.data, float("nan"))
            else:
                for tensor, value in zip(tensors, self._stash.pop(index), strict=True):
                    tensor.data = value
            return
        if not tensors or tensors[0].device == device:
            return  # CPU-only runs: the scheduler's bookkeeping without copies
        if not self.cuda:
            for tensor in tensors:
                tensor.data = tensor.data.to(device)
            return
        compute_stream = torch.cuda.current_stream(self.compute)
        if direction == "out":
            self.stream.wait_stream(compute_stream)  # the block's kernels are done with it
        with torch.cuda.stream(self.stream):
            for tensor in tensors:
                pinned = direction == "out"
                moved = torch.empty_like(tensor.data, device=device, pin_memory=pinned)
                moved.copy_(tensor.data, non_blocking=True)
                tensor.data.record_stream(self.stream)
                tensor.data = moved
            event = torch.cuda.Event()
            event.record(self.stream)
        if direction == "in":
            self._arrivals[index] = event

    def _arrive(self, index: int) -> None:
        if index in self.resident:
            return
        self._move(index, self.compute, "in")
        self.resident.add(index)

    def _depart(self, index: int) -> None:
        if index not in self.resident:
            return
        self._arrivals.pop(index, None)
        self._move(index, self.offload, "out")
        self.resident.discard(index)

    # -- the schedule ------------------------------------------------------------------------
    def prepare(self) -> None:
        """Send every swapped block to the offload device (once, before training)."""
        for index in self.swapped:
            self.resident.add(index)
            self._depart(index)

    def before(self, index: int, backward: bool | None = None) -> None:
        backward = in_backward() if backward is None else backward
        if backward:  # blocks above this one have finished their backward
            for done in [i for i in self.resident if i > index]:
                self._depart(done)
        if index in self._frozen:
            self._arrive(index)
            event = self._arrivals.pop(index, None)
            if event is not None:
                torch.cuda.current_stream(self.compute).wait_event(event)
        upcoming = [i for i in self.swapped if (i < index if backward else i > index)]
        if upcoming:
            self._arrive(max(upcoming) if backward else min(upcoming))  # prefetch the next one

    def after(self, index: int, backward: bool | None = None) -> None:
        backward = in_backward() if backward is None else backward
        if index in self._frozen and not backward:
            self._depart(index)

    def restore(self) -> None:
        """Bring every swapped block back to the compute device (the model as it was loaded)."""
        for index in self.swapped:
            self._arrive(index)
        if self.cuda:
            torch.cuda.current_stream(self.compute).wait_stream(self.stream)
        self._arrivals.clear()
