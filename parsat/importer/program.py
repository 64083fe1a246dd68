"""Running the nodes of a `torch.export` program on concrete values, in torch.

The import runs the exported graph once on the example inputs, so every
node has a value (`concrete_values`: shapes, and what data folds to); the
data the graph reads as input leaves is recomputed for each batch by
running just the nodes it needs (`needed_nodes`, `run_node`), which is how
`ImportedModule.data_values` feeds shifted labels and masks on every rank.
"""

from __future__ import annotations

from typing import Sequence

from parsat.importer.errors import TorchImportError


def run_node(node, env: dict, program):
    """One ATen node of the exported program on concrete values (data work: no gradient)."""
    import torch.fx

    args = torch.fx.node.map_arg(node.args, lambda n: env[n.name])
    kwargs = torch.fx.node.map_arg(node.kwargs, lambda n: env[n.name])
    if node.op == "get_attr":
        value = program.graph_module
        for part in str(node.target).split("."):
            value = getattr(value, part)
        return value
    if node.op == "placeholder":
        return lifted_value(program, node.name)
    return node.target(*args, **kwargs)


def lifted_value(program, placeholder: str):
    """A lifted parameter, buffer or constant of the exported program, by placeholder name."""
    sig = program.graph_signature
    for spec in sig.input_specs:
        if spec.arg.name == placeholder:
            if spec.target in program.state_dict:
                return program.state_dict[spec.target]
            return program.constants[spec.target]
    raise KeyError(placeholder)


def concrete_values(program, inputs: tuple) -> dict:
    """Every node's value on the example inputs (one eager run of the exported graph, no gradient)."""
    import torch
    import torch.fx

    values: dict = {}
    args = []
    user = iter(inputs)
    for spec in program.graph_signature.input_specs:
        if spec.kind.name == "USER_INPUT":
            args.append(next(user))
        elif spec.target in program.state_dict:
            args.append(program.state_dict[spec.target])
        else:
            args.append(program.constants[spec.target])

    class Recorder(torch.fx.Interpreter):
        def run_node(self, node):
            result = super().run_node(node)
            values[node.name] = result
            return result

    try:
        with torch.no_grad():
            Recorder(program.graph_module).run(*args)
    except Exception as err:  # noqa: BLE001
        raise TorchImportError(f"the exported module does not run on the example inputs: {type(err).__name__}: "
                               f"{err}") from None
    return values


def needed_nodes(graph, targets: Sequence[str]) -> dict[str, list[str]]:
    """For each target data node: the non-placeholder nodes to evaluate for it, in graph order."""
    order = {n.name: i for i, n in enumerate(graph.nodes)}
    by_name = {n.name: n for n in graph.nodes}
    out = {}
    for target in targets:
        seen, stack = set(), [target]
        while stack:
            name = stack.pop()
            if name in seen:
                continue
            seen.add(name)
            stack.extend(n.name for n in by_name[name].all_input_nodes)
        out[target] = sorted(seen, key=order.get)
    return out
