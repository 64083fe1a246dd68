"""Session 77: CPU s of a cold mesh-rule compile and of lifted_text.lifted_bodies within it, a 3-block gpt on (8,) and (2, 4):
.venv/bin/python benchmarks/lifted_bodies_compile_s77.py"""
import time, cProfile, pstats
from parsat.dsl.checker import resolve_library
from parsat.egraph.program import compile_mesh_rules, MeshCaches
from parsat.egraph.instances import graph_signatures
from parsat.ir.mesh import Mesh
from parsat.ir.models import build_example
import parsat.egraph.lifted_text as LT
library = resolve_library(None)
graph = build_example("llama", {"blocks": 3}, library) if False else build_example("gpt", {"blocks": 3, "hidden": 64, "heads": 4, "batch": 8, "seq": 16, "vocab": 128}, library)
acc = {"t": 0.0, "n": 0, "nosigma": 0}
orig = LT.lifted_bodies
def timed(lifted, mesh):
    t = time.process_time(); r = orig(lifted, mesh); acc["t"] += time.process_time() - t; acc["n"] += 1
    acc["nosigma"] += not lifted.sigma
    return r
import parsat.egraph.program as P
P.lifted_bodies = timed
for shape in [(8,), (2, 4)]:
    acc.update(t=0.0, n=0, nosigma=0)
    t = time.process_time()
    prog = compile_mesh_rules(library, library.rules, graph.ranks(), Mesh.of(shape), {n.op for n in graph.nodes}, graph_signatures(graph, library.ops), caches=MeshCaches())
    print(shape, "compile", round(time.process_time() - t, 2), "lifted_bodies", round(acc["t"], 2), acc)
