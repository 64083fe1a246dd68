"""In-process A/B of a PCG's pricing on the inputs of one llama-70b:64 call (session 75, helper P): every
`pcg_node_costs`, `recomputed_pcg_costs` and `kept_reads` call of the call replayed through a base tree's
functions (loaded from BASE's files, default /work/main) and this tree's, alternating, on clones of the call's
PCGs (fresh `derived` tables shared as the call's forms share them; structural facts, readers and node tables
warm), with a digest of every result from each side.

    cd /tmp && PYTHONPATH=<tree> <tree>/.venv/bin/python <tree>/benchmarks/pcg_pricing_ab_s75P.py ROUNDS [prof]
"""
import os, sys, time, gc, importlib.util, hashlib
BASE = os.environ.get("BASE", "/work/main")
import parsat
import parsat.search.solve as solve, parsat.search.baselines as bl, parsat.search.step as st
import parsat.search.recompute as rc
import parsat.cost.saved as saved
from parsat.ir.pcg import PCG, pcg_roles

def load(name, path):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec); sys.modules[name] = mod; spec.loader.exec_module(mod); return mod
old_ring = load("old_ring", BASE + "/parsat/ir/ring_attention.py")
old_rt = load("old_rt", BASE + "/parsat/cost/ring_time.py"); old_rt.ring_attentions = old_ring.ring_attentions
old_solve = load("old_solve", BASE + "/parsat/search/solve.py"); old_solve.rings_run = old_rt.rings_run
old_rc = load("old_rc", BASE + "/parsat/search/recompute.py")
old_saved = load("old_saved", BASE + "/parsat/cost/saved.py")

calls = []
orig_p, orig_r = solve.pcg_node_costs, rc.recomputed_pcg_costs
def wp(pcg, *a, **k):
    calls.append(("p", pcg, a, k)); return orig_p(pcg, *a, **k)
def wr(pcg, costs):
    calls.append(("r", pcg, costs, None)); return orig_r(pcg, costs)
solve.pcg_node_costs = bl.pcg_node_costs = st.pcg_node_costs = wp
solve.recomputed_pcg_costs = bl.recomputed_pcg_costs = wr
kr = []
orig_kr = saved.kept_reads
def wk(readers, library, roles):
    readers = list(readers); kr.append((readers, library, roles)); return orig_kr(readers, library, roles)
saved.kept_reads = wk
t = time.process_time()
parsat.optimize("llama-70b", machine="h100x8", devices=64)
print(f"call {time.process_time() - t:.2f}; {len(calls)} calls, {len(kr)} kept_reads", flush=True)
solve.pcg_node_costs, solve.recomputed_pcg_costs, saved.kept_reads = orig_p, orig_r, orig_kr
gc.collect(); gc.freeze()

def clones():
    """Each PCG again with a fresh `derived` table (forms that shared one share a fresh one), its structural
    facts, readers and node table the call's (warm): what the cluster's per-PCG work reads."""
    fresh, out = {}, {}
    for c in calls:
        pcg = c[1]
        if id(pcg) in out:
            continue
        new = PCG(pcg.nodes, pcg.outputs, pcg.output_names, pcg.mesh, pcg.recompute, pcg.zero)
        new.__dict__["derived"] = fresh.setdefault(id(pcg.derived), {})
        for k in ("structural", "readers_of", "storage_chains", "_by_id"):
            new.__dict__[k] = getattr(pcg, k)
        out[id(pcg)] = new
    return out

def run(pnc, rpc, check=False):
    made = clones()
    h = hashlib.sha256()
    t = time.process_time(); tp = 0.0
    for c in calls:
        new = made[id(c[1])]
        t0 = time.process_time()
        out = pnc(new, *c[2], **c[3]) if c[0] == "p" else rpc(new, c[2])
        if c[0] == "p": tp += time.process_time() - t0
        if check:
            h.update(repr(None if out is None else sorted((i, repr(v)) for i, v in out.items())).encode())
    return time.process_time() - t, tp, h.hexdigest()[:16]

def run_kr(f):
    t = time.process_time()
    res = [f(*a) for a in kr]
    return time.process_time() - t, hashlib.sha256(repr([(sorted(a), sorted(b)) for a, b in res]).encode()).hexdigest()[:16]

print("digest old", run(old_solve.pcg_node_costs, old_rc.recomputed_pcg_costs, True)[2],
      "new", run(solve.pcg_node_costs, rc.recomputed_pcg_costs, True)[2])
print("kept_reads digest old", run_kr(old_saved.kept_reads)[1], "new", run_kr(saved.kept_reads)[1])
for r in range(int(sys.argv[1]) if len(sys.argv) > 1 else 3):
    a = run(old_solve.pcg_node_costs, old_rc.recomputed_pcg_costs)
    b = run(solve.pcg_node_costs, rc.recomputed_pcg_costs)
    ka, kb = run_kr(old_saved.kept_reads)[0], run_kr(saved.kept_reads)[0]
    print(f"round {r}: old all {a[0]:.3f} (pnc {a[1]:.3f}, rpc {a[0]-a[1]:.3f}) | new all {b[0]:.3f} "
          f"(pnc {b[1]:.3f}, rpc {b[0]-b[1]:.3f}) | kept_reads old {ka:.3f} new {kb:.3f}", flush=True)
if len(sys.argv) > 2:
    import cProfile, pstats
    for label, f in (("OLD", old_solve.pcg_node_costs), ("NEW", solve.pcg_node_costs)):
        p = cProfile.Profile(); p.enable(); run(f, old_rc.recomputed_pcg_costs); p.disable()
        print(label); pstats.Stats(p).sort_stats("tottime").print_stats(14)
