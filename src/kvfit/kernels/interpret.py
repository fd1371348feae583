"""Running our kernels under the Triton interpreter (``TRITON_INTERPRET=1``, CPU tensors).

The kernels are defined inside each module's ``build()`` (Triton is imported on first use) and
call helper ``@triton.jit`` functions through the closure. The interpreter re-executes a
kernel's source against its module globals only, so closures are lost there:
``expose_for_interpreter`` publishes a build scope's names in the module globals when
interpreting (a no-op when compiling for a GPU).
"""

from __future__ import annotations

import os


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def expose_for_interpreter(module_globals: dict, scope: dict) -> None:
    """Mutates ``module_globals`` (only under the interpreter): adds the build scope's jitted
    helpers and constants that are not already module names."""
    if not interpreting():
        return
    for name, value in scope.items():
        if not name.startswith("__") and name not in module_globals:
            module_globals[name] = value
