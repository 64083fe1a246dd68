"""Packaging contracts: light imports, rules shipped as package data."""

from __future__ import annotations

import subprocess
import sys

import parsat


def test_importing_the_dsl_imports_no_heavy_dependency():
    code = ("import sys, parsat, parsat.dsl.checker, parsat.dsl.printer; "
            "print(sorted(m for m in ('torch', 'z3', 'egglog') if any(k.split('.')[0] == m for k in sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_load_rules_without_argument_finds_the_shipped_library():
    library = parsat.load_rules()
    assert "matmul" in library.ops and "softmax" in library.ops
    assert all(path.endswith(".rule") for path in library.files)


def test_operator_library_has_what_models_need():
    ops = parsat.load_rules().ops
    needed = {"matmul", "bmm", "linear", "add", "sub", "mul", "scale", "relu", "gelu", "tanh", "sigmoid", "exp",
              "softmax", "layernorm", "reduce_sum", "mean", "concat", "split", "transpose", "unflatten", "flatten",
              "embedding", "conv2d", "avgpool2d", "dropout", "bias_add"}
    assert needed <= set(ops)
