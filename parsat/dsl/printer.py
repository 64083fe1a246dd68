"""Canonical source for the AST: `parse(format_module(m)) == m`.

Parentheses are printed only where precedence needs them. The one subtle
case is `sum(l < k) body` (and `max(l < k) body`), whose body extends over
`*`, `/` and `%`: a reduction that ends a left operand of those operators
is parenthesized.
"""

from __future__ import annotations

from fractions import Fraction

from parsat.dsl import ast
from parsat.dsl.comments import render, with_notes

_IF, _OR, _AND, _NOT, _CMP, _ADD, _MUL, _UNARY, _ATOM = range(9)
_BINOP_PREC = {"+": _ADD, "-": _ADD, "*": _MUL, "/": _MUL, "%": _MUL}


def _prec(expr: ast.Expr) -> int:
    if isinstance(expr, ast.IfThenElse):
        return _IF
    if isinstance(expr, ast.BoolOp):
        return _OR if expr.op == "or" else _AND
    if isinstance(expr, ast.Not):
        return _NOT
    if isinstance(expr, ast.Compare):
        return _CMP
    if isinstance(expr, ast.BinOp):
        return _BINOP_PREC[expr.op]
    if isinstance(expr, (ast.Neg,) + ast.RANGE_BINDERS):
        return _UNARY
    return _ATOM


def _open_tail(expr: ast.Expr) -> bool:
    """True when the printed text ends with a `sum` or `max` body that could grow."""
    if isinstance(expr, ast.RANGE_BINDERS):
        return True
    if isinstance(expr, ast.Neg):
        return _open_tail(expr.operand)
    if isinstance(expr, ast.BinOp) and _prec(expr.right) > _BINOP_PREC[expr.op]:
        return _open_tail(expr.right)
    return False


def _number(value: int | float | Fraction) -> str:
    if isinstance(value, int):
        return str(value)
    if isinstance(value, Fraction):
        exact = _decimal(value)
        if exact is not None:
            return exact
    text = repr(float(value))
    return text if ("." in text or "e" in text) else text + ".0"


def _decimal(value: Fraction) -> str | None:
    """The exact decimal text of a Fraction written as a decimal literal (None if it has none)."""
    k, den = 0, value.denominator
    while den % 10 == 0 or den % 2 == 0 or den % 5 == 0:
        if den % 10 == 0:
            den //= 10
        elif den % 2 == 0:
            den //= 2
        else:
            den //= 5
        k += 1
    if den != 1:
        return None
    while (value * 10 ** k).denominator != 1:
        k += 1
    digits = int(value * 10 ** k)
    while k > 0 and digits % 10 == 0:  # fewest digits
        digits //= 10
        k -= 1
    while digits and digits % 10 == 0 and k <= 0:
        digits //= 10
        k -= 1
    sign, digits = ("-" if digits < 0 else ""), abs(digits)
    if k > 20 or k < -15:
        return f"{sign}{digits}e{-k}"
    if k <= 0:
        return f"{sign}{digits * 10 ** -k}.0"
    text = str(digits).rjust(k + 1, "0")
    return f"{sign}{text[:-k]}.{text[-k:]}"


def format_expr(expr: ast.Expr, min_prec: int = _IF) -> str:
    text = _format(expr)
    return f"({text})" if _prec(expr) < min_prec else text


def _format(expr: ast.Expr) -> str:
    if isinstance(expr, ast.Num):
        return _number(expr.value)
    if isinstance(expr, ast.Name):
        return expr.id
    if isinstance(expr, ast.Variadic):
        return f"*{expr.id}"
    if isinstance(expr, ast.Len):
        return f"len({expr.group})"
    if isinstance(expr, ast.Access):
        return f"{expr.tensor}[{', '.join(format_expr(i) for i in expr.indices)}]"
    if isinstance(expr, ast.Call):
        return f"{expr.func}({', '.join(format_expr(a) for a in expr.args)})"
    if isinstance(expr, ast.BinOp):
        prec = _BINOP_PREC[expr.op]
        left = format_expr(expr.left, prec)
        if prec == _MUL and _prec(expr.left) >= prec and _open_tail(expr.left):
            left = f"({left})"
        return f"{left} {expr.op} {format_expr(expr.right, prec + 1)}"
    if isinstance(expr, ast.Neg):
        return f"-{format_expr(expr.operand, _UNARY)}"
    if isinstance(expr, ast.Compare):
        return f"{format_expr(expr.left, _ADD)} {expr.op} {format_expr(expr.right, _ADD)}"
    if isinstance(expr, ast.BoolOp):
        prec = _prec(expr)
        return f"{format_expr(expr.left, prec)} {expr.op} {format_expr(expr.right, prec + 1)}"
    if isinstance(expr, ast.Not):
        return f"not {format_expr(expr.operand, _NOT)}"
    if isinstance(expr, ast.IfThenElse):
        return f"if {format_expr(expr.test, _OR)} then {format_expr(expr.then)} else {format_expr(expr.orelse)}"
    if isinstance(expr, ast.Sum):
        return f"sum({expr.var} < {format_expr(expr.bound, _ADD)}) {format_expr(expr.body, _MUL)}"
    if isinstance(expr, ast.Max):
        return f"max({expr.var} < {format_expr(expr.bound, _ADD)}) {format_expr(expr.body, _MUL)}"
    raise TypeError(f"not an expression: {expr!r}")


def format_type(type_: ast.Type) -> str:
    if isinstance(type_, ast.ScalarType):
        return type_.kind
    return "[" + ", ".join(format_expr(d) for d in type_.dims) + "]"


def format_param(param: ast.Param) -> str:
    return f"{param.name}: {format_type(param.type)}"


def _doc(doc: tuple[str, ...]) -> list[str]:
    return [render(line) for line in doc]


def format_decl(decl: ast.Decl, notes: tuple[ast.LineNotes, ...] = ()) -> str:
    """A declaration with its doc, and with the comments written inside it (`notes`) where they were."""
    return "\n".join(_doc(decl.doc) + with_notes(code_lines(decl), notes))


def code_lines(decl: ast.Decl) -> list[str]:
    """The lines a declaration prints as, comments aside (`comments.printed_lines` says where each came from)."""
    lines: list[str] = []
    if isinstance(decl, ast.Import):
        lines.append(f'import "{decl.path}"')
    elif isinstance(decl, ast.OpDecl):
        params = ", ".join(format_param(p) for p in decl.params)
        lines.append(f"op {decl.name}({params}) -> {format_type(decl.result)}")
        if decl.where:
            lines.append("  where " + ", ".join(format_expr(c) for c in decl.where))
        indices = ", ".join(format_expr(i) for i in decl.out_indices)
        lines.append(f"  out[{indices}] = {format_expr(decl.body)}")
    elif isinstance(decl, ast.RuleDecl):
        lines.append(f"rule {decl.name}:")
        lines.append("  forall " + ", ".join(format_param(b) for b in decl.binders))
        if decl.where:
            lines.append("  where " + ", ".join(format_expr(c) for c in decl.where))
        lines.append(f"  {format_expr(decl.lhs)} => {format_expr(decl.rhs)}")
    else:
        raise TypeError(f"not a declaration: {decl!r}")
    return lines


def format_module(module: ast.Module) -> str:
    """The canonical text of a whole file, every comment included."""
    blocks = []
    if module.header:
        blocks.append("\n".join(_doc(module.header)))
    inner = dict(module.notes.inner)
    for index in range(len(module.items) + 1):
        blocks += ["\n".join(_doc(lines)) for before, lines in module.notes.loose if before == index]
        if index < len(module.items):
            blocks.append(format_decl(module.items[index], inner.get(index, ())))
    return "\n\n".join(blocks) + "\n"
