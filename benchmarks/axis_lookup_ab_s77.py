"""In-process: saturation run time of llama-70b:64's 2x8 mesh, rules reading AxisSize vs numbers written."""
import re, sys, time
from dataclasses import replace
import parsat
import parsat.search.mesh as M
import parsat.egraph.saturate as SAT
import parsat.egraph.session as S
from parsat.egraph.mesh_encoding import AXIS_SIZE, at_sizes
calls = []
orig = M.saturate
def hooked(graph, library, rules, mesh, *a, **k):
    r = orig(graph, library, rules, mesh, *a, **k)
    if len(mesh.shape) == 2 and not calls:
        calls.append((graph, library, rules, mesh, a, k, r))
    return r
M.saturate = hooked
parsat.optimize("llama-70b", machine="h100x8", devices=64)
g, lib, rules, mesh, a, k, r = calls[0]
k = dict(k); k.pop("caches", None)
LOOK = re.compile(rf"\(= z\d+ \({AXIS_SIZE} \d+\)\) ")
sized = r.program
numbers = replace(sized, rules=tuple(replace(x, text=at_sizes(LOOK.sub("", x.text), mesh.shape)) for x in sized.rules))
acc = {"t": 0.0}
orun = S.Session.run
def run(self, *aa, **kk):
    t = time.process_time(); out = orun(self, *aa, **kk); acc["t"] += time.process_time() - t; return out
S.Session.run = run
use = {}
SAT.cached_mesh_rules = lambda *aa, **kk: use["p"]
res = {"sized": [], "numbers": []}
for rnd in range(5):
    for name, prog in (("sized", sized), ("numbers", numbers)) if rnd % 2 == 0 else (("numbers", numbers), ("sized", sized)):
        use["p"] = prog; acc["t"] = 0.0
        out = orig(g, lib, rules, mesh, *a, **k)
        res[name].append(round(acc["t"], 3))
        assert out.enodes == r.enodes
print(mesh.shape, res, {n: round(sum(v) / len(v), 3) for n, v in res.items()})
