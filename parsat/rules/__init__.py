"""parsat.rules: the shipped `.rule` library, installed as package data.

`ops.rule` (operators and their index semantics), `algebraic.rule` and
`parallel.rule` (rewrite rules, every one PROVED by `parsat verify rules/`).
"""

from pathlib import Path

RULES_DIR = Path(__file__).resolve().parent
