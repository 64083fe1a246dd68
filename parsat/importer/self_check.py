"""The import checks itself: the imported graph against the module's own computation, in float64.

A graph that imports but computes something else than the module is worse
than a refusal: it optimizes, trains, and nothing says so (T5, issue 32).
So `import_module` evaluates every graph it makes before anything else
sees it, on the example inputs:

* the module's side is its exported program (the module's own ATen
  operations, as `torch.export` recorded them), run node by node in torch
  on a copy of the module's state: parameters in float64, buffers and
  constants as they are (the user's module is never touched). Its data
  nodes (work on the inputs and buffers alone, which the graph reads as
  data leaves) run in their own types; compute nodes run in float64, their
  data operands cast to it, and casts to another floating type inside them
  (T5's layer norm takes its variance in float32) run in float64 too;
* the graph's side is `torch_ops.evaluate_graph` on the same weights, its
  data leaves fed as the backend feeds them (`ImportedModule.data_values`),
  its dropout masks keeping every element; the module's dropouts keep
  every element too, so both sides scale by 1 / (1 - p);
* both sides are differentiated: a scalar output (the loss) as it is, any
  other output against the same seeded cotangent, and every parameter's
  gradient is compared.

Values agree when every element does: |graph - module| <= ATOL + RTOL *
|module| (`torch.isclose`, infinities equal), RTOL = 1e-6 relative, with
an absolute floor ATOL = 1e-9 for values near zero (a parameter whose true
gradient is zero, such as an attention key bias). The same float64
arithmetic in another order differs by about 1e-13; a mis-mapped operator
by far more. On a difference, `TorchImportError` names the first graph node,
in the graph's order, whose value differs from the exported node it was
made from (the translator's correspondence, `ImportTrace.handles`), with its
ATen operator, module path and source line (`errors.source_line`); where
every forward value agrees, the output or gradient that differs.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from parsat.importer.errors import TorchImportError, aten_name, aten_short, module_path, source_line
from parsat.importer.imported import ImportedModule

RTOL = 1e-6
ATOL = 1e-9


@dataclass(frozen=True)
class ImportTrace:
    """What the translator learnt of the exported program that the check needs.

    `compute`: the exported nodes that depend on a parameter; `handles`:
    exported compute node -> the graph tensor that holds its value.
    """

    compute: frozenset[str]
    handles: Mapping[str, str]

    def renamed(self, renaming: Mapping[str, str]) -> "ImportTrace":
        """The same trace of a graph whose tensors were renamed (`ImportedModule.renamed`)."""
        return ImportTrace(self.compute, {node: renaming.get(t, t) for node, t in self.handles.items()})


@dataclass(frozen=True)
class Difference:
    """One value the graph computes differently from the module: what it is, where it comes from, by how much."""

    what: str             # "graph node 'mul_3' (mul)", "the output", "the gradient of 'w'"
    aten: str = ""        # the exported node it was made from, if known
    module: str = ""
    source: str = ""
    largest: float = 0.0  # the largest |graph - module|
    scale: float = 0.0    # the largest |module|
    shapes: tuple = ()    # (graph shape, module shape) when they differ


def check_import(imported: ImportedModule, inputs: tuple, trace: ImportTrace, model: str) -> None:
    """Raise `TorchImportError` when `imported.graph` does not compute what the module computes (see the module
    docstring); return quietly when it does, or when there is nothing to compute (meta tensors)."""
    if has_meta(imported.program, inputs):
        return
    program = imported.program
    state = module_state(program)
    with runnable(model):
        module_env, _ = run_program(program, imported.user_inputs, inputs, state, trace, keep=False)
        graph_env, weights = run_graph(imported, inputs, state)
        pairs = list(zip((graph_env[o] for o in imported.graph.outputs),
                         (module_env[o] for o in output_names(program))))
        grads = gradients(pairs, weights, state, program)
    summary = outputs_summary(pairs) or grads_summary(grads)
    if not summary:
        return
    with runnable(model):   # again, keeping every node's value this time (only an import about to be refused)
        _, made = run_program(program, imported.user_inputs, inputs, module_state(program), trace, keep=True)
    first = first_node_difference(imported, graph_env, made, trace) or first_value_difference(pairs, grads)
    raise TorchImportError(refusal(model, summary, first))


@contextmanager
def runnable(model: str):
    """Torch's failure to run either side in float64 as a `TorchImportError` the user can act on."""
    try:
        yield
    except TorchImportError:
        raise
    except (RuntimeError, TypeError, ValueError) as err:
        raise TorchImportError(f"{model}: the import's check cannot run the module in float64 "
                               f"({type(err).__name__}: {str(err).strip().splitlines()[0][:300]}); "
                               "import with check=False to skip it") from None


def has_meta(program, inputs: Sequence) -> bool:
    """Whether the module or its inputs are meta tensors (shapes without values: nothing to evaluate)."""
    import torch

    tensors = [*program.state_dict.values(), *program.constants.values(), *inputs]
    return any(isinstance(t, torch.Tensor) and t.is_meta for t in tensors)


def module_state(program) -> dict[str, Any]:
    """Placeholder -> a copy of its parameter (in float64, requiring a gradient where the module trains it: a
    frozen one is data, as the importer takes it), buffer or constant (as it is)."""
    from parsat.importer.program import lifted_value

    params = program.graph_signature.inputs_to_parameters
    state = {}
    for spec in program.graph_signature.input_specs:
        if spec.kind.name == "USER_INPUT":
            continue
        value = lifted_value(program, spec.arg.name)
        trained = spec.arg.name in params and value.requires_grad
        state[spec.arg.name] = as_float64(value.detach()).clone().requires_grad_() if trained \
            else value.detach().clone()
    return state


def as_float64(value):
    """A floating tensor (or each in a tuple or list) in float64; anything else as it is."""
    import torch

    if isinstance(value, torch.Tensor):
        return value.to(torch.float64) if value.is_floating_point() else value
    if isinstance(value, (tuple, list)):
        return type(value)(as_float64(v) for v in value)
    return value


def float64_args(value):
    """Arguments of a node with every floating dtype replaced by float64 (a cast to float32 stays in float64)."""
    import torch

    if isinstance(value, torch.dtype) and value.is_floating_point:
        return torch.float64
    if isinstance(value, (tuple, list)):
        return type(value)(float64_args(v) for v in value)
    if isinstance(value, dict):
        return {k: float64_args(v) for k, v in value.items()}
    return value


def run_program(program, user_inputs: Sequence[str], inputs: tuple, state: Mapping[str, Any], trace: ImportTrace,
                keep: bool) -> tuple[dict[str, Any], dict[str, Any]]:
    """Every exported node's value (compute nodes in float64, data nodes in their own types), and with `keep` a
    copy of each floating compute node's value as it was made: a later in-place write (`scores += bias`)
    changes the live tensor, never what the node computed."""
    import torch
    import torch.fx

    from parsat.importer.program import run_node

    env: dict[str, Any] = {**state, **dict(zip(user_inputs, inputs))}
    made: dict[str, Any] = {}
    for node in program.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        if node.name not in trace.compute:
            with torch.no_grad():
                env[node.name] = run_node(node, env, program)
            continue
        args = float64_args(torch.fx.node.map_arg(node.args, lambda n: as_float64(env[n.name])))
        kwargs = float64_args(torch.fx.node.map_arg(node.kwargs, lambda n: as_float64(env[n.name])))
        env[node.name] = value = run_compute(node, args, kwargs)
        if keep and isinstance(value, torch.Tensor) and value.is_floating_point():
            made[node.name] = value.detach().clone()
    return env, made


def run_compute(node, args: tuple, kwargs: dict):
    """One compute node in torch; dropouts keep every element (as the check's graph masks do), metadata
    assertions (of float32) are skipped."""
    import torch

    name = aten_short(node)
    if name.startswith("_assert"):
        return None
    if name == "dropout":
        x, p, train = (list(args) + [kwargs.get("p", 0.5), kwargs.get("train", True)])[:3]
        return x / (1.0 - p) if train and p else x
    if name == "scaled_dot_product_attention":
        call = dict(zip(("query", "key", "value", "attn_mask", "dropout_p", "is_causal"), args), **kwargs)
        p = float(call.get("dropout_p") or 0.0)
        call["dropout_p"] = 0.0
        out = torch.nn.functional.scaled_dot_product_attention(**call)
        return out / (1.0 - p) if p else out
    return node.target(*args, **kwargs)


def run_graph(imported: ImportedModule, inputs: tuple, state: Mapping[str, Any]) -> tuple[dict, dict]:
    """The graph's every value in float64 on the module's weights (its own copies, for their own gradients), and
    those weights by parameter name."""
    import torch

    from parsat.importer.torch_ops import evaluate_graph

    by_param = {name: state[p] for p, name in imported.program.graph_signature.inputs_to_parameters.items()}
    weights = {imported.weights[leaf.name]: by_param[imported.weights[leaf.name]].detach().clone().requires_grad_()
               for leaf in imported.graph.weights}
    leaves = {leaf: weights[param] for leaf, param in imported.weights.items() if param in weights}
    leaves.update(imported.constant_values(torch.float64))
    leaves.update(imported.data_values(inputs, torch.float64))
    leaves.update({leaf.name: torch.ones(leaf.shape, dtype=torch.float64)
                   for leaf in imported.data.values() if leaf.encoding == "dropout"})
    return evaluate_graph(imported.graph, leaves), weights


def output_names(program) -> list[str]:
    """The exported program's outputs, in order (the graph's outputs are these, one for one)."""
    out = next(n for n in program.graph.nodes if n.op == "output").args[0]
    return [n.name for n in (out if isinstance(out, (tuple, list)) else [out])]


def gradients(pairs: list, weights: Mapping[str, Any], state: Mapping[str, Any], program) -> dict[str, tuple]:
    """Parameter name -> (the graph's gradient, the module's) of the same objective on both sides: each scalar
    output as it is, any other output against a seeded cotangent."""
    import torch

    params = {name: state[p] for p, name in program.graph_signature.inputs_to_parameters.items()
              if state[p].requires_grad}   # the trained ones (`module_state`)
    names = sorted(params)
    graph_side = sum(objective(got, k) for k, (got, _) in enumerate(pairs))
    module_side = sum(objective(want, k) for k, (_, want) in enumerate(pairs))
    graph_grads = dict(zip(weights, differentiate(graph_side, list(weights.values()))))
    module_grads = dict(zip(names, differentiate(module_side, [params[n] for n in names])))
    return {n: (graph_grads.get(n, torch.zeros_like(params[n])), module_grads[n]) for n in names}


def objective(value, k: int):
    """A scalar as it is; any other output summed against the k-th seeded cotangent."""
    import torch

    if value.dim() == 0:
        return value
    cotangent = torch.randn(value.shape, generator=torch.Generator().manual_seed(k), dtype=torch.float64)
    return (value * cotangent).sum()


def differentiate(scalar, tensors: list) -> list:
    """The gradient of `scalar` with respect to each tensor (zeros where it does not depend on it)."""
    import torch

    if not tensors:
        return []
    if not getattr(scalar, "requires_grad", False):
        return [torch.zeros_like(t) for t in tensors]
    got = torch.autograd.grad(scalar, tensors, allow_unused=True)
    return [torch.zeros_like(t) if g is None else g.detach() for t, g in zip(tensors, got)]


def differs(got, want) -> bool:
    """Whether two values differ beyond the check's tolerance (RTOL relative, ATOL absolute, elementwise)."""
    import torch

    if tuple(got.shape) != tuple(want.shape):
        return True
    got, want = got.detach(), want.detach()
    if bool(((got - want).abs() <= ATOL + RTOL * want.abs()).all()):   # finite and close: the usual, fast case
        return False
    return not bool(torch.isclose(got, want, rtol=RTOL, atol=ATOL, equal_nan=True).all())


def measure(what: str, got, want, node=None) -> Difference:
    """The `Difference` of two values (and the exported node they come from, if known)."""
    import torch

    where = dict(aten=aten_name(node), module=module_path(node), source=source_line(node)) if node is not None \
        else {}
    if tuple(got.shape) != tuple(want.shape):
        return Difference(what, shapes=(tuple(got.shape), tuple(want.shape)), **where)
    gap = (got.detach() - want.detach()).abs()
    largest = float(torch.nan_to_num(gap, nan=float("inf")).max()) if gap.numel() else 0.0
    scale = float(want.detach().abs().max()) if want.numel() else 0.0
    return Difference(what, largest=largest, scale=scale, **where)


def outputs_summary(pairs: list) -> str:
    """'' when every output agrees, else what differs (a loss by its two values)."""
    for k, (got, want) in enumerate(pairs):
        if differs(got, want):
            if got.dim() == 0 and want.dim() == 0:
                return f"the loss is {float(got.detach()):.6g} where the module's is {float(want.detach()):.6g}"
            label = "the output" if len(pairs) == 1 else f"output {k}"
            return f"{label} differs from the module's by up to {measure('', got, want).largest:.3g}"
    return ""


def grads_summary(grads: Mapping[str, tuple]) -> str:
    """'' when every parameter's gradient agrees, else how many differ and the first."""
    wrong = [name for name, (got, want) in grads.items() if differs(got, want)]
    if not wrong:
        return ""
    return (f"the outputs agree but {len(wrong)} parameter gradient(s) differ, first '{wrong[0]}'"
            if len(wrong) > 1 else f"the outputs agree but the gradient of '{wrong[0]}' differs")


def first_node_difference(imported: ImportedModule, graph_env: Mapping, made: Mapping,
                          trace: ImportTrace) -> Difference | None:
    """The first graph node, in the graph's order, whose value differs from the exported node it was made from
    (`made`: each floating compute node's value; the first exported node where several map to one graph
    node)."""
    made_from: dict[str, Any] = {}
    for node in imported.program.graph.nodes:
        handle = trace.handles.get(node.name)
        if handle is not None and node.name in made:
            made_from.setdefault(handle, node)
    for gnode in imported.graph.nodes:
        node = made_from.get(gnode.name)
        if node is None:
            continue
        got, want = graph_env[gnode.name], made[node.name]
        if differs(got, want):
            return measure(f"graph node '{gnode.name}' ({gnode.op})", got, want, node)
    return None


def first_value_difference(pairs: list, grads: Mapping[str, tuple]) -> Difference:
    """The first output, else the first parameter gradient, that differs (when no forward node does)."""
    for k, (got, want) in enumerate(pairs):
        if differs(got, want):
            return measure("the output" if len(pairs) == 1 else f"output {k}", got, want)
    name, (got, want) = next((n, p) for n, p in grads.items() if differs(*p))
    return measure(f"the gradient of parameter '{name}'", got, want)


def refusal(model: str, summary: str, first: Difference) -> str:
    """The user's message: what differs, the first value that does and where it comes from."""
    if first.shapes:
        how = f"its shape is {list(first.shapes[0])} where the module's is {list(first.shapes[1])}"
    else:
        how = (f"it differs by up to {first.largest:.3g} where the module's values reach {first.scale:.3g} "
               f"(tolerance: {RTOL:g} relative, {ATOL:g} absolute)")
    origin = ""
    if first.aten:
        where = f"in module '{first.module}'" if first.module else "in the top-level forward"
        origin = f", made from {first.aten} {where}"
    line = f"\n      at {first.source}" if first.source else ""
    return (f"{model}: the imported graph does not compute what the module computes (checked in float64 on the "
            f"example inputs): {summary}.\n  first value that differs: {first.what}{origin}; {how}{line}\n"
            "This is a fault of parsat's importer, not of the module; no plan is made from this graph.")
