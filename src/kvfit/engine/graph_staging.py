"""The host side of a CUDA-graph decode step: the attention metadata the graphs read, sent in
one host->device copy per step.

``DecodeStaging`` owns one device int32 buffer whose views are the graphs' static metadata
tensors (layout, in int32 elements, ``mb`` = max batch, ``mp`` = max pages per request):

    [0, 2*mb)          slot_mapping  [mb] int64   (first: 8-byte aligned)
    [2*mb, 3*mb)       kv_lens       [mb] int32
    [3*mb, 3*mb+mb*mp) block_table   [mb, mp] int32

and ``NUM_MIRRORS`` pinned host buffers of the same layout, used in turn. ``stage`` writes one
step into the next mirror (slots and lengths for the padded batch; block-table rows only where a
request's page list changed since that mirror last held the row) and copies the mirror's prefix
to the device: the slots and lengths always (``3*mb`` ints), the table rows up to the last row
whose pages differ from what the device holds (none in most decode steps: a request gains a
page every ``page_size`` steps). A mirror is rewritten only after its previous copy has run
(a CUDA event per mirror; the host is never more than a step or two ahead, so it has).
"""

from __future__ import annotations

import numpy as np
import torch

NUM_MIRRORS = 3
PAD = "pad"  # row-cache marker of a padding row (page 0, nothing stored)


class DecodeStaging:
    """Owns the static metadata buffers of the decode graphs (device views below) and their
    pinned host mirrors. Mutates both in ``stage``; never reads the device."""

    def __init__(self, max_bs: int, max_pages: int, page_size: int, device):
        self.max_bs, self.max_pages, self.page_size = max_bs, max_pages, page_size
        self.device = torch.device(device)
        mb, mp = max_bs, max_pages
        self.numel = 3 * mb + mb * mp
        buf = torch.zeros(self.numel, dtype=torch.int32, device=self.device)
        buf[:2 * mb].view(torch.int64).fill_(-1)  # padded rows store nothing
        buf[2 * mb:3 * mb].fill_(1)
        self._dev = buf
        self.slot_mapping = buf[:2 * mb].view(torch.int64)  # [mb] int64
        self.kv_lens = buf[2 * mb:3 * mb]  # [mb] int32
        self.block_table = buf[3 * mb:].view(mb, mp)  # [mb, mp] int32
        pin = self.device.type == "cuda"
        self._host = [buf.cpu().pin_memory() if pin else buf.clone() for _ in range(NUM_MIRRORS)]
        self._np = [h.numpy() for h in self._host]
        self._rows = [[None] * mb for _ in range(NUM_MIRRORS)]  # what each mirror's rows hold
        self._dev_rows: list = [None] * mb  # what the device's rows hold
        self._events = [torch.cuda.Event() if pin else None for _ in range(NUM_MIRRORS)]
        self._used = [False] * NUM_MIRRORS
        self._next = 0

    def stage(self, kv_lens_cpu: list[int], page_tables: list[list[int]], gbs: int):
        """One decode step of ``bs = len(kv_lens_cpu)`` requests padded to ``gbs`` rows ->
        ``(width, n_pages, kv_all)``: the widest row's page count, each row's page count and kv
        length (lists of ``gbs``; padded rows: 1 and 1). kv_lens_cpu[i] counts request i's
        tokens with this step's; page_tables[i] lists its pages. Enqueues one non-blocking
        host->device copy. Plain Python per row (a handful of list operations): cheaper than
        numpy's per-call overhead at the small batches where the host time is exposed."""
        bs = len(kv_lens_cpu)
        mb, mp, ps = self.max_bs, self.max_pages, self.page_size
        kv_all = list(kv_lens_cpu) + [1] * (gbs - bs)
        n_pages = [(k + ps - 1) // ps for k in kv_all]
        width = max(n_pages[:bs])
        if width > mp:
            raise ValueError(f"a request needs {width} pages, graphs were sized for {mp}")
        j = self._next
        self._next = (j + 1) % NUM_MIRRORS
        if self._used[j] and self._events[j] is not None:
            self._events[j].synchronize()  # the mirror's previous copy has run
        host = self._np[j]
        table = host[3 * mb:].reshape(mb, mp)  # [mb, mp] view
        rows, dev_rows = self._rows[j], self._dev_rows
        slots = [-1] * gbs  # padded rows store nothing
        last_dirty = -1
        for i, pages in enumerate(page_tables):
            n = n_pages[i]
            row = pages[:n]
            if len(row) < n:
                raise ValueError(f"request {i} has {len(pages)} pages for {kv_all[i]} tokens")
            if rows[i] != row:  # list compare: far cheaper than converting rows
                table[i, :n] = row
                rows[i] = row
            if dev_rows[i] != row:
                dev_rows[i] = row
                last_dirty = i
            last = kv_all[i] - 1  # position of the row's new token
            slots[i] = row[last // ps] * ps + last % ps
        for i in range(bs, gbs):
            if rows[i] != PAD:
                table[i] = 0
                rows[i] = PAD
            if dev_rows[i] != PAD:
                dev_rows[i] = PAD
                last_dirty = i
        host[2 * mb:2 * mb + gbs] = kv_all
        host[:2 * mb].view(np.int64)[:gbs] = slots
        n = 3 * mb + (last_dirty + 1) * mp
        self._dev[:n].copy_(self._host[j][:n], non_blocking=True)
        if self._events[j] is not None:
            self._events[j].record()
        self._used[j] = True
        return width, n_pages, kv_all
