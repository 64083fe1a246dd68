"""parsat.verifier: every rule proven for all shapes, degrees and ranks, or refuted.

Modules, in the order a rule goes through them:
`ranks` (which rank assignments to search and prove, and whether they
cover every rank), `uniform` (whether a rule uses the lengths of its
groups only as positions, for every length at once), `devices` (the ground truth: a mesh of devices, each
running every operator on the piece it holds), `concrete` (random and
small sizes judged on the devices, shrinking), `prove` (lowering to index
expressions and z3; the only z3 importer), `normal` (the sum-of-products
normal form and the sum lemmas), `crosscheck` (the lowering evaluated
against the devices), `limits` (the work budgets that decide a verdict and
the wall clock that only stops a runaway), `core` (one rule to one
`Verdict`), `verdict` (the
verdict and its evidence), `cache`, `api`
(`verify`), `cli` (`parsat verify`), `coverage` (legal parallelizations no
rule covers), `lifting` (lifted instances replayed on a 2-D mesh), `pieces`
(the degree model's fast piece simulation, for the rule generator).
Rules are proven over the reals: floating-point reassociation is out of
scope. docs/VERIFIER.md says what each verdict promises.
"""
