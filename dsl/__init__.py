"""The `.rule` language: grammar, parser, AST, checker, printer.

Importing this package imports neither torch, z3 nor egglog.
"""
