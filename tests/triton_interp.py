"""Run kvfit's Triton kernels on the CPU under Triton's interpreter (tests only).

``TRITON_INTERPRET=1`` must be set before triton is first imported (triton's own library
functions are ``@jit`` too): tests/conftest.py sets it on CPU-only hosts, ``enable()`` checks it. kvfit builds its kernels inside functions (``build()``, imported
lazily), so a kernel calls helper ``@triton.jit`` functions held in its closure; the interpreter
re-executes each kernel's source against the module's globals only, which loses those names.
``enable()`` patches the interpreter to add the closure's variables to the namespace it executes
in (a copy: the module's globals are not touched).
"""

from __future__ import annotations

import os
import sys
import types


def _names(fn) -> dict:
    """The names a kernel's source sees: its module's globals plus its closure's variables."""
    names = dict(fn.__globals__)
    if fn.__closure__:
        names.update(zip(fn.__code__.co_freevars, (c.cell_contents for c in fn.__closure__)))
    return names


def enable() -> bool:
    """Switch the interpreter on for this process; False on a machine with CUDA, where kernels
    stay compiled, or when triton was imported without it (the caller skips)."""
    import torch

    if torch.cuda.is_available():
        return False
    if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
        return False  # triton's own @jit library was built compiled (tests/conftest.py sets it)
    os.environ["TRITON_INTERPRET"] = "1"
    from triton.runtime import interpreter

    rewriter = interpreter.FunctionRewriter
    if getattr(rewriter, "_kvfit_closures", False):
        return True

    def _compile_and_exec(self, transformed_ast):
        code = compile(transformed_ast, filename=self.filename, mode="exec")
        names = _names(self.fn)
        for key, value in vars(interpreter).items():
            names.setdefault(key, value)
        local_namespace = {**self.kwargs}
        exec(code, names, local_namespace)
        return local_namespace[self.fn.__name__]

    patch_lang = interpreter._patch_lang

    def _patch_lang(fn):  # finds triton.language in the closure too
        return patch_lang(types.SimpleNamespace(__globals__=_names(fn)))

    rewriter._compile_and_exec = _compile_and_exec
    interpreter._patch_lang = _patch_lang
    rewriter._kvfit_closures = True
    return True
