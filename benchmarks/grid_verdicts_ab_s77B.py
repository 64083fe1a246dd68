"""In-process A/B of the grid's excluded e-nodes (session 77, helper B): every `grid_excluded` ask of one
llama-70b:64 call (`baselines.best_grid`, one per mesh) replayed through a base tree's `config_excluded`, one point
at a time (BASE, default /work/main, loaded from its file), and this tree's `grid_excluded`, alternating; each
point's set compared.

    cd /tmp && PYTHONPATH=<tree> <tree>/.venv/bin/python <tree>/benchmarks/grid_verdicts_ab_s77B.py ROUNDS
"""
import gc, importlib.util, os, sys, time
import parsat
import parsat.search.baselines as bl
import parsat.search.strategies as strategies

BASE = os.environ.get("BASE", "/work/main")
spec = importlib.util.spec_from_file_location("old_strategies", BASE + "/parsat/search/strategies.py")
old = importlib.util.module_from_spec(spec); sys.modules["old_strategies"] = old; spec.loader.exec_module(old)

asks = []
orig = bl.grid_excluded
def wrapped(snapshot, roles, configs, batch=None, split=frozenset(), shared=None):
    asks.append((snapshot, roles, list(configs), batch, split, shared))
    return orig(snapshot, roles, configs, batch, split, shared)
bl.grid_excluded = wrapped
t = time.process_time()
parsat.optimize("llama-70b", machine="h100x8", devices=64)
print(f"call {time.process_time() - t:.2f}; {len(asks)} asks, {sum(len(a[2]) for a in asks)} points", flush=True)
bl.grid_excluded = orig
gc.collect(); gc.freeze(); gc.disable()

def run_old():
    return [[old.config_excluded(s, r, c, b, sp, sh).__self__ for c in cs] for s, r, cs, b, sp, sh in asks]
def run_new():
    return [[p.__self__ for p in strategies.grid_excluded(s, r, cs, b, sp, sh)] for s, r, cs, b, sp, sh in asks]
assert run_old() == run_new()
print("every point's set equal", flush=True)
ra, rb = [], []
for r in range(int(sys.argv[1]) if len(sys.argv) > 1 else 5):
    t = time.process_time(); run_old(); a = time.process_time() - t
    t = time.process_time(); run_new(); b = time.process_time() - t
    ra.append(a); rb.append(b)
    print(f"round {r}: old {a:.3f} new {b:.3f} (load {os.getloadavg()[0]:.1f})", flush=True)
print(f"mean old {sum(ra)/len(ra):.3f} new {sum(rb)/len(rb):.3f}; min old {min(ra):.3f} new {min(rb):.3f}")
