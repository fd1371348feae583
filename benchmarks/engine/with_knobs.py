"""Run the kvfit CLI with module-level switches set in-process (A/B of options that are not
flags): ``python3 benchmarks/engine/with_knobs.py 'module:attr=value;...' TILES|- kvfit-args...``.
TILES: a ``gemv_persistent_sweep.py --json`` file whose tiles go into ``gemv.GEMV_CONFIG``, or
``-``. Example: ``... 'kvfit.kernels.decode:FUSED_MERGE=True' - bench latency --model ...``."""
import ast
import importlib
import json
import sys

for item in filter(None, sys.argv[1].split(";")):
    mod, rest = item.split(":", 1)
    attr, val = rest.split("=", 1)
    setattr(importlib.import_module(mod), attr, ast.literal_eval(val))
    print("set", mod, attr, val, flush=True)
if sys.argv[2] != "-":
    from kvfit.kernels import gemv
    for per_bm in json.load(open(sys.argv[2])).values():
        for bm, e in per_bm.items():
            gemv.GEMV_CONFIG[(e["n_out"], e["k"], e["gated"], int(bm))] = tuple(e["tile"])
    print("GEMV_CONFIG", gemv.GEMV_CONFIG, flush=True)
sys.argv = ["kvfit"] + sys.argv[3:]
from kvfit.cli import main  # noqa: E402

sys.exit(main())
