"""Session 77: set-up (Session.__init__) and saturation (Session.run) CPU s summed over one llama-70b:64 call, total and
peak RSS, as JSON. Run in each tree with PYTHONPATH set: PYTHONPATH=TREE .venv/bin/python benchmarks/sessions_ab_s77.py"""
import sys, time, json, resource, parsat
import parsat.egraph.session as S
acc = {"init": 0.0, "run": 0.0, "n": 0}
oi, orun = S.Session.__init__, S.Session.run
def init(self, *a, **k):
    t = time.process_time(); oi(self, *a, **k); acc["init"] += time.process_time() - t; acc["n"] += 1
def run(self, *a, **k):
    t = time.process_time(); r = orun(self, *a, **k); acc["run"] += time.process_time() - t; return r
S.Session.__init__, S.Session.run = init, run
t = time.process_time()
parsat.optimize("llama-70b", machine="h100x8", devices=64)
acc["total"] = time.process_time() - t
acc["rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
print(json.dumps({k: round(v, 2) for k, v in acc.items()}))
