"""Print, as JSON choose_config overrides, the fp8 decode variant with the lowest total time
over the points of an --explore run (kernels.json)."""

import ast
import json
import re
import sys
from collections import defaultdict

res = json.load(open(sys.argv[1]))["results"]
tot = defaultdict(float)
for r in res:
    for v in r.get("variants", []):
        tot[v["cfg"]] += v["us"]
best = min(tot, key=tot.get)
fields = dict(re.findall(r"(\w+)=([^,)]+)", best))
out = {k: ast.literal_eval(fields[k]) for k in ("block_n", "num_warps", "num_stages", "v_pairs",
                                                "maxnreg")}
print(json.dumps(out))
