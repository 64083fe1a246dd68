"""parsat.verifier: every rule proven for all shapes and degrees, or refuted.

Modules, in the order a rule goes through them:
`concrete` (numpy replay of every device's piece, random search, shrinking),
`prove` (lowering to index expressions and z3; the only z3 importer),
`normal` (the sum-of-products normal form and the sum lemmas),
`core` (one rule to one `Verdict`), `cache`, `api` (`verify`), `cli`
(`parsat verify`), `coverage` (legal parallelizations no rule covers).
Rules are proven over the reals: floating-point reassociation is out of scope.
"""
