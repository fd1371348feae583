"""The host side of a CUDA-graph prefill/extend step: the attention metadata the prefill graphs
read, sent in one host->device copy per step.

``PrefillStaging`` owns one device int32 buffer whose views are the graphs' static metadata
(``T`` = the largest token bucket, ``S`` = requests per graph, ``NB``/``NC`` = the most prefill
programs / V store chunks of a step of ``T`` tokens in ``S`` requests, ``mp`` = pages per
request), in int32 elements:

    [0, 2T)                     slot_mapping    [T] int64 (8-byte aligned), -1 = store nothing
    [2T, 2T+S+1)                cu_seqlens_q    [S+1]
    [.., +S)                    kv_lens         [S]
    [.., +2NB)                  blocks          [NB, 2] (request, first row), request -1 = spare
    [.., +2NC)                  store chunks    [NC, 2] (request, first position), -1 = spare
    [H, H + S*mp)               block_table     [S, mp]

and ``NUM_MIRRORS`` pinned host buffers of the same layout, used in turn. ``stage`` writes one
step, padded to a bucket of ``bucket`` tokens: the real requests first, padded requests with no
tokens (cu_seqlens at the real total, kv_len 0), padded tokens with slot -1, spare blocks and
chunks with request -1; then copies the prefix up to the last real block-table row. A mirror is
rewritten only after its previous copy has run (a CUDA event per mirror).
"""

from __future__ import annotations

import numpy as np
import torch

from kvfit.attention.meta_builder import page_table_array, token_positions, token_request_index
from kvfit.kernels.prefill import max_prefill_blocks, prefill_block_list
from kvfit.kernels.store import max_store_chunks, store_chunk_list

NUM_MIRRORS = 3


class PrefillStaging:
    """Owns the prefill graphs' static metadata buffers (device views below) and their pinned
    host mirrors. Mutates both in ``stage``; never reads the device."""

    def __init__(self, max_tokens: int, max_reqs: int, max_pages: int, page_size: int,
                 group: int, block_m: int, device):
        self.max_tokens, self.max_reqs, self.max_pages = max_tokens, max_reqs, max_pages
        self.page_size, self.group, self.block_m = page_size, group, block_m
        self.device = torch.device(device)
        t, s, mp = max_tokens, max_reqs, max_pages
        nb = max_prefill_blocks(t, s, group, block_m)
        nc = max_store_chunks(t, s, page_size)
        o_cu = 2 * t
        o_kv = o_cu + s + 1
        o_blk = o_kv + s
        o_chk = o_blk + 2 * nb
        self.header = o_chk + 2 * nc
        self._offsets = (o_cu, o_kv, o_blk, o_chk)
        buf = torch.zeros(self.header + s * mp, dtype=torch.int32, device=self.device)
        buf[:2 * t].view(torch.int64).fill_(-1)
        buf[o_blk:self.header].fill_(-1)  # every block and chunk spare
        self._dev = buf
        self.slot_mapping = buf[:2 * t].view(torch.int64)  # [T] int64
        self.cu_seqlens = buf[o_cu:o_kv]  # [S+1]
        self.kv_lens = buf[o_kv:o_blk]  # [S]
        self.blocks = buf[o_blk:o_chk].view(nb, 2)  # [NB, 2]
        self.chunks = buf[o_chk:self.header].view(nc, 2)  # [NC, 2]
        self.block_table = buf[self.header:].view(s, mp)  # [S, mp]
        pin = self.device.type == "cuda"
        self._host = [buf.cpu().pin_memory() if pin else buf.clone() for _ in range(NUM_MIRRORS)]
        self._np = [h.numpy() for h in self._host]
        self._events = [torch.cuda.Event() if pin else None for _ in range(NUM_MIRRORS)]
        self._used = [False] * NUM_MIRRORS
        self._next = 0

    def grid(self, bucket: int) -> tuple[int, int]:
        """(blocks, chunks) entries a step padded to ``bucket`` tokens launches."""
        return (max_prefill_blocks(bucket, self.max_reqs, self.group, self.block_m),
                max_store_chunks(bucket, self.max_reqs, self.page_size))

    def stage(self, q_lens: list[int], kv_lens: list[int], page_tables: list[list[int]],
              bucket: int, with_chunks: bool) -> list[int]:
        """Stage one step of ``b = len(q_lens)`` requests (``sum(q_lens) <= bucket``, ``b <=
        max_reqs``) padded to ``bucket`` tokens -> each request's page count (padded requests:
        0). ``with_chunks``: list the V store chunks (token-minor V pages). Enqueues one
        non-blocking host->device copy."""
        b = len(q_lens)
        t_real = sum(q_lens)
        if b > self.max_reqs or t_real > bucket or bucket > self.max_tokens:
            raise ValueError(f"a step of {b} requests / {t_real} tokens does not fit a prefill "
                             f"graph of {self.max_reqs} requests / {bucket} tokens")
        ps, s, mp = self.page_size, self.max_reqs, self.max_pages
        q = np.asarray(q_lens, dtype=np.int64)
        kv = np.asarray(kv_lens, dtype=np.int64)
        n_pages = -(-kv // ps)
        width = int(n_pages.max(initial=1))
        if width > mp:
            raise ValueError(f"a request needs {width} pages, prefill graphs were sized for {mp}")
        j = self._next
        self._next = (j + 1) % NUM_MIRRORS
        if self._used[j] and self._events[j] is not None:
            self._events[j].synchronize()  # the mirror's previous copy has run
        host = self._np[j]
        o_cu, o_kv, o_blk, o_chk = self._offsets
        table = page_table_array(page_tables, n_pages, width)  # [b, width]
        host[self.header:self.header + b * mp].reshape(b, mp)[:, :width] = table
        slots = host[:2 * self.max_tokens].view(np.int64)
        req = token_request_index(q)  # [t_real]
        pos = token_positions(q, kv)  # [t_real]
        slots[:t_real] = table[req, pos // ps].astype(np.int64) * ps + pos % ps
        slots[t_real:bucket] = -1
        host[o_cu] = 0
        host[o_cu + 1:o_cu + b + 1] = np.cumsum(q)
        host[o_cu + b + 1:o_cu + s + 1] = t_real
        host[o_kv:o_kv + b] = kv
        host[o_kv + b:o_kv + s] = 0
        nb, nc = self.grid(bucket)
        flat = prefill_block_list(q_lens, self.group, self.block_m, kv_lens)
        host[o_blk:o_blk + len(flat)] = flat
        host[o_blk + len(flat):o_blk + 2 * nb] = -1
        if with_chunks:
            flat = store_chunk_list(q_lens, kv_lens, ps)
            host[o_chk:o_chk + len(flat)] = flat
            host[o_chk + len(flat):o_chk + 2 * nc] = -1
        n = self.header + b * mp
        self._dev[:n].copy_(self._host[j][:n], non_blocking=True)
        if self._events[j] is not None:
            self._events[j].record()
        self._used[j] = True
        return n_pages.tolist() + [0] * (s - b)
