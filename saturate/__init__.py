"""parsat.saturate: the joint search: rules applied together by equality saturation, the cheapest plan extracted.

Modules, in the order `optimize` uses them:
`api` (`optimize`: inputs, saturation, extraction, baselines, the plan),
`inputs` (the library, graph, device count and pins, checked), `errors`,
`deadline` (the one time limit every search of a call shares);
the e-graph: `instances` (which rule instances can fire on this graph),
`guards` (the degrees where a rule keeps the device layout), `rule_text`
(an instance as egglog rules), `encoding` (sorts, tables, the graph as
egglog text), `program` (`compile_rules`), `session` (the e-graph; the only
egglog importer), `runner` (one saturation loop: limits, stop reason,
matches per rule), `saturate` (compile, load, run, read back),
`snapshot` (the e-graph read back);
the choice: `cost` (the cost model, per node), `op_time` (an operator's
time: roofline with GEMM and bandwidth efficiency, dispatch cost),
`collectives` (NCCL's algorithms from a group's topology), `simulator`
(the step as tasks on streams: critical path, overlap, memory),
`schedules` (DDP buckets, FSDP prefetch), `pcg_tasks` (a plan's step as
tasks, per execution profile), `extract` (bottom-up, greedy DAG and
ILP extraction), `solve` (price, extract, build the PCG), `baselines`
(data parallel, Megatron, sequential); and `cli` (`parsat explain`, `parsat show`).

This package applies the rules it is given; which are trusted is the
facade's choice (`parsat.api`), so it never imports the verifier.
"""
