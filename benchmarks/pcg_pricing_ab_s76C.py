"""In-process A/B of a PCG's pricing on the inputs of one llama-70b:64 call (session 76, helper C; after
`pcg_pricing_ab_s75P.py`): every `pcg_node_costs` and `restaged_node_costs` call of the call (the pricing inside a
restaged call not counted apart) replayed through a base tree's `search/solve.py` (BASE, default /work/main) and
this tree's, alternating, on clones of the call's PCGs (fresh `derived` tables shared as the call's forms share
them; STRUCT=1: fresh `structural` tables too; readers and node tables warm), with a digest of every result and of
which nodes share a cost object. ONLY=R: the restaged calls alone. The collector off, as in a search.

    cd /tmp && PYTHONPATH=<tree> [ONLY=R] <tree>/.venv/bin/python <tree>/benchmarks/pcg_pricing_ab_s76C.py ROUNDS [0|1]
"""
import os, sys, time, gc, importlib.util, hashlib, pickle
BASE = os.environ.get("BASE", "/work/main")
STRUCT = os.environ.get("STRUCT", "0") == "1"
import parsat
import parsat.search.solve as solve, parsat.search.baselines as bl, parsat.search.step as st
from parsat.ir.pcg import PCG

def load(name, path):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec); sys.modules[name] = mod; spec.loader.exec_module(mod); return mod
old_solve = load("old_solve", BASE + "/parsat/search/solve.py")

calls = []
orig_p = solve.pcg_node_costs
orig_r = solve.restaged_node_costs
inside = [0]
def wp(pcg, *a, **k):
    if not inside[0]: calls.append((pcg, a, k))
    return orig_p(pcg, *a, **k)
def wr(raw, pcg, zero, *a, **k):
    calls.append(("R", raw, pcg, zero, a, k)); inside[0] += 1
    try: return orig_r(raw, pcg, zero, *a, **k)
    finally: inside[0] -= 1
for m in (solve, bl, st):
    if getattr(m, "pcg_node_costs", None) is orig_p: m.pcg_node_costs = wp
    if getattr(m, "restaged_node_costs", None) is orig_r: m.restaged_node_costs = wr
t = time.process_time()
parsat.optimize("llama-70b", machine="h100x8", devices=64)
print(f"call {time.process_time() - t:.2f}; {len(calls)} calls", flush=True)
for m in (solve, bl, st):
    if getattr(m, "pcg_node_costs", None) is wp: m.pcg_node_costs = orig_p
    if getattr(m, "restaged_node_costs", None) is wr: m.restaged_node_costs = orig_r
gc.collect(); gc.freeze(); gc.disable()

def clones():
    fresh, sfresh, out = {}, {}, {}
    for c in calls:
      for pcg in ((c[0],) if c[0] != "R" else (c[2], c[5].get("form") or c[2])):
        if id(pcg) in out:
            continue
        new = PCG(pcg.nodes, pcg.outputs, pcg.output_names, pcg.mesh, pcg.recompute, pcg.zero)
        new.__dict__["derived"] = fresh.setdefault(id(pcg.derived), {})
        if STRUCT:
            new.__dict__["structural"] = sfresh.setdefault(id(pcg.structural), {})
            # roles are structural but not ours: keep them warm
            for key, v in pcg.structural.items():
                if key[0] in ("pcg_roles", "weight_chains"):
                    new.__dict__["structural"][key] = v
        else:
            new.__dict__["structural"] = pcg.structural
        for kk in ("readers_of", "storage_chains", "_by_id"):
            new.__dict__[kk] = getattr(pcg, kk)
        out[id(pcg)] = new
    return out

def call(pnc, made, c):
    if c[0] == "R":
        _, raw, pcg, zero, a, k = c
        k = dict(k)
        if k.get("form") is not None: k["form"] = made[id(k["form"])]
        return (old_solve if pnc is old_solve.pcg_node_costs else solve).restaged_node_costs(raw, made[id(pcg)], zero, *a, **k)
    pcg, a, k = c
    return pnc(made[id(pcg)], *a, **k)

def run(pnc, check=False):
    made = clones()
    h = hashlib.sha256()
    t = time.process_time()
    for c in calls:
        out = call(pnc, made, c)
        if check:
            h.update(repr(None if out is None else sorted((i, repr(v)) for i, v in out.items())).encode())
            h.update(repr(None if out is None else [id(v) for v in out.values()].__len__()).encode())
    return time.process_time() - t, h.hexdigest()[:16]

def sharing(pnc):
    """Which nodes share one cost object, per call (the partition must be the same)."""
    made = clones(); h = hashlib.sha256()
    for c in calls:
        out = call(pnc, made, c)
        if out is None: h.update(b"N"); continue
        first = {}
        h.update(repr([first.setdefault(id(v), i) for i, v in out.items()]).encode())
    return h.hexdigest()[:16]

print("digest old", run(old_solve.pcg_node_costs, True)[1], "new", run(solve.pcg_node_costs, True)[1])
print("sharing old", sharing(old_solve.pcg_node_costs), "new", sharing(solve.pcg_node_costs), flush=True)
ONLY = os.environ.get("ONLY")
if ONLY == "R": calls[:] = [c for c in calls if c[0] == "R"]
ra, rb = [], []
for r in range(int(sys.argv[1]) if len(sys.argv) > 1 else 3):
    a = run(old_solve.pcg_node_costs)[0]; b = run(solve.pcg_node_costs)[0]
    ra.append(a); rb.append(b)
    print(f"round {r}: old {a:.3f} new {b:.3f} (load {os.getloadavg()[0]:.1f})", flush=True)
print(f"mean old {sum(ra)/len(ra):.3f} new {sum(rb)/len(rb):.3f}; min old {min(ra):.3f} new {min(rb):.3f}")
if len(sys.argv) > 2:
    import cProfile, pstats
    for label, f in (("OLD", old_solve.pcg_node_costs), ("NEW", solve.pcg_node_costs))[int(sys.argv[2]):]:
        p = cProfile.Profile(); p.enable(); run(f); p.disable()
        print(label); pstats.Stats(p).sort_stats("tottime").print_stats(22)
