"""parsat.ir: the data every stage shares: graphs, PCGs, plans, machines, placements (docs/ARCHITECTURE.md).

Modules:
`graph` (the computation graph to optimize, shapes inferred; `GraphBuilder`),
`models` (built-in example graphs), `machine` (devices, speeds, links;
presets), `machine_profile` (operator efficiency and measured collectives
of a machine file), `precision` (training precisions, bytes per parameter,
ZeRO), `pcg` (the Parallel Computation Graph; a node's `Degrees`),
`placement` (which mesh atoms hold which piece: `Placement`),
`pcg_layout` (a PCG laid out on ranks, or the node that cannot be),
`data_parallel` (the textbook data-parallel PCG), `costs` (the cost
records a plan carries), `plan` (the plan, its JSON and `explain`),
`validate` (the JSON schemas, their structural checks, a plan's nodes
against the operator library, machines' ranges), `json_files` (reading
user files safely), `instance` (an operator at concrete shapes), `budget`
(how large a graph may grow, and until when, under the search's limits),
`errors` (GraphError, MachineError, PlanError).

The JSON forms are docs/graph-schema.md and docs/plan-schema.md. Importing
this package imports neither torch, z3 nor egglog.
"""
