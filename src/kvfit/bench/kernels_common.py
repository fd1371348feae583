"""What ``kvfit bench kernels`` and the kernel benchmarks under benchmarks/kernels share: the
head layouts they time, one rank's heads under tensor parallelism, the copy bandwidth the TB/s
figures are measured against, and ``KVSet``, R copies of one paged KV problem (random pages
scattered over the pool, rotated among so timed inputs never sit in L2) with the page size and V
layout the triton backend would use. Owns nothing global; a KVSet owns its device tensors."""

from __future__ import annotations

import math

LAYOUTS = {"qwen3-1.7b": (16, 8, 128), "llama-3.1-8b": (32, 8, 128), "smollm2": (9, 3, 64),
           "gemma3-270m": (4, 1, 256), "gemma3-4b": (8, 4, 256), "gemma3-12b": (16, 8, 256)}
DEFAULT_LAYOUTS = ("qwen3-1.7b", "llama-3.1-8b", "smollm2", "deepseek-v2-lite")
# sliding-window layers of a layout: each point also times our kernels with the window (the
# same cache, read only over the last ``window`` tokens) against the full layer at that context
WINDOWS = {"gemma3-270m": 512, "gemma3-4b": 1024, "gemma3-12b": 1024}
L2_BYTES = 60 << 20


def rank_heads(layout: str, tp_size: int) -> tuple[int, int, int]:
    """(query heads, KV heads, head dim) one of ``tp_size`` ranks runs for ``layout``."""
    from kvfit.parallel.layout import local_kv_heads

    hq, hkv, d = LAYOUTS[layout]
    return hq // tp_size, local_kv_heads(hkv, tp_size), d


def _torch_dtype(name):
    import torch

    return {"bfloat16": torch.bfloat16, "float16": torch.float16,
            "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2,
            "int8": torch.int8}[name]


def copy_bandwidth(device) -> float:
    """Bytes/s of a 2 GiB device-to-device copy, counting bytes read plus written."""
    import torch
    import triton

    n = 1 << 30
    src = torch.empty(n, dtype=torch.uint8, device=device).random_(0, 255)
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=50, rep=300, return_mode="median")
    return 2 * n / (ms * 1e-3)


class KVSet:
    """R copies of one paged KV problem: caches [pages, Hkv, P, D], a shared block table."""

    def __init__(self, hkv, d, kv_dtype, batch, context, page_size, device, seed=0):
        import torch

        self.kv_dtype = kv_dtype
        self.dtype = _torch_dtype(kv_dtype)
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        pages_per_req = -(-context // page_size)
        self.num_pages = batch * pages_per_req + 1
        # KV bytes one call must read (int8: the float16 scale of each token and head too)
        scale_bytes = 2 if self.dtype == torch.int8 else 0
        self.bytes = 2 * batch * context * hkv * (d * itemsize + scale_bytes)
        copy_bytes = 2 * self.num_pages * hkv * page_size * d * itemsize
        self.reps = max(1, min(16, math.ceil(4 * L2_BYTES / copy_bytes)))
        g = torch.Generator(device=device)
        g.manual_seed(seed)
        self.caches = []
        for _ in range(self.reps):
            pair = []
            for _kv in range(2):
                t = torch.empty((self.num_pages, hkv, page_size, d), dtype=self.dtype, device=device)
                step = max(1, (1 << 27) // (hkv * page_size * d))
                for p0 in range(0, self.num_pages, step):
                    chunk = torch.randn(t[p0:p0 + step].shape, generator=g, device=device)
                    if self.dtype == torch.int8:
                        chunk = chunk.mul_(40).round_().clamp_(-127, 127)
                    t[p0:p0 + step] = chunk.clamp_(-400, 400).to(self.dtype)
                pair.append(t)
            self.caches.append(tuple(pair))
        self.scales = None  # int8: (k, v) float16 scale caches [pages, Hkv, P] per copy
        if self.dtype == torch.int8:
            self.scales = [tuple(torch.rand((self.num_pages, hkv, page_size), generator=g,
                                            device=device).add_(0.5).mul_(0.02).half()
                                 for _ in range(2)) for _ in range(self.reps)]
        perm = torch.randperm(self.num_pages - 1, generator=g, device=device).to(torch.int32) + 1
        self.block_table = perm[: batch * pages_per_req].view(batch, pages_per_req).contiguous()
        self.kv_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
        self.batch, self.context, self.page_size = batch, context, page_size
        self.head_dim = d
        self.pages_per_req = pages_per_req


def rotating(fns):
    """One callable that runs ``fns`` in turn (each call the next copy of the inputs, so timed
    inputs never sit in L2)."""
    state = [0]

    def call():
        fns[state[0] % len(fns)]()
        state[0] += 1

    return call


def capture_graph(fns):
    """One CUDA graph of the calls ``fns`` (each run once on a side stream first: compiles and
    allocates outside the capture), replayed once, synchronized."""
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for f in fns:
            f()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for f in fns:
            f()
    g.replay()
    torch.cuda.synchronize()
    return g


def graph_us(fns, iters: int = 10) -> float:
    """Median microseconds per call of ``fns`` (each one call, e.g. one per rotating input copy)
    captured in one CUDA graph and replayed ``iters`` times, median of 5: GPU time without the
    host's launch work, the way the engine runs decode steps."""
    import torch

    g = capture_graph(fns)
    times = []
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(iters):
            g.replay()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / (iters * len(fns)))
    return sorted(times)[len(times) // 2]


NO_FI_INT8 = "FlashInfer reads no int8 KV pages"  # why an int8 point has no FlashInfer row


def time_fi_into(rec: dict, args, why, time_fi) -> None:
    """FlashInfer's side of a kernel point: nothing with ``--no-fi``; ``rec["fi_error"] = why``
    when FlashInfer cannot run the point (``why`` a reason, else None); otherwise
    ``rec["fi_us"] = time_fi()``, or the error it raised in ``rec["fi_error"]``."""
    if args.no_fi:
        return
    if why is not None:
        rec["fi_error"] = why
        return
    try:
        rec["fi_us"] = time_fi()
    except Exception as e:  # noqa: BLE001 - a FlashInfer failure is reported in the row
        rec["fi_error"] = f"{type(e).__name__}: {e}"[:300]


def page_size(args, kv_dtype: str, head_dim: int) -> int:
    """--page-size, else the page size the engine picks for this KV dtype and head size."""
    from kvfit.attention.triton_backend import TritonBackend

    return args.page_size or TritonBackend.default_page_size(kv_dtype, head_dim)


def ours_v_layout(kv: KVSet) -> str:
    """The V page layout the triton backend asks its pool for at this KV dtype."""
    from kvfit.attention.triton_backend import TritonBackend

    return TritonBackend.v_layout(kv.kv_dtype, kv.page_size, kv.head_dim)


def ours_v_caches(kv: KVSet) -> list:
    """V caches in our backend's layout: HND as filled, or token-minor copies [pages, H, D, P]
    (same values, so both kernels see identical inputs)."""
    if ours_v_layout(kv) == "HND":
        return [c[1] for c in kv.caches]
    if not hasattr(kv, "v_token_minor"):
        kv.v_token_minor = [c[1].transpose(2, 3).contiguous() for c in kv.caches]
    return kv.v_token_minor


def scale_kwargs(kv: KVSet, i: int) -> dict:
    """The int8 scale-cache arguments of copy ``i`` (none for other dtypes)."""
    if kv.scales is None:
        return {}
    return {"k_scale_cache": kv.scales[i][0], "v_scale_cache": kv.scales[i][1]}
