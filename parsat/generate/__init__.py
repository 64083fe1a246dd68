"""parsat.generate: rule discovery from the operators' semantics (`parsat generate`).

Modules, in the order a rule goes through them:
`enumerate` (small terms over a few operators, fingerprinted by their exact
values, piece by piece, with the verifier's simulator), `candidates` (a
rule from every pair of equal terms, named and canonical), `derivation`
(does a rule set already imply a rule? saturation with `saturate`'s runner),
`generalise` (a proved rule widened to independent sizes and any rank),
`generate` (the whole search: enumerate, prove with `verifier`, widen, prune),
`cli` (`parsat generate`).

Every rule it writes was PROVED by the verifier; results and the runs that
made them are in benchmarks/generate_results.md.
"""
