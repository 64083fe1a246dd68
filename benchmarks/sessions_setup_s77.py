"""Session 77: each egglog session's set-up CPU s of one llama-70b:64 call (hooked Session.__init__), and its program and
graph text written to /tmp/s77_prog<i>.egg / s77_graph<i>.egg. Run from the tree to measure: .venv/bin/python benchmarks/sessions_setup_s77.py"""
import sys, time, parsat
import parsat.egraph.session as S
orig = S.Session.__init__
n = [0]
def init(self, program, graph_text, deadline=None, mesh=None, shared=None):
    t = time.process_time()
    orig(self, program, graph_text, deadline, mesh, shared)
    i = n[0]; n[0] += 1
    open(f"/tmp/s77_prog{i}.egg", "w").write(program.text())
    open(f"/tmp/s77_graph{i}.egg", "w").write(graph_text)
    print(f"SESSION {i} mesh={mesh} pushed={self._pushed} rules={len(program.rules)} decl_lines={program.declarations.count(chr(10))} graph_chars={len(graph_text)} {time.process_time()-t:.2f}s", file=sys.stderr)
S.Session.__init__ = init
parsat.optimize("llama-70b", machine="h100x8", devices=64)
