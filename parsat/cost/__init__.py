"""parsat.cost: the cost model and the step simulator: what a PCG's training step takes, on which machine.

It prices; it does not search. Everything here reads the data model
(`parsat.ir`) and the operator library, never the e-graph, so the search,
the baselines and the benchmarks price plans with one model
(docs/COSTMODEL.md).

Modules: `model` (the cost of one PCG node: compute, communication,
memory, `weight_bytes`), `op_time` (an operator's time on its local
pieces: roofline with GEMM and bandwidth efficiency, dispatch cost),
`collectives` (NCCL's algorithms from a group's topology), `simulator`
(tasks on in-order streams: critical path, overlap, memory),
`schedules` (DDP buckets, FSDP prefetch as task generators), `pcg_tasks`
(a plan's step as tasks, per execution profile), `fsdp_groups` (which
weights FSDP2 communicates together, for the torch-native runtime's
profile), `step_report` (a step
simulated and summed up for the plan JSON), `pipeline` (a stage plan cut
into pipeline stages and priced under a schedule), `stage_sync` (a
stage's gradient reductions priced in buckets), `saved` (which values a
training step keeps for backward: those some backward reads, each once),
`ring_time` (ring attention's work per step on its slowest rank: one
price for the simulator and extraction).
"""
