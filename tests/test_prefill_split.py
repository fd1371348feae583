"""The split-KV extend (kernels/prefill_split.py) on CPU under the Triton interpreter: every KV
format the triton backend stores, both V layouts, against a float32 reference, and the same
bits from a padded (spare-program) grid. Runs tests/split_checks.py in a subprocess with
TRITON_INTERPRET=1."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

HERE = os.path.dirname(os.path.abspath(__file__))


def test_split_extend_under_the_interpreter():
    src = os.path.join(os.path.dirname(HERE), "src")
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run([sys.executable, os.path.join(HERE, "split_checks.py")],
                       env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "ok split" in r.stdout
