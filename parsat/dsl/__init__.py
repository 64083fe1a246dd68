"""parsat.dsl: the `.rule` language, the bottom layer every stage reads (docs/LANGUAGE.md).

Modules, from text to meaning:
`parser` (Lark grammar `rule.lark` to the frozen AST of `ast`), `errors`
(`file:line:col` diagnostics with the line and a caret), `library` (files
and imports to a `Library`), `symbolic` and `conditions` (sizes and side
conditions as polynomials), `instantiate` (an operator at concrete ranks),
`parallel_ops` (the one table of partition, combine, replicate, reduce),
`spread` (the spread analysis: which degrees an operator accepts and
gives), `typecheck` (a rule's two sides typed: shapes and degrees),
`checker` (every diagnostic, `load_checked`, and which rules make new
values: `creates_values`), `check_cache` (libraries that checked clean,
remembered by content), `parse_cache` (parsed files, remembered by content),
`evaluate` (numpy semantics), `work` (FLOPs and bytes of an
operator), `gradient` (the operands an operator passes no gradient to:
read only through `step` or a comparison), `printer` (canonical source), `comments` (every comment's place,
so `fmt` keeps them all), `files` (every file parsat reads or writes: bounded
reads, atomic writes; here because every stage imports the dsl),
`bounds` (every number a user gives a command, with its one bound),
`lifetime` (SIGINT, SIGTERM and SIGHUP end a command and all it started
within a second, leaving no partial file), `cli` (`parsat check`,
`parsat fmt`).

Importing this package imports neither torch, z3 nor egglog.
"""
