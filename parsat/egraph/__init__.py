"""parsat.egraph: the e-graph layer: `.rule` instances compiled to egglog, a graph saturated, the e-graph read back.

The only package that imports egglog (in `session`, its one state module
in front of the bindings). It knows rules, graphs and meshes, and nothing
of costs or plans: the search (`parsat.search`) and rule discovery
(`parsat.generate`) both run saturations through it.

Modules, in the order a saturation uses them: `instances` (which rule
instances can fire on this graph), `guards` (the degrees where a rule
keeps the device layout), `lifting` (an instance lifted onto a device
mesh, docs/MESH.md), `rule_text` and `lifted_text` (an instance as egglog
rules), `encoding` and `mesh_encoding` (sorts, tables, the graph as egglog
text), `program` (`compile_rules`, `MeshCaches`), `program_cache` (a mesh's
compiled program kept on disk by its content), `loading` (the graph's
text into the e-graph: a command per term, its facts read in bulk),
`session` (the e-graph), `runner` (one saturation loop: `Limits`, the stop reason, matches per
rule), `sums` (the associativity rules that cannot pay off on a graph whose sums are sequential, left out
when `saturate` is asked to), `saturate` (compile, load, run, read back), `snapshot` (the e-graph
read back: e-classes, e-nodes, shapes, placements), `derivation` (what each
rule application read and built, from the match it recorded), `resize` (a saturated e-graph taken for a
graph of the same structure at other sizes, where every rule's guards read the sizes alike).
"""
