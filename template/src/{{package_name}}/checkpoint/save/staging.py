"""Staging a save: copying the state into host memory that the background writer reads.

DCP's ``DefaultStager`` deep-copies the state dict at every save: with a few hundred
tensors, several times the memory copy itself, on the training path (docs/PERFORMANCE.md).
``ReusingStager`` adds one fast path: when the state has the structure last staged (each
tensor's dtype, shape, strides and device; a DTensor's mesh, placements, global shape), it
copies each tensor into the buffer it used last time and rebuilds only the containers.
Anything else goes through DCP's deep copy. The buffers are reused: a save may only be
staged once the previous one is written. Torch releases: docs/EXTENDING.md.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NamedTuple

import torch
from torch.distributed.checkpoint._state_dict_stager import StateDictStager
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.tensor import DTensor

from ...runtime.torch_compat import stager_closes_after_each_stage

_ATOMIC = (type(None), bool, int, float, complex, str, bytes)
_CONTAINERS = (dict, OrderedDict, list, tuple)


class _Slot(NamedTuple):
    staged: torch.Tensor        # what the staged state dict holds (a DTensor or a tensor)
    buffer: torch.Tensor        # the host memory the source's local data is copied into
    signature: tuple            # what a source must match to be copied into ``buffer``
    source_ptr: int | None      # for a buffer shared by several slots: the source it had


class _Mismatch(Exception):
    """The state does not have the structure of the last one staged."""


def _local(x: torch.Tensor) -> torch.Tensor:
    # DTensor.to_local() goes through autograd (microseconds a tensor): staging needs less.
    return x._local_tensor if type(x) is DTensor else x


def _signature(x: torch.Tensor) -> tuple:
    if type(x) is DTensor:
        local, spec = x._local_tensor, x._spec   # the public properties cost more
        return (DTensor, local.dtype, local.device, local.shape, local.stride(),
                spec.shape, spec.placements, id(spec.mesh))
    return (torch.Tensor, x.dtype, x.device, x.shape, x.stride())


class _ReusingStateDictStager(StateDictStager):
    """DCP's state dict stager with a fast path for a state staged before (see module)."""

    def __init__(self, pin_memory: bool, share_memory: bool) -> None:
        super().__init__(pin_memory=pin_memory, share_memory=share_memory)
        self._slots: list[_Slot] | None = None
        self.fast_stages = 0   # saves staged by the fast path
        self.full_stages = 0   # saves staged by DCP's deep copy
        # Where DCP closes this stager after every stage (torch 2.11, 2.12.0), that close
        # is let pass until shutdown: a closed stager fails at its next stage.
        self.open_until_shutdown = stager_closes_after_each_stage()
        self.shutting_down = False

    def stage(self, state_dict: Any, non_blocking: bool = False) -> Any:
        if self._slots is not None:
            try:
                staged = self._restage(state_dict, non_blocking)
            except _Mismatch:
                self._slots = None
            else:
                self.fast_stages += 1
                return staged
        staged = super().stage(state_dict, non_blocking=non_blocking)
        self.full_stages += 1
        slots: list[_Slot] = []
        self._slots = _shared_marked(slots) if _collect(state_dict, staged, slots) else None
        return staged

    def close(self) -> None:
        if self.open_until_shutdown and not self.shutting_down:
            return   # DCP's close after a stage (see __init__); ReusingStager.close ends it
        self._slots = None
        super().close()

    # ----------------------------------------------------------------- fast path --
    def _restage(self, state_dict: Any, non_blocking: bool) -> Any:
        slots = self._slots
        copies: list[tuple[torch.Tensor, torch.Tensor]] = []

        def rebuild(x: Any) -> Any:
            kind = type(x)
            if kind in _ATOMIC:
                return x
            if kind is torch.Tensor or kind is DTensor:
                if len(copies) == len(slots):
                    raise _Mismatch
                slot = slots[len(copies)]
                local = _local(x)
                if slot.signature != _signature(x) or (
                        slot.source_ptr is not None and slot.source_ptr != local.data_ptr()):
                    raise _Mismatch
                copies.append((slot.buffer, local))
                return slot.staged
            if kind is dict or kind is OrderedDict:
                return kind((key, rebuild(value)) for key, value in x.items())
            if kind is list:
                return [rebuild(value) for value in x]
            if kind is tuple:
                return tuple(rebuild(value) for value in x)
            raise _Mismatch

        staged = rebuild(state_dict)
        if len(copies) != len(slots):
            raise _Mismatch
        with torch.no_grad():
            for buffer, source in copies:
                buffer.copy_(source, non_blocking=non_blocking)
        return staged


def _collect(source: Any, staged: Any, slots: list[_Slot]) -> bool:
    """Pair source tensors with their staged copies in order; False if not rebuildable."""
    kind = type(source)
    if kind in _ATOMIC:
        return True
    if kind is torch.Tensor or kind is DTensor:
        if type(staged) is not kind:
            return False
        slots.append(_Slot(staged, _local(staged), _signature(source), _local(source).data_ptr()))
        return True
    if kind not in _CONTAINERS or type(staged) is not kind or len(source) != len(staged):
        return False
    if kind is list or kind is tuple:
        return all(_collect(s, t, slots) for s, t in zip(source, staged))
    return source.keys() == staged.keys() and all(
        _collect(value, staged[key], slots) for key, value in source.items())


def _shared_marked(slots: list[_Slot]) -> list[_Slot]:
    """Keep the source pointer only where slots share a buffer's storage (tied weights):
    those accept only the source they had; others any source of their signature."""
    owners = Counter(slot.buffer.untyped_storage().data_ptr()
                     for slot in slots if slot.buffer.numel())
    return [slot._replace(source_ptr=slot.source_ptr if slot.buffer.numel() and owners[
        slot.buffer.untyped_storage().data_ptr()] > 1 else None) for slot in slots]


class ReusingStager(DefaultStager):
    """DCP's DefaultStager whose saves after the first copy into the same buffers. On CUDA
    its thread sets this rank's device first (else leaving the staging stream's context
    opens one on device 0 for every local rank), and its stream waits for the compute
    stream (the copy never reads parameters an unfinished kernel still writes)."""

    def __init__(self, options: StagingOptions, device: torch.device | None = None) -> None:
        super().__init__(options)
        self.device = device
        if hasattr(self, "_state_dict_stager"):  # DefaultStager's own, replaced
            self._state_dict_stager = _ReusingStateDictStager(
                pin_memory=options.use_pinned_memory, share_memory=options.use_shared_memory)
        if self._staging_executor is not None and device is not None and device.type == "cuda":
            self._staging_executor.shutdown(wait=False)
            self._staging_executor = ThreadPoolExecutor(
                max_workers=1, thread_name_prefix="staging",
                initializer=torch.cuda.set_device, initargs=(device,))

    def close(self) -> None:
        """Close at shutdown, the state-dict stager too (DCP's leaves it open before 2.11)."""
        super().close()
        if isinstance(inner := getattr(self, "_state_dict_stager", None), _ReusingStateDictStager):
            inner.shutting_down = True
            inner.close()

    def stage(self, state_dict: Any, **kwargs: Any) -> Any:
        stream = getattr(self, "_staging_stream", None)
        if stream is not None and self.device is not None and self.device.type == "cuda":
            stream.wait_stream(torch.cuda.current_stream(self.device))
        return super().stage(state_dict, **kwargs)

    @property
    def fast_stages(self) -> int:
        """Saves staged by the fast path (the tests and ``bench`` count them)."""
        return getattr(getattr(self, "_state_dict_stager", None), "fast_stages", 0)

    @property
    def full_stages(self) -> int:
        """Saves staged by DCP's deep copy (the first, and any change of structure)."""
        return getattr(getattr(self, "_state_dict_stager", None), "full_stages", 0)
