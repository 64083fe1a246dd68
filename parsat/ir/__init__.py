"""parsat.ir: the data every stage shares: graphs, PCGs, plans, machines, placements, degrees (docs/ARCHITECTURE.md).

Modules:
`graph` (the computation graph to optimize, shapes inferred; `GraphBuilder`),
`models` (built-in example graphs), `machine` (devices, speeds, links;
presets), `machine_profile` (operator efficiency and measured collectives
of a machine file), `gemm_grid` (a calibrated machine's products measured
on a grid of shapes, read between its points), `precision` (training precisions, bytes per parameter,
ZeRO), `pcg` (the Parallel Computation Graph; a node's `Degrees`),
`placement` (which mesh atoms hold which piece: `Placement`),
`mesh` (the ranks of a job as named axes that follow the machine),
`pcg_placement` (every node's placement derived again and checked, or
the node that cannot be placed), `parallelism` (the kinds of parallelism
a plan's mesh axes amount to), `ring_attention` (the fused attentions a
GPU framework runs as a ring: q split on the sequence, k and v gathered
for it alone), `data_parallel` (the textbook
data-parallel PCG), `expert_parallel` (data parallelism with a mixture
of experts' experts split and tokens moved by all-to-all), `megatron` (Megatron-LM's data x tensor layout,
ZeRO-3 and sequence parallelism, built directly: the independent grid's
PCGs), `fused_projections` (a fused projection read apart, HF GPT-2's
`c_attn`, written as one product per block so a layout can store its
weight head by head), `costs` (the cost records a plan carries), `plan`
(the plan and its JSON; `parsat.report` presents it), `microbatch` (how a
step's batch is cut into micro-batches), `blocks` (which block of a stack
a value belongs to), `block_replay` (a block's run of a layout laid out as an alike block's was, renamed: what
the direct builders share), `block_layout` (a stack's blocks checked identical
by structure, found where no name says them, cut to the blocks searched),
`recompute` (which values a plan drops after forward
and computes again), `pipeline` (a PCG cut into stages, their schedule
and its simulation),
`validate` (the JSON schemas, their structural checks, a plan's nodes
against the operator library, machines' ranges), `json_files` (reading
user files safely), `collector` (Python's garbage collector paused while a
large graph's objects are built), `hashed` (a PCG's and a graph's hash worked out once and kept:
the search keys its memos by them), `instance` (an operator at concrete shapes), `budget`
(how large a graph may grow, and until when, under the search's limits),
`module_calls` (the calls a user's module makes eagerly beyond its
imported graph, which the torch-native runtime's step pays), `data_forms` (which
inputs are one-hot ids or masks, and the values made of their elements), `errors` (GraphError, MachineError, PlanError, and OptimizeError with
DoesNotFit: the errors every stage shares), `units` (times and bytes as
people read them, in reports and messages alike).

The JSON forms are docs/graph-schema.md and docs/plan-schema.md. Importing
this package imports neither torch, z3 nor egglog.
"""
