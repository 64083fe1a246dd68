"""parsat.search: the joint search: saturate on every mesh, extract the cheapest plan, compare the baselines.

Modules, in the order `optimize` uses them: `optimize` (the entry point:
unstaged or pipelined), `request` (the call's inputs resolved once:
`SearchRequest`; one step's: `StepContext`), `inputs` (the graph, device
count and pins, checked), `deadline` (the one time limit every search of
a call shares), `microbatches` (the micro-batch counts the batch needs),
`step` (one step: every mesh, the baselines, the plan), `fit` (what
fits in memory as the plan runs: a pipeline stage's plan as its schedules
run it), `mesh` (one mesh: saturate, price, extract), `solve` (price every e-node,
extract, build the PCG), `extract` (bottom-up, greedy DAG and ILP
extraction), `value_order` (the order of the e-graph's values the ILP's
acyclic sub-e-graph reads), `repeat` (repeated blocks searched once, stamped N times),
`recompute` (activation recomputation priced in the search),
`strategies` (the Megatron-style grid and `--degrees` pins as
restrictions of the e-graph), `baselines` (data parallel, Megatron,
sequential, the best grid point), `pipeline_search` (pipeline degree,
micro-batch count and schedule around the joint search), `provenance`
(the rules a plan needs: a derivation of its e-nodes from the graph's),
`collector` (Python's cyclic garbage collector, paused while a search runs).

It saturates through `parsat.egraph` and prices with `parsat.cost`. It
applies the rules it is given; which are trusted is the facade's choice
(`parsat.api`), so it never imports the verifier.
"""
