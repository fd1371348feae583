"""Helpers of the Gluon kernels' CPU tests: stand-ins for a jitted kernel in the tests of its
host launch (one that records each launch's grid and arguments bound against the real
kernel's signature, nothing executes; one that fails as a Triton that cannot compile the
kernel does), and the sm_90 compile of a kernel in a process of its own."""

from __future__ import annotations

import inspect

OPTIONS = ("maxnreg",)  # launch options, not kernel parameters


class Recording:
    """``kernel[grid](*args, **kwargs)`` appends ``(grid, {parameter: value})`` to ``calls``:
    the arguments bound to ``real``'s parameters (a missing or unknown one raises), plus the
    launch options given."""

    def __init__(self, real, calls: list):
        self.sig = inspect.signature(real.fn)
        self.calls = calls

    def __call__(self):  # stands for the module's cached ``build()``
        return self

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            bound = self.sig.bind(*args, **{k: v for k, v in kwargs.items()
                                            if k not in OPTIONS}).arguments
            self.calls.append((grid, {**bound, **{k: kwargs[k] for k in OPTIONS
                                                  if k in kwargs}}))
        return run


class Broken:
    """``kernel[grid](...)`` raises as a Triton without the kernel's Gluon names does."""

    def __call__(self):
        return self

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            raise AttributeError("module 'gluon' has no attribute 'async_load'")
        return run


def compile_sm90(script: str, *args) -> dict:
    """Run ``script`` (which compiles a Gluon kernel for sm_90 and prints one JSON line) in a
    process of its own, without Triton's interpreter (the CPU suite runs under it, and Gluon has
    none): the JSON, or a skip when this machine has no ptxas for sm_90."""
    import json
    import os
    import subprocess
    import sys

    import pytest

    env = dict(os.environ, TRITON_INTERPRET="0")
    r = subprocess.run([sys.executable, "-c", script, *map(str, args)], env=env,
                       capture_output=True, text=True, timeout=600)
    if r.returncode != 0 and "ptxas" in r.stderr.lower() and "not found" in r.stderr.lower():
        pytest.skip("no ptxas for sm_90 on this machine")
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])
