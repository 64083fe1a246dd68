"""parsat.report: a plan as people read it: explain text, step timelines, pictures; `parsat explain` and `show`.

It reads a plan's JSON form (docs/plan-schema.md) through the data model
and imports nothing of the search, so presenting a plan never loads
egglog, z3 or torch.

Modules: `explain` (a plan as text, section by section: `explain`,
`explain_plan`, `saturation_stats` for `--stats`), `pipeline` (a
pipelined plan's stages in text, its schedule as lanes and as SVG), `dot`
(the PCG as graphviz DOT), `cli` (`parsat explain`, `parsat show`).
Times and bytes are written by `ir.units`, which error messages of every
stage share.
"""
