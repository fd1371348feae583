"""Loading a script of benchmarks/kernels/ (not a package) as a module, for the CPU tests of its
pure parts."""

import importlib.util
import os


def kernel_script(name: str):
    """benchmarks/kernels/NAME.py imported as the module NAME (executed once per call)."""
    path = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "kernels", f"{name}.py")
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
