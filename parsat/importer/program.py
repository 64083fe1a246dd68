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


def value_on_cpu(program, target: str, values: dict, limit: int):
    """A data node's value made on the CPU, for an import on meta tensors (shapes, no values): the nodes it
    needs run again with each `device` argument the CPU (a causal mask made from positions). None when one of
    them reads a meta tensor of the module's or holds more than `limit` elements (`values`: every node's meta
    value, whose shapes say so before anything runs)."""
    import torch
    import torch.fx

    graph = program.graph
    order = needed_nodes(graph, [target])[target]
    if any(isinstance(values.get(name), torch.Tensor) and values[name].numel() > limit for name in order):
        return None
    by_name = {n.name: n for n in graph.nodes}
    last_read = {i.name: name for name in order for i in by_name[name].all_input_nodes}
    env: dict = {}
    with torch.no_grad():
        for name in order:
            node = by_name[name]
            value = run_node(node, env, program) if node.op in ("placeholder", "get_attr") else \
                node.target(*torch.fx.node.map_arg(node.args, lambda n: env[n.name]),
                            **{k: torch.device("cpu") if k == "device" else v for k, v in
                               torch.fx.node.map_arg(node.kwargs, lambda n: env[n.name]).items()})
            if isinstance(value, torch.Tensor) and value.is_meta:
                return None
            env[name] = value
            for done in [i.name for i in node.all_input_nodes if last_read.get(i.name) == name]:
                env.pop(done, None)    # at a real model's sizes a mask is [batch, 1, s, s]: hold few at once
    return env[target]


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
    """For each target data node: the non-placeholder nodes to evaluate for it, in graph order.

    Its ancestors, and every in-place write into the storage of one of them
    (`writes`, `storage_root`) made before the target's last reader, with
    that write's own ancestors: T5's decoder inputs are labels copied into
    a slice of `new_zeros` by a `copy_` that no node reads, after which the
    embedding reads `new_zeros`; without the write the zeros stay zeros.
    Run in graph order, the target then holds what its last reader reads.
    """
    order = {n.name: i for i, n in enumerate(graph.nodes)}
    by_name = {n.name: n for n in graph.nodes}
    writers = [n for n in graph.nodes if writes(n)]
    out = {}
    for target in targets:
        limit = max([order[target], *(order[u.name] for u in by_name[target].users)])
        seen = ancestors(graph, [target])
        grown = True
        while grown:
            grown = False
            for w in writers:
                if w.name not in seen and order[w.name] < limit and storage_root(w).name in seen:
                    seen |= ancestors(graph, [w.name])
                    grown = True
        out[target] = sorted(seen, key=order.get)
    return out


def ancestors(graph, names: Sequence[str]) -> set[str]:
    """The nodes `names` and every node they read, directly or not."""
    by_name = {n.name: n for n in graph.nodes}
    seen, stack = set(), list(names)
    while stack:
        name = stack.pop()
        if name in seen:
            continue
        seen.add(name)
        stack.extend(n.name for n in by_name[name].all_input_nodes)
    return seen


def writes(node) -> bool:
    """Whether an ATen node writes into its first argument in place (`copy_`, `fill_`, `masked_fill_`)."""
    schema = getattr(node.target, "_schema", None)
    alias = schema.arguments[0].alias_info if schema is not None and schema.arguments else None
    return node.op == "call_function" and alias is not None and alias.is_write


def storage_root(node):
    """The node whose storage a node's first argument is (through views and in-place writes), for a write."""
    import torch.fx

    current = node.args[0] if node.args else None
    while isinstance(current, torch.fx.Node) and current.op == "call_function" and current.args:
        schema = getattr(current.target, "_schema", None)
        if schema is None or not schema.returns or schema.returns[0].alias_info is None:
            break
        current = current.args[0]
    return current if isinstance(current, torch.fx.Node) else node
