"""How rank 0 should hand each step's inputs to the tensor-parallel workers, measured on CPU.

Round trip per step: rank 0 sends one step message (a decode step of ``--batch`` requests, each
with a page table of ``--context / 16`` pages, the ``StepPlan`` the runner sends), every worker
receives and unpickles it and answers with an acknowledgement, as the first all-reduce of the
real step would. Two transports:

* ``broadcast``: ``kvfit.parallel.step_channel.StepChannel`` (one gloo broadcast of a 64 KiB
  buffer, a second one only for bigger messages), the ack a 1-element gloo all-reduce;
* ``queue``: one ``multiprocessing`` queue per worker (pickled per put, a feeder thread, a
  pipe), the ack on a shared return queue.

    PYTHONPATH=src python3 benchmarks/tp/step_transport.py --ranks 2 3 --batch 1 64 256

Prints one table: microseconds per step (median of ``--steps``), the message size, and the
gloo acknowledgement alone (a real step has its own collectives after the hand-off instead).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import pickle
import statistics
import time

import numpy as np


def _message(batch: int, context: int):
    from kvfit.engine.runner import StepPlan

    pages = context // 16
    rng = np.random.default_rng(0)
    return StepPlan(rng.integers(0, 50000, batch), np.full(batch, context - 1),
                    [1] * batch, [context] * batch,
                    [rng.integers(0, 100000, pages).tolist() for _ in range(batch)],
                    [f"req-{i}" for i in range(batch)], [(i, i) for i in range(batch)],
                    list(range(batch)), [])


def _bcast_worker(rank, size, port, steps):
    import torch
    import torch.distributed as dist

    from kvfit.parallel.step_channel import StepChannel

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=size)
    ch, one = StepChannel(dist.group.WORLD), torch.ones(1)
    for _ in range(steps):
        ch.recv()
        dist.all_reduce(one)
    for _ in range(steps):  # the acknowledgement alone
        dist.all_reduce(one)
    dist.destroy_process_group()


def _queue_worker(q, acks, steps):
    for _ in range(steps):
        q.get()
        acks.put(1)


def run_broadcast(size, msg, steps) -> float:
    import torch
    import torch.distributed as dist

    from kvfit.parallel.step_channel import StepChannel
    from kvfit.parallel.workers import free_port

    port = free_port()
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_bcast_worker, args=(r, size, port, steps)) for r in range(1, size)]
    for p in procs:
        p.start()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0,
                            world_size=size)
    ch, one = StepChannel(dist.group.WORLD), torch.ones(1)
    times, acks = [], []
    for _ in range(steps):
        t = time.perf_counter()
        ch.send(msg)
        dist.all_reduce(one)
        times.append(time.perf_counter() - t)
    for _ in range(steps):
        t = time.perf_counter()
        dist.all_reduce(one)
        acks.append(time.perf_counter() - t)
    dist.destroy_process_group()
    for p in procs:
        p.join()
    return statistics.median(times[steps // 10:]), statistics.median(acks[steps // 10:])


def run_queue(size, msg, steps) -> float:
    ctx = mp.get_context("spawn")
    qs, acks = [ctx.Queue() for _ in range(1, size)], ctx.Queue()
    procs = [ctx.Process(target=_queue_worker, args=(q, acks, steps)) for q in qs]
    for p in procs:
        p.start()
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        for q in qs:
            q.put(msg)
        for _ in qs:
            acks.get()
        times.append(time.perf_counter() - t)
    for p in procs:
        p.join()
    return statistics.median(times[steps // 10:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 3])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 64, 256])
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=300)
    a = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    print("| ranks | batch | message KiB | broadcast + gloo ack us/step | of which the ack alone "
          "| queue + queue ack us/step |")
    print("|---:|---:|---:|---:|---:|---:|")
    for size in a.ranks:
        for b in a.batch:
            msg = _message(b, a.context)
            kib = len(pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)) / 1024
            tb, ack = run_broadcast(size, msg, a.steps)
            tq = run_queue(size, msg, a.steps)
            print(f"| {size} | {b} | {kib:.1f} | {tb * 1e6:.0f} | {ack * 1e6:.0f} | "
                  f"{tq * 1e6:.0f} |", flush=True)


if __name__ == "__main__":
    main()
