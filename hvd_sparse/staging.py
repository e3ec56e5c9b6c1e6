"""Gradients on an accelerator, reduced on the host: only their non-zero blocks cross the bus.

The reduction itself (Horovod's CPU operations, the aggregators, the switch) runs on host memory,
so a device tensor is staged: packed on its device (``device.pack_begin``/``pack_end``), its
packed blocks copied once to pinned host memory and scattered into fresh host zeros, which any
scheme then reduces; the result goes back the same way (packed on the host, one copy, scattered
into zeros on the device, on the caller's stream). A dense tensor crosses the bus whole, a 1%
sparse one at about 1% of its bytes.

Going to the host is asynchronous (``ToHost``, a stage the engine polls): on a side stream that
waits for the gradient's stream, then by CUDA events polled from the host, never a device or
stream synchronization. The optimizer's hook that submits a gradient returns at once, and the
copies overlap the rest of the backward pass.

``HVD_SPARSE_CPU_AS_DEVICE=1`` stages CPU tensors too: how the tests run this path without a GPU.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from . import blocks, device

_side_streams: dict[torch.device, torch.cuda.Stream] = {}


def staged(t: torch.Tensor) -> bool:
    """Whether ``t`` (dense, of a dtype the codec handles) is reduced through host memory."""
    return t.dtype in blocks.DTYPE_CODES and device.on_device(t)


@contextlib.contextmanager
def _on(stream: torch.cuda.Stream | None, after_current: bool = False) -> Iterator[None]:
    if stream is None:
        yield
        return
    if after_current:  # the gradient was produced on the current stream
        stream.wait_stream(torch.cuda.current_stream(stream.device))
    with torch.cuda.stream(stream):
        yield


def _pinned(x: torch.Tensor) -> torch.Tensor:
    """A pinned host copy of ``x``, started on the current stream (``x`` itself on the CPU)."""
    if not x.is_cuda:
        return x
    host = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
    return host.copy_(x, non_blocking=True)


def _record(stream: torch.cuda.Stream | None) -> torch.cuda.Event | None:
    if stream is None:
        return None
    event = torch.cuda.Event()
    event.record(stream)
    return event


def _reached(event: torch.cuda.Event | None) -> bool:
    return event is None or event.query()


class ToHost:
    """A flat host tensor equal to ``t``, built from its non-zero blocks; a ``Waitable`` for the
    engine. Three steps, each started when the previous one's event is reached: the block mask,
    its prefix sum and a copy of the count; the pack of that many blocks and their copy; the
    scatter into host zeros (``value``)."""

    def __init__(self, t: torch.Tensor, block_size: int) -> None:
        self.t, self.block_size = t, block_size
        self.stream = None
        if t.is_cuda:
            self.stream = _side_streams.get(t.device)
            if self.stream is None:
                self.stream = _side_streams[t.device] = torch.cuda.Stream(t.device)
            t.record_stream(self.stream)  # its memory is not reused before the side stream is done
        with _on(self.stream, after_current=True):
            self._state, count = device.pack_begin(t, block_size)
            self._count = _pinned(count)
            self.event = _record(self.stream)
        self._packed: tuple[torch.Tensor, torch.Tensor] | None = None

    def poll(self) -> bool:
        if not _reached(self.event):
            return False
        if self._packed is None:  # the count is here: pack that many blocks, copy them
            with _on(self.stream):
                idx, vals = device.pack_end(self.t, self.block_size, self._state,
                                            int(self._count))
                self._packed = _pinned(idx), _pinned(vals)
                self.event = _record(self.stream)
            self._state = None
            return _reached(self.event)
        return True

    def value(self) -> torch.Tensor:
        assert self._packed is not None
        host = blocks.zeros(self.t.numel(), self.t.dtype)
        blocks.unpack(host, *self._packed, self.block_size)
        return host

    def mask(self) -> torch.Tensor:
        """The host tensor's block mask (``blocks.block_mask``, uint8), from the packed indices:
        the schemes need not scan the tensor for it. Its all-zero blocks are +0 already."""
        assert self._packed is not None
        mask = torch.zeros(blocks.num_blocks(self.t.numel(), self.block_size), dtype=torch.uint8)
        mask[self._packed[0].long()] = 1
        return mask

    def wait(self) -> torch.Tensor:
        """``value()`` once every step is done, waiting on this stream's events only."""
        while not self.poll():
            self.event.synchronize()
        return self.value()


def to_host(t: torch.Tensor, block_size: int) -> torch.Tensor:
    """A flat host tensor equal to ``t`` (contiguous), built from its non-zero blocks."""
    return ToHost(t, block_size).wait()


def to_device(host: torch.Tensor, out: torch.Tensor, block_size: int) -> torch.Tensor:
    """Writes the flat host tensor ``host`` into ``out`` (contiguous, on its device), sending
    only its non-zero blocks, on the current stream; returns ``out``."""
    idx, vals = blocks.pack(host, block_size)
    if out.is_cuda:
        idx, vals = idx.pin_memory(), vals.pin_memory()
    out.zero_()
    device.unpack(out.view(-1), idx.to(out.device, non_blocking=True),
                  vals.to(out.device, non_blocking=True), block_size)
    return out
