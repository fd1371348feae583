"""Runs a snippet under Triton's CPU interpreter in a process of its own (TRITON_INTERPRET must
be set before Triton is imported), with tests/ on the path; shared by the int4 kernel tests."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).parent


def run_interpreted(code: str, timeout: int = 600) -> str:
    """Run ``code``; its stdout, or an AssertionError with its stderr's tail."""
    env = dict(os.environ, TRITON_INTERPRET="1",
               PYTHONPATH=os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=timeout)
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout
