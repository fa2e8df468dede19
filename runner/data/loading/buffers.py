"""Reusable batch buffers: gather into memory that is already mapped (and pinned, on CUDA).

A fresh 38 MB batch buffer (256 images of 224x224) costs more than filling it: glibc maps
every allocation over 32 MB anew, so each batch pays page faults and kernel zeroing
(measured here: 6,000 images/s for clone() against 105,000 for a copy into an existing
buffer). The pool hands out views of a few long-lived buffers and reuses a buffer only when
nothing refers to its storage any more, so a batch someone still holds is never
overwritten; when every buffer is busy it allocates a fresh one.

Pinned buffers (for CUDA) come from PyTorch's caching host allocator instead: it already
reuses freed pinned blocks, and it also knows when an asynchronous copy out of a block is
still running, which a pool of our own could not see.
"""

from __future__ import annotations

import torch

try:  # counts the references to a storage: the buffer's own, plus every view handed out
    _storage_use_count = torch._C._storage_Use_Count
except AttributeError:  # pragma: no cover - private API; without it, never reuse
    _storage_use_count = None


class BufferPool:
    """Up to ``capacity`` reusable buffers of one shape and dtype.

    Args:
        shape: the full-batch shape; ``take(n)`` returns the first ``n`` rows.
        dtype: element type.
        pin: page-locked memory for asynchronous copies to CUDA, from PyTorch's caching
            host allocator (reused once no copy out of it is pending).
        capacity: buffers kept; beyond it, batches get fresh, unpooled memory. With a
            prefetch queue, up to five are in flight (seen here): the queue's two, the one
            in use, the previous one until the loop lets go of it, and the one being filled.
        channels_last: images (``shape`` N x C x H x W) laid out as N x H x W x C in memory
            and handed out as that memory's N x C x H x W view (torch's channels_last), for
            a storage that decodes HWC rows straight into its slots
            (``Storage.channels_last``).
    """

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, pin: bool = False,
                 capacity: int = 8, channels_last: bool = False):
        self.shape, self.dtype, self.pin, self.capacity = tuple(shape), dtype, pin, capacity
        self.channels_last = channels_last and len(self.shape) == 4
        self._buffers: list[torch.Tensor] = []
        self._idle_count: list[int] = []
        self.allocated = 0  # buffers made (pooled or not): a test can check reuse with it

    def _new(self) -> torch.Tensor:
        self.allocated += 1
        if self.channels_last:
            n, c, h, w = self.shape
            return torch.empty((n, h, w, c), dtype=self.dtype,
                               pin_memory=self.pin).permute(0, 3, 1, 2)
        return torch.empty(self.shape, dtype=self.dtype, pin_memory=self.pin)

    def _is_idle(self, k: int) -> bool:
        storage = self._buffers[k].untyped_storage()
        return _storage_use_count(storage._cdata) == self._idle_count[k]

    def take(self, n: int | None = None) -> torch.Tensor:
        """A buffer of ``n`` rows (default: all) that nobody else is using."""
        n = self.shape[0] if n is None else n
        if _storage_use_count is not None and not self.pin:
            for k in range(len(self._buffers)):
                if self._is_idle(k):
                    return self._buffers[k][:n]
            if len(self._buffers) < self.capacity:
                buf = self._new()
                self._buffers.append(buf)
                self._idle_count.append(_storage_use_count(buf.untyped_storage()._cdata))
                return buf[:n]
        return self._new()[:n]


def pin_small_fields(batch: dict[str, torch.Tensor], pinned: str = "image"
                     ) -> dict[str, torch.Tensor]:
    """The batch's other tensors (labels, indices, valid) in page-locked memory too, so
    their copies to CUDA are asynchronous like the image's (a pageable source makes
    ``non_blocking=True`` copy synchronously). ``pinned`` is already in a pinned buffer."""
    return {k: v if k == pinned or v.is_pinned() else v.pin_memory() for k, v in batch.items()}
