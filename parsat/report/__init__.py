"""parsat.report: a plan as people read it: explain text, step timelines, pictures; `parsat explain` and `show`.

It reads a plan's JSON form (docs/plan-schema.md) through the data model
and imports nothing of the search, so presenting a plan never loads
egglog, z3 or torch.

Modules: `cli` (`parsat explain`, `parsat show`).
"""
