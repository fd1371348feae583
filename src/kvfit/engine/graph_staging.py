"""The host side of a CUDA-graph decode step: the attention metadata the graphs read, sent in
one host->device copy per step.

``DecodeStaging`` owns one device int32 buffer whose views are the graphs' static metadata
tensors (layout, in int32 elements, ``mb`` = max batch, ``mp`` = max pages per request, ``T`` =
number of page tables: 1, or 2 for a pool whose sliding layers have a page space of their own,
table 1 being the sliding one):

    [2*j*mb, 2*(j+1)*mb)          slot_mapping of table j  [mb] int64   (first: 8-byte aligned)
    [2*T*mb, (2*T+1)*mb)          kv_lens                  [mb] int32
    [H + j*mb*mp, H+(j+1)*mb*mp)  block_table of table j   [mb, mp] int32   (H = (2*T+1)*mb)

and ``NUM_MIRRORS`` pinned host buffers of the same layout, used in turn. ``stage`` writes one
step into the next mirror (slots and lengths for the padded batch; block-table rows only where a
request's page list changed since that mirror last held the row) and copies the mirror's prefix
to the device: the slots and lengths always (``H`` ints), the table rows up to the last row
whose pages differ from what the device holds (none in most decode steps: a request gains a
page every ``page_size`` steps; a sliding table's row also changes when a page is freed). A
mirror is rewritten only after its previous copy has run (a CUDA event per mirror; the host is
never more than a step or two ahead, so it has).
"""

from __future__ import annotations

import numpy as np
import torch

NUM_MIRRORS = 3
PAD = "pad"  # row-cache marker of a padding row (page 0, nothing stored)


class DecodeStaging:
    """Owns the static metadata buffers of the decode graphs (device views below) and their
    pinned host mirrors. Mutates both in ``stage``; never reads the device."""

    def __init__(self, max_bs: int, max_pages: int, page_size: int, device,
                 num_tables: int = 1):
        if num_tables not in (1, 2):
            raise ValueError(f"num_tables must be 1 or 2, got {num_tables}")
        self.max_bs, self.max_pages, self.page_size = max_bs, max_pages, page_size
        self.num_tables = num_tables
        self.device = torch.device(device)
        mb, mp, nt = max_bs, max_pages, num_tables
        self.header = (2 * nt + 1) * mb
        self.numel = self.header + nt * mb * mp
        buf = torch.zeros(self.numel, dtype=torch.int32, device=self.device)
        buf[:2 * nt * mb].view(torch.int64).fill_(-1)  # padded rows store nothing
        buf[2 * nt * mb:self.header].fill_(1)
        self._dev = buf
        self.slot_mappings = [buf[2 * j * mb:2 * (j + 1) * mb].view(torch.int64)
                              for j in range(nt)]  # [mb] int64 each
        self.kv_lens = buf[2 * nt * mb:self.header]  # [mb] int32
        self.block_tables = [buf[self.header + j * mb * mp:self.header + (j + 1) * mb * mp]
                             .view(mb, mp) for j in range(nt)]  # [mb, mp] int32 each
        self.slot_mapping = self.slot_mappings[0]
        self.block_table = self.block_tables[0]
        pin = self.device.type == "cuda"
        self._host = [buf.cpu().pin_memory() if pin else buf.clone() for _ in range(NUM_MIRRORS)]
        self._np = [h.numpy() for h in self._host]
        # what each mirror's rows hold, per table; what the device's rows hold, per table
        self._rows = [[[None] * mb for _ in range(nt)] for _ in range(NUM_MIRRORS)]
        self._dev_rows: list = [[None] * mb for _ in range(nt)]
        self._events = [torch.cuda.Event() if pin else None for _ in range(NUM_MIRRORS)]
        self._used = [False] * NUM_MIRRORS
        self._next = 0

    def stage(self, kv_lens_cpu: list[int], page_tables: list[list[int]], gbs: int,
              swa_tables: list[list[int]] | None = None):
        """One decode step of ``bs = len(kv_lens_cpu)`` requests padded to ``gbs`` rows ->
        ``(width, n_pages, kv_all)``: the widest row's page count, each row's page count and kv
        length (lists of ``gbs``; padded rows: 1 and 1). kv_lens_cpu[i] counts request i's
        tokens with this step's; page_tables[i] lists its pages; ``swa_tables[i]`` (required
        with two tables, refused with one) its pages in the second page space, indexed by
        logical page like ``page_tables[i]`` (freed entries already replaced by a readable
        page). Enqueues one non-blocking host->device copy. Plain Python per row (a handful of
        list operations): cheaper than numpy's per-call overhead at the small batches where the
        host time is exposed."""
        bs = len(kv_lens_cpu)
        mb, mp, ps, nt = self.max_bs, self.max_pages, self.page_size, self.num_tables
        if (swa_tables is not None) != (nt == 2):
            raise ValueError("swa_tables goes with a staging of two page tables"
                             if nt == 1 else "this staging has a second page table (the "
                             "sliding layers' pages): pass swa_tables")
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
        slots64 = host[:2 * nt * mb].view(np.int64)
        n = self.header  # int32 elements to copy
        lists = [page_tables] if nt == 1 else [page_tables, swa_tables]
        for t, tables in enumerate(lists):
            table = host[self.header + t * mb * mp:self.header + (t + 1) * mb * mp] \
                .reshape(mb, mp)  # [mb, mp] view
            rows, dev_rows = self._rows[j][t], self._dev_rows[t]
            slots = [-1] * gbs  # padded rows store nothing
            last_dirty = -1
            for i, pages in enumerate(tables):
                k = n_pages[i]
                row = pages[:k]
                if len(row) < k:
                    raise ValueError(f"request {i} has {len(pages)} pages for {kv_all[i]} "
                                     f"tokens" + (" (sliding table)" if t else ""))
                if rows[i] != row:  # list compare: far cheaper than converting rows
                    table[i, :k] = row
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
            slots64[t * mb:t * mb + gbs] = slots
            if last_dirty >= 0:
                n = self.header + t * mb * mp + (last_dirty + 1) * mp
        host[2 * nt * mb:2 * nt * mb + gbs] = kv_all
        self._dev[:n].copy_(self._host[j][:n], non_blocking=True)
        if self._events[j] is not None:
            self._events[j].record()
        self._used[j] = True
        return width, n_pages, kv_all
