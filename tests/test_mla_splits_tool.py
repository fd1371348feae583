"""benchmarks/kernels/mla_splits.py: a profiled MLA call's device time split into its decode and
merge kernels by name."""

import random

from bench_scripts import kernel_script


def _tool():
    return kernel_script("mla_splits")


def test_split_kernels_sums_decode_and_merge_by_name():
    rng = random.Random()
    dec = [rng.uniform(1, 500) for _ in range(2)]
    mrg = rng.uniform(1, 50)
    times = {"_mla_decode_fp8_regs": dec[0], "_mla_decode_gluon": dec[1], "_decode_merge": mrg,
             "void at::native::vectorized_elementwise_kernel": rng.uniform(1, 9)}
    got = _tool().split_kernels(times)
    assert abs(got[0] - sum(dec)) < 1e-9 and abs(got[1] - mrg) < 1e-9
    assert _tool().split_kernels({}) == (0.0, 0.0)
