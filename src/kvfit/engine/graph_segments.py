"""One forward captured as a chain of CUDA graphs, cut at decoder-layer boundaries.

``cudaGraphLaunch`` submits a graph's nodes before the GPU runs the first one: measured on the
H200 (Qwen3-1.7B shape, the 128-token extend graph of ~340 kernel nodes), the launch took 779 us
of host time and the first kernel began when it returned, so a lone short step waits for the
whole launch. A chain of graphs whose first link is one layer starts the GPU after that link's
launch; each later link is launched while the GPU runs the links before it, so links may grow
by about the ratio of a layer's GPU time to its launch time (``GROWTH``).

Replaying the links in capture order is exactly the single graph's work: the same kernels in
the same order on one stream, their memory from one private pool that the links share (safe
because they always replay in that order and never concurrently).
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

GROWTH = 2  # each link holds up to this many times the layers of the one before it (H200: 2
# measured 3.65 ms for the cached-4k probe against 3.75 with 3, 4.14 with 1 and 4.25 unlinked)


def segment_starts(num_layers: int, growth: int | None = None) -> list[int]:
    """The layer indices at which a new link begins (0 excluded): links of 1, growth,
    growth**2, ... layers (``growth`` defaults to ``GROWTH``, read at the call); [] when
    ``growth < 1`` (one graph) or there is one layer."""
    growth = GROWTH if growth is None else growth
    if growth < 1 or num_layers < 2:
        return []
    starts, start, size = [], 1, growth
    while start < num_layers:
        starts.append(start)
        start += size
        size *= growth
    return starts


class SegmentedGraph:
    """Owns the links of one captured forward; ``replay`` launches them in order."""

    def __init__(self, graphs: list[torch.cuda.CUDAGraph]):
        self.graphs = graphs

    def __len__(self) -> int:
        return len(self.graphs)

    def replay(self) -> None:
        for g in self.graphs:
            g.replay()


def capture_segmented(forward: Callable[[], torch.Tensor], layers: Sequence[torch.nn.Module],
                      starts: Sequence[int], pool, stream: torch.cuda.Stream
                      ) -> tuple[SegmentedGraph, torch.Tensor]:
    """Capture ``forward()`` on ``stream`` into ``len(starts) + 1`` graphs sharing ``pool``, a
    new one beginning just before ``layers[i]`` runs for each i in ``starts``. Returns the
    chain and forward's output (a tensor of the pool, rewritten by every replay)."""
    graphs = [torch.cuda.CUDAGraph()]

    def cut(_module, _args):
        graphs[-1].capture_end()
        g = torch.cuda.CUDAGraph()
        graphs.append(g)
        g.capture_begin(pool=pool)

    hooks = [layers[i].register_forward_pre_hook(cut) for i in starts]
    try:
        torch.cuda.synchronize()
        with torch.cuda.stream(stream):
            graphs[0].capture_begin(pool=pool)
            try:
                out = forward()
            finally:
                graphs[-1].capture_end()
    finally:
        for h in hooks:
            h.remove()
    return SegmentedGraph(graphs), out
