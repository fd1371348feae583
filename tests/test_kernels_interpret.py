"""The int8 / K-centering Triton kernels on CPU under the Triton interpreter (small shapes):
stores byte-equal to the torch reference of the format, attention against a float32
reference. Each group runs tests/interp_checks.py in a subprocess with TRITON_INTERPRET=1."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.mark.parametrize("group", ["stores", "attention", "rotation"])
def test_int8_kernels_under_the_interpreter(group):
    src = os.path.join(os.path.dirname(HERE), "src")
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run([sys.executable, os.path.join(HERE, "interp_checks.py"), group],
                       env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert f"ok {group}" in r.stdout
