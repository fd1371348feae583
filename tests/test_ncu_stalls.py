"""benchmarks/kernels/ncu_stalls.py: the per-instruction stall table of an ncu source export."""

import random

import pytest

from bench_scripts import kernel_script


def _tool():
    return kernel_script("ncu_stalls")


def _write(path, rows, reasons):
    # ncu's layout: a kernel-name line, the header, one line per SASS instruction; counts with
    # thousands separators as ncu prints them
    head = ["Address", "Source", "Warp Stall Sampling (All Samples)"] + [
        f"stall_{r}" for r in reasons] + [f"stall_{r} (Not Issued)" for r in reasons]
    lines = ['"Kernel Name","_k",', ",".join(f'"{h}"' for h in head)]
    for addr, src, counts in rows:
        total = sum(counts)
        vals = [addr, src, f"{total:,}"] + [f"{c:,}" for c in counts] + ["0"] * len(counts)
        lines.append(",".join(f'"{v}"' for v in vals))
    path.write_text("\n".join(lines) + "\n")


def test_stall_shares_and_hot_instructions(tmp_path):
    tool = _tool()
    rng = random.Random()
    reasons = ["short_sb", "long_sb", "barrier", "mio"]
    rows = [(f"0x{16 * i:x}", f"OP{i} R{i}", [rng.randrange(0, 2000) for _ in reasons])
            for i in range(40)]
    _write(tmp_path / "s.csv", rows, reasons)
    total, shares, hot = tool.summarize(*tool.read_source_csv(str(tmp_path / "s.csv")), top=5)
    want = {r: sum(c[k] for _, _, c in rows) for k, r in enumerate(reasons)}
    assert total == sum(want.values())
    assert [name for name, _ in shares] == sorted(want, key=lambda r: -want[r])
    assert shares[0][1] == pytest.approx(max(want.values()) / total)
    by_samples = sorted(rows, key=lambda r: -sum(r[2]))[:5]
    assert [src for _, _, src, _ in hot] == [src for _, src, _ in by_samples]
    n, share, _, why = hot[0]
    counts = by_samples[0][2]
    assert n == sum(counts) and share == pytest.approx(n / total)
    assert why[0] == (max(counts), reasons[counts.index(max(counts))])


def test_a_file_without_the_source_page_is_named(tmp_path):
    (tmp_path / "d.csv").write_text('"ID","Metric Name"\n"0","Duration"\n')
    with pytest.raises(ValueError, match="--page source"):
        _tool().read_source_csv(str(tmp_path / "d.csv"))
