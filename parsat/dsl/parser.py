"""Text to `Module`: Lark LALR parse, then a transformer to the frozen AST.

Syntax errors become `DslError` with the position, the source line, a caret
and the tokens that would have been accepted, spelled as they are written.
Comments directly above a declaration become its `doc`; a comment block at
the top of a file separated from the first declaration by a blank line is
the file's header; every other comment is kept in the module's `notes`
(`comments`), so printing the module back drops none.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from fractions import Fraction
from functools import lru_cache
from importlib import resources

from lark import Lark, Token, Transformer, Tree, v_args
from lark.exceptions import UnexpectedCharacters, UnexpectedEOF, UnexpectedInput, UnexpectedToken, VisitError

from parsat.dsl import ast, comments
from parsat.dsl.errors import Diagnostic, DslError
from parsat.dsl.files import FileProblem, max_rule_bytes, read_text_capped

# How each terminal is written, for "expected ..." messages.
_TOKEN_TEXT = {
    "LPAR": "(", "RPAR": ")", "LSQB": "[", "RSQB": "]", "COMMA": ",", "COLON": ":",
    "ARROW": "->", "REWRITE": "=>", "EQEQ": "==", "NE": "!=", "LE": "<=", "GE": ">=",
    "LT": "<", "GT": ">", "EQ": "=", "PLUS": "+", "MINUS": "-", "STAR": "*",
    "SLASH": "/", "PERCENT": "%", "NAME": "a name", "INT": "an integer",
    "FLOAT": "a real number", "STRING": "a quoted path", "$END": "end of file",
}
_KEYWORDS = ("IMPORT", "OP", "RULE", "FORALL", "WHERE", "OUT", "SUM", "MAX_OVER", "IF", "THEN", "ELSE",
             "AND", "OR", "NOT", "LEN", "INT_T", "REAL_T", "DEGREE_T")


def _token_text(name: str) -> str:
    if name in _KEYWORDS:
        return f"'{name.removesuffix('_T').removesuffix('_OVER').lower()}'"
    text = _TOKEN_TEXT.get(name, name)
    return text if text.startswith(("a ", "an ", "end")) else f"'{text}'"


@lru_cache(maxsize=1)
def _lark() -> Lark:
    grammar = resources.files("parsat.dsl").joinpath("grammar.lark").read_text()
    return Lark(grammar, parser="lalr", lexer="basic", propagate_positions=True, maybe_placeholders=False)


def _span(path: str, meta) -> ast.Span:
    return ast.Span(path, meta.line, meta.column, meta.end_line, meta.end_column)


def _tok_span(path: str, tok: Token) -> ast.Span:
    return ast.Span(path, tok.line, tok.column, tok.end_line or tok.line, tok.end_column or tok.column + len(tok))


@dataclass(frozen=True)
class _Semantics:
    """The `out[...] = expr` part of an op, before it joins its OpDecl."""

    out_indices: tuple
    body: object


class _ToAst(Transformer):
    def __init__(self, path: str):
        super().__init__()
        self.path = path

    # --- expressions
    @v_args(meta=True)
    def int_lit(self, meta, items):
        return ast.Num(int(items[0]), _span(self.path, meta))

    @v_args(meta=True)
    def float_lit(self, meta, items):
        text = str(items[0])   # exact: 1e-400 is not 0; a zero is 0 whatever its exponent (0e99999999)
        return ast.Num(Fraction(text) if literal_magnitude(text) is not None else Fraction(0), _span(self.path, meta))

    @v_args(meta=True)
    def name(self, meta, items):
        return ast.Name(str(items[0]), _span(self.path, meta))

    @v_args(meta=True)
    def variadic(self, meta, items):
        return ast.Variadic(str(items[1]), _span(self.path, meta))

    @v_args(meta=True)
    def access(self, meta, items):
        return ast.Access(str(items[0]), tuple(items[1:]), _span(self.path, meta))

    @v_args(meta=True)
    def call(self, meta, items):
        return ast.Call(str(items[0]), tuple(items[1:]), _span(self.path, meta))

    @v_args(meta=True)
    def length(self, meta, items):
        return ast.Len(str(items[1]), _span(self.path, meta))

    @v_args(meta=True)
    def binop(self, meta, items):
        left, op, right = items
        return ast.BinOp(str(op), left, right, _span(self.path, meta))

    @v_args(meta=True)
    def neg(self, meta, items):
        return ast.Neg(items[1], _span(self.path, meta))

    @v_args(meta=True)
    def compare(self, meta, items):
        left, op, right = items
        return ast.Compare(str(op), left, right, _span(self.path, meta))

    @v_args(meta=True)
    def bool_or(self, meta, items):
        return ast.BoolOp("or", items[0], items[2], _span(self.path, meta))

    @v_args(meta=True)
    def bool_and(self, meta, items):
        return ast.BoolOp("and", items[0], items[2], _span(self.path, meta))

    @v_args(meta=True)
    def bool_not(self, meta, items):
        return ast.Not(items[1], _span(self.path, meta))

    @v_args(meta=True)
    def if_expr(self, meta, items):
        _if, test, _then, then, _else, orelse = items
        return ast.IfThenElse(test, then, orelse, _span(self.path, meta))

    @v_args(meta=True)
    def reduction(self, meta, items):
        _sum, var, _lt, bound, body = items
        return ast.Sum(str(var), bound, body, _span(self.path, meta))

    @v_args(meta=True)
    def max_reduction(self, meta, items):
        _max, var, _lt, bound, body = items
        return ast.Max(str(var), bound, body, _span(self.path, meta))

    # --- types and declarations
    @v_args(meta=True)
    def shape(self, meta, items):
        return ast.ShapeType(tuple(items), _span(self.path, meta))

    @v_args(meta=True)
    def scalar_type(self, meta, items):
        return ast.ScalarType(str(items[0]), _span(self.path, meta))

    @v_args(meta=True)
    def param(self, meta, items):
        return ast.Param(str(items[0]), items[1], _span(self.path, meta))

    def where_clause(self, items):
        return tuple(items[1:])

    @v_args(meta=True)
    def index_var(self, meta, items):
        return ast.Name(str(items[0]), _span(self.path, meta))

    def semantics(self, items):
        return _Semantics(tuple(items[1:-2]), items[-1])

    @v_args(meta=True)
    def import_decl(self, meta, items):
        return ast.Import(str(items[1])[1:-1], span=_span(self.path, meta))

    @v_args(meta=True)
    def op_decl(self, meta, items):
        name = str(items[1])
        rest = items[2:]
        arrow = next(i for i, x in enumerate(rest) if isinstance(x, Token) and x.type == "ARROW")
        params = tuple(rest[:arrow])
        result = rest[arrow + 1]
        tail = rest[arrow + 2:]
        where = tail[0] if len(tail) == 2 else ()
        semantics: _Semantics = tail[-1]
        return ast.OpDecl(name, params, result, where, semantics.out_indices, semantics.body,
                          span=_tok_span(self.path, items[1]))

    @v_args(meta=True)
    def rule_decl(self, meta, items):
        name = str(items[1])
        rest = items[3:]  # after RULE NAME FORALL
        arrow = next(i for i, x in enumerate(rest) if isinstance(x, Token) and x.type == "REWRITE")
        lhs, rhs = rest[arrow - 1], rest[arrow + 1]
        head = rest[:arrow - 1]
        where: tuple = ()
        if head and isinstance(head[-1], tuple):
            where, head = head[-1], head[:-1]
        return ast.RuleDecl(name, tuple(head), where, lhs, rhs, span=_tok_span(self.path, items[1]))

    def start(self, items):
        return list(items)


def _syntax_error(path: str, text: str, err: UnexpectedInput) -> DslError:
    line = err.line if err.line and err.line > 0 else max(1, text.count("\n") + 1)
    column = err.column if err.column and err.column > 0 else 1
    lines = text.splitlines()
    if isinstance(err, UnexpectedEOF) or (isinstance(err, UnexpectedToken) and err.token.type == "$END"):
        line = max(1, len(lines))
        column = len(lines[-1]) + 1 if lines else 1
        message = "unexpected end of file"
        expected = getattr(err, "expected", None) or getattr(err, "accepts", None) or set()
    elif isinstance(err, UnexpectedToken):
        message = f"unexpected {_token_text(err.token.type) if err.token.type in _KEYWORDS else repr(str(err.token))}"
        expected = err.accepts or err.expected
    elif isinstance(err, UnexpectedCharacters):
        message = f"unexpected character {text[err.pos_in_stream]!r}" if err.pos_in_stream < len(text) else "unexpected character"
        expected = set()
    else:  # pragma: no cover - lark has no other kinds today
        message, expected = "syntax error", set()
    names = sorted({_token_text(t) for t in expected if not t.startswith("__")})
    if names:
        message += "; expected " + (names[0] if len(names) == 1 else "one of " + ", ".join(names))
    span = ast.Span(path, line, column, line, column + 1)
    source_line = lines[line - 1] if 1 <= line <= len(lines) else ""
    return DslError(Diagnostic("syntax", message, span, source_line))


MAX_NESTING = 120


def _check_nesting(tree: Tree, path: str, text: str) -> None:
    """Refuse trees deeper than MAX_NESTING before anything recurses on them.

    Every later stage (transformer, checker, printer, verifier) walks
    expressions recursively; a bound here keeps them all within Python's
    stack, and no real operator or rule comes close to it.
    """
    stack = [(tree, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_NESTING:
            meta = node.meta
            line, column = (meta.line, meta.column) if not meta.empty else (1, 1)
            lines = text.splitlines()
            span = ast.Span(path, line, column, line, column + 1)
            source_line = lines[line - 1] if 1 <= line <= len(lines) else ""
            raise DslError(Diagnostic("nesting", f"expression nested too deeply (more than {MAX_NESTING} levels)",
                                      span, source_line))
        stack.extend((child, depth + 1) for child in node.children if isinstance(child, Tree))


MAX_LITERAL_DIGITS = 40
MAX_LITERAL_EXPONENT = 300     # every literal below 10**300: each converts to a float (the cost model, numpy)
MIN_LITERAL_EXPONENT = -1000   # every non-zero literal at least 10**-1000: an exact rational of ~1,000 digits


def _check_literals(tree: Tree, path: str, text: str) -> None:
    """Refuse number literals longer than MAX_LITERAL_DIGITS characters, or whose size is outside 10**-1000 to
    10**300, before anything converts them.

    Python refuses to convert integers of more than 4,300 digits (ValueError),
    and a 10**4000 would reach z3 and the cost model as a number no tensor
    has; no size, degree or constant comes near 40 digits. Eleven characters
    say more than 40 digits, though: `1e99999999` made `check` and `verify`
    run past 400 s building a 100-million-digit integer, `1e-999999` hung the
    verifier's exact arithmetic, and `1e999999` ended in Python's 4,300-digit
    ValueError. So the size is read from the text (`literal_magnitude`, no
    conversion) and held to the range; inside it, literals stay exact
    rationals (`1e-400` is not 0)."""
    for token in tree.scan_values(lambda v: isinstance(v, Token) and v.type in ("INT", "FLOAT")):
        magnitude = literal_magnitude(str(token)) if len(token) <= MAX_LITERAL_DIGITS else None
        if len(token) > MAX_LITERAL_DIGITS:
            problem = f"a number of {len(token):,} characters: parsat reads numbers of at most {MAX_LITERAL_DIGITS}"
        elif magnitude is not None and not MIN_LITERAL_EXPONENT <= magnitude < MAX_LITERAL_EXPONENT:
            problem = (f"{token} is {'too large' if magnitude > 0 else 'too small'}: parsat reads numbers from "
                       f"1e{MIN_LITERAL_EXPONENT} to below 1e{MAX_LITERAL_EXPONENT} (and 0)")
        else:
            continue
        lines = text.splitlines()
        source_line = lines[token.line - 1] if 1 <= token.line <= len(lines) else ""
        raise DslError(Diagnostic("literal", problem, _tok_span(path, token), source_line))


def literal_magnitude(text: str) -> int | None:
    """The power of ten of a number literal's leading digit, read from its text without converting it (`1.5e3`:
    3, `0.025`: -2, `120`: 2); None for zero."""
    mantissa, _, exponent = text.lower().partition("e")
    whole, _, fraction = mantissa.partition(".")
    whole = whole.lstrip("0")
    if not whole and not fraction.strip("0"):
        return None
    lead = len(whole) - 1 if whole else -(len(fraction) - len(fraction.lstrip("0")) + 1)
    return lead + int(exponent or 0)


def parse(text: str, path: str = "<string>") -> ast.Module:
    """Parse one file's text. Raises `DslError` on a syntax error."""
    try:
        tree = _lark().parse(text)
    except UnexpectedInput as err:
        raise _syntax_error(path, text, err) from None
    _check_nesting(tree, path, text)
    _check_literals(tree, path, text)
    try:
        decls = _ToAst(path).transform(tree)
    except VisitError as err:  # a bug in the transformer, never user input
        raise err.orig_exc from None
    header, decls, notes = comments.attach(tree, text, decls)
    return ast.Module(path, header, tuple(decls), notes)


def parse_file(path: str) -> ast.Module:
    """Parse a file from disk (read by `files.read_capped`); unreadable files are a `DslError` too."""
    try:
        text = read_text_capped(path, max_rule_bytes(), "rule", "PARSAT_MAX_RULE_BYTES")
    except FileProblem as err:
        raise DslError(Diagnostic("io", str(err), None)) from None
    return parse(text, path)
