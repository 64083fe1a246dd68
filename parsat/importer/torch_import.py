"""`from_torch(module, example_inputs)`: a torch `nn.Module` as a parsat graph, via `torch.export`.

`torch.export.export(module, inputs, strict=False)` gives the ATen graph of
one forward call with real shapes, every parameter, buffer and constant
lifted to a placeholder, and each node's source line and module path in
`node.meta`. That graph is run once on the example inputs (so every node has
a concrete value) and each node is sorted by what it depends on:

* a node that depends on a parameter is *compute*: it is mapped onto the
  library's operators (`rules/ops.rule`) with `GraphBuilder`, which infers
  and checks every shape again;
* any other node is *data*: integer and boolean work on the inputs (labels
  shifted by one, masks built from `arange`, comparisons and `cumsum`),
  or shape-only constants (rotary tables from a buffer). Data never enters
  the graph as operators: where compute reads it, it becomes a graph input
  leaf, encoded for the operator that reads it (`DataLeaf`): ids one-hot
  over the vocabulary, masks 0/1 over the attention scores, the inverse
  count of cross-entropy's targets. Data that depends only on shapes and
  buffers is folded to a constant once; data that depends on the user's
  inputs is recomputed from each batch by `ImportedModule.data_values`,
  running the same ATen nodes in torch (every rank reads the same batch).

Nothing is dropped silently: every node that cannot be mapped is collected,
and one `TorchImportError` lists them all, each with its ATen operator, the
line of the user's code that made it and the module path; nodes that depend
on a failed node are not reported again.

Weights keep the module's qualified parameter names and layouts (a Linear's
`[out, in]` weight feeds `linear` through a `transpose` node), so a plan's
weights are the module's own tensors and a tied parameter (GPT-2's word
embedding and LM head) stays one weight leaf with two readers.
"""

from __future__ import annotations

import importlib.util
import math
import operator
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from parsat.ir.graph import Graph, GraphBuilder, GraphError, Tensor


class TorchImportError(ValueError):
    """A module parsat cannot import; the message lists every unsupported operator and where it is.

    A ValueError, so that `parsat optimize model.py:factory` reports it like any bad model argument.
    """


@dataclass(frozen=True)
class Unsupported:
    """One node parsat cannot map: the ATen operator, why, the user's source line and the module path."""

    aten: str
    reason: str
    source: str
    module: str

    def __str__(self) -> str:
        where = f"in module '{self.module}'" if self.module else "in the top-level forward"
        line = f"\n      at {self.source}" if self.source else ""
        return f"  - {self.aten} {where}: {self.reason}{line}"


class _Refused(Exception):
    """Raised inside the mapping of one node; becomes an `Unsupported` entry."""


@dataclass(frozen=True)
class DataLeaf:
    """A graph input leaf and how to make its value from the data node it encodes.

    `encoding`: "value" (the tensor as it is, in the compute dtype, expanded
    to `shape`), "onehot" (integer ids -> one-hot rows over `classes`; an id
    outside [0, classes) or equal to `ignore` gives a zero row), "mask"
    (boolean or 0/-inf attention mask -> 0/1, expanded to `shape`),
    "inv_count" (1 / the number of targets that are not ignored), or "dropout"
    (a fresh 0/1 mask each step, 1 with probability 1 - `rate`: see
    `dropout_mask`; `node` is the dropout's own node).
    """

    name: str
    node: str
    encoding: str
    shape: tuple[int, ...]
    classes: int = 0
    ignore: int | None = None
    constant: bool = False
    rate: float = 0.0


@dataclass(frozen=True)
class RunningStats:
    """One batch normalization in training mode whose module keeps running statistics.

    torch updates them in forward, in place: `running_mean = (1 - momentum)
    * running_mean + momentum * mean` and the same for `running_var` with the
    unbiased batch variance (`var * count / (count - 1)`), and adds 1 to
    `num_batches_tracked`. The graph computes `mean` and `var` (the biased
    variance over `count` = N*H*W elements per channel) as nodes of its own;
    `parallelize` reads them after each training forward and applies the
    same update to the module's buffers (`backend.running_stats`).
    """

    mean: str                 # graph node: the batch mean per channel
    var: str                  # graph node: the biased batch variance per channel
    count: int                # elements per channel in the batch (N * H * W)
    momentum: float
    running_mean: str         # buffer names in the module
    running_var: str
    batches_tracked: str | None


# ------------------------------------------------------------------ the result


@dataclass
class ImportedModule:
    """A module's graph and everything needed to feed it: the result of `import_module`.

    Holds torch objects (the exported program), so it lives in `backend/`
    only; `graph` is what the optimizer sees.
    """

    graph: Graph
    program: Any                           # torch.export.ExportedProgram
    weights: dict[str, str]                # graph weight leaf -> module parameter name (the same name)
    data: dict[str, DataLeaf]              # graph input leaf -> its encoding
    constants: dict[str, Any]              # graph input leaf -> its value, for leaves that are constant
    dropout: tuple[str, ...]               # dropout mask leaves, in the order the module draws them
    user_inputs: tuple[str, ...]           # placeholder names of the user's inputs, in call order
    output_spec: Any = None                # pytree spec of the module's outputs
    _needed: dict = field(default_factory=dict, repr=False)  # data node -> nodes to evaluate, in order
    running_stats: tuple[RunningStats, ...] = ()  # batch norms in training mode with running statistics

    def data_values(self, inputs: Sequence[Any], dtype, seed: int = 0, step: int = 0) -> dict[str, Any]:
        """Every non-constant data leaf's value (full tensor) for one batch of the user's inputs; dropout
        masks are those of `step` under `seed`."""
        import torch

        if len(inputs) != len(self.user_inputs):
            raise TorchImportError(f"the module takes {len(self.user_inputs)} input(s), got {len(inputs)}")
        env: dict[str, Any] = dict(zip(self.user_inputs, inputs))
        nodes = {n.name: n for n in self.program.graph.nodes}
        out: dict[str, Any] = {}
        with torch.no_grad():
            for leaf in self.data.values():
                if leaf.constant:
                    continue
                if leaf.encoding == "dropout":
                    out[leaf.name] = dropout_mask(seed, leaf.name, step, leaf.shape, leaf.rate, dtype)
                    continue
                for name in self._needed[leaf.node]:
                    if name not in env:
                        env[name] = _run_node(nodes[name], env, self.program)
                out[leaf.name] = encode(leaf, env[leaf.node], dtype)
        return out

    def constant_values(self, dtype) -> dict[str, Any]:
        """Every constant data leaf's value in `dtype`."""
        return {name: value.to(dtype) for name, value in self.constants.items()}


def dropout_mask(seed: int, name: str, step: int, shape: Sequence[int], rate: float, dtype):
    """The 0/1 mask of dropout leaf `name` at `step` (1 with probability 1 - rate): the same on every rank."""
    import torch
    import zlib

    gen = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode()) * 7919 + step * 104729)
                                        % 2**62)
    return (torch.rand(tuple(shape), generator=gen, dtype=torch.float64) >= rate).to(dtype)


def encode(leaf: DataLeaf, value, dtype):
    """The value of a data leaf from its data node's value (see `DataLeaf`)."""
    import torch

    value = torch.as_tensor(value)
    if leaf.encoding == "value":
        return value.to(dtype).expand(leaf.shape).contiguous()
    if leaf.encoding == "mask":
        if value.dtype == torch.bool:
            keep = value
        else:
            finite = value[torch.isfinite(value)]
            low = torch.finfo(value.dtype).min if value.is_floating_point() else None
            if not bool(((finite == 0) | (finite == low)).all()):
                raise TorchImportError(f"attention mask '{leaf.node}' has values other than 0 and -inf; parsat "
                                       "supports boolean and 0/-inf masks")
            keep = value == 0
        return keep.to(dtype).expand(leaf.shape).contiguous()
    ids = value.long()
    valid = (ids >= 0) & (ids < leaf.classes)
    if leaf.ignore is not None:
        valid &= ids != leaf.ignore
    if leaf.encoding == "inv_count":
        return (1.0 / valid.sum().to(dtype)).reshape(())
    onehot = torch.nn.functional.one_hot(torch.where(valid, ids, 0), leaf.classes).to(dtype)
    return (onehot * valid.unsqueeze(-1).to(dtype)).contiguous()


def _run_node(node, env: dict, program):
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
        return _lifted_value(program, node.name)
    return node.target(*args, **kwargs)


def _lifted_value(program, placeholder: str):
    """A lifted parameter, buffer or constant of the exported program, by placeholder name."""
    sig = program.graph_signature
    for spec in sig.input_specs:
        if spec.arg.name == placeholder:
            if spec.target in program.state_dict:
                return program.state_dict[spec.target]
            return program.constants[spec.target]
    raise KeyError(placeholder)


# ------------------------------------------------------------------ entry points


def from_torch(module, example_inputs, library=None, name: str | None = None) -> Graph:
    """The parsat graph of `module` applied to `example_inputs` (a tensor or a tuple of them).

    Raises `TorchImportError` listing every operator parsat cannot express.
    """
    return import_module(module, example_inputs, library, name).graph


def export_module(module, inputs: tuple):
    """`torch.export` of `module` on `inputs` (non-strict), any failure as a `TorchImportError`."""
    import torch

    try:
        return torch.export.export(module, inputs, strict=False)
    except Exception as err:  # noqa: BLE001 - export raises many kinds; the user needs the reason, not a trace
        first = str(err).strip().splitlines()[0] if str(err).strip() else ""
        raise TorchImportError(f"torch.export cannot trace {type(module).__name__}: {type(err).__name__}: "
                               f"{first[:400]}") from None


def import_module(module, example_inputs, library=None, name: str | None = None) -> ImportedModule:
    """Export `module`, sort its nodes into compute and data, and map the compute onto library operators."""
    import torch

    inputs = tuple(example_inputs) if isinstance(example_inputs, (tuple, list)) else (example_inputs,)
    if not all(isinstance(t, torch.Tensor) for t in inputs):
        raise TorchImportError("example inputs must be tensors (a tensor or a tuple of tensors)")
    for path, sub in module.named_modules():  # torch.export itself fails on these, with a cryptic message
        if isinstance(sub, torch.nn.modules.batchnorm._BatchNorm) and sub.training and sub.track_running_stats \
                and sub.momentum is None:
            raise TorchImportError(f"{type(module).__name__}: batch norm '{path}' has momentum=None (a cumulative "
                                   "average of its running statistics), which parsat does not support; give it a "
                                   "momentum")
    was_training = module.training
    # Exporting and running the exported graph once executes the module's forward, and a batch norm in
    # training mode updates its running statistics in place: the import must leave the module as it was.
    buffers = {name: b.detach().clone() for name, b in module.named_buffers()}
    try:
        program = export_module(module, inputs)
        module.train(was_training)
        translator = _Translator(module, program, inputs, GraphBuilder(library, name=name or type(module).__name__))
        return translator.run()
    finally:
        with torch.no_grad():
            for name, b in module.named_buffers():
                if name in buffers:
                    b.copy_(buffers[name])


# ------------------------------------------------------------------ the translator


_IDENTITY = {"clone", "contiguous", "alias", "detach_", "lift_fresh_copy", "_to_copy", "to", "type_as"}
_UNARY = {"relu": "relu", "tanh": "tanh", "sigmoid": "sigmoid", "exp": "exp", "neg": "neg", "rsqrt": "rsqrt",
          "sqrt": "sqrt", "silu": "silu", "sin": "sin", "cos": "cos", "log": "log", "reciprocal": "reciprocal"}


class _Translator:
    """Walks the exported graph once, node by node, building the parsat graph."""

    def __init__(self, module, program, inputs: tuple, builder: GraphBuilder):
        import torch

        self.torch = torch
        self.module = module
        self.program = program
        self.g = builder
        sig = program.graph_signature
        self.params = dict(sig.inputs_to_parameters)          # placeholder -> parameter name
        self.user_inputs = [s.arg.name for s in sig.input_specs if s.kind.name == "USER_INPUT"]
        self.values = _concrete_values(program, inputs)
        self.compute: set = set()        # node names that depend on a parameter
        self.varying: set = set()        # node names that depend on a user input
        self.env: dict = {}              # compute node name -> Tensor handle (or a list of them)
        self.failed: dict = {}           # node name -> Unsupported (the first failure on a path)
        self.weights: dict[str, Tensor] = {}
        self.transposed: dict[str, Tensor] = {}
        self.data: dict[tuple, DataLeaf] = {}
        self.constants: dict[str, Any] = {}
        self.dropout: list[str] = []
        self.running_stats: list[RunningStats] = []
        self.buffers = dict(sig.inputs_to_buffers)            # placeholder -> buffer name
        self.names: set[str] = set()
        self.node = None

    # -- helpers ---------------------------------------------------------
    def fresh(self, base: str) -> str:
        name, index = base, 1
        while name in self.names:
            index += 1
            name = f"{base}_{index}"
        self.names.add(name)
        return name

    def op(self, kind: str, *args, tag: str = "", **attrs) -> Tensor:
        try:
            return self.g.op(kind, *args, name=self.fresh(self.node.name + (f"_{tag}" if tag else "")), **attrs)
        except GraphError as err:
            raise _Refused(str(err)) from None

    def shape(self, t: Tensor) -> tuple[int, ...]:
        return self.g.shape(t)

    def dim(self, t_or_rank, d: int) -> int:
        rank = t_or_rank if isinstance(t_or_rank, int) else len(self.shape(t_or_rank))
        if not -rank <= d < max(rank, 1):
            raise _Refused(f"dim {d} is out of range for a tensor of rank {rank}")
        return d % rank if rank else 0

    def is_compute(self, value) -> bool:
        return isinstance(value, self.torch.fx.Node) and value.name in self.compute

    def tensor(self, value) -> Tensor:
        """A compute operand as a graph tensor; data operands become input leaves (their value as it is)."""
        if isinstance(value, Tensor):
            return value
        if self.is_compute(value):
            got = self.env[value.name]
            if not isinstance(got, Tensor):
                raise _Refused("a list of tensors is used where a tensor is expected")
            return got
        if isinstance(value, self.torch.fx.Node) and isinstance(self.values.get(value.name), self.torch.Tensor):
            return self.data_leaf(value, "value", tuple(self.values[value.name].shape))
        raise _Refused(f"expected a tensor, got the constant {value!r}")

    def scalar(self, value) -> float | None:
        """A Python number, or a constant one-element data tensor, as a float; None for anything else."""
        if isinstance(value, bool):
            return float(value)
        if isinstance(value, (int, float)):
            return float(value)
        if isinstance(value, self.torch.fx.Node) and not self.is_compute(value) and value.name not in self.varying:
            v = self.values.get(value.name)
            if isinstance(v, (int, float)):
                return float(v)
            if isinstance(v, self.torch.Tensor) and v.numel() == 1 and v.dim() == 0:
                return float(v)
        return None

    def weight(self, placeholder: str) -> Tensor:
        name = self.params[placeholder]
        if name not in self.weights:
            shape = tuple(self.values[placeholder].shape)
            self.names.add(name)
            try:
                self.weights[name] = self.g.weight(name, shape)
            except GraphError as err:
                raise _Refused(str(err)) from None
        return self.weights[name]

    def weight_t(self, value) -> Tensor:
        """The transpose of a 2-D operand (a Linear's [out, in] weight read as [in, out]), made once per weight."""
        t = self.tensor(value)
        if len(self.shape(t)) != 2:
            raise _Refused(f"expected a 2-D weight, got shape {list(self.shape(t))}")
        if t.name not in self.transposed:
            self.transposed[t.name] = self.op("transpose", t, d0=0, d1=1, tag="t")
        return self.transposed[t.name]

    def dropout_leaf(self, node, tag: str, shape: tuple[int, ...], rate: float) -> Tensor:
        """A fresh dropout mask leaf for one dropout of the module (in the order the module draws them)."""
        name = self.fresh(f"{node.name}{tag}_mask")
        self.data[(name,)] = DataLeaf(name, node.name, "dropout", tuple(shape), rate=float(rate))
        self.dropout.append(name)
        try:
            self.g.input(name, shape)
        except GraphError as err:
            raise _Refused(str(err)) from None
        return Tensor(name)

    def data_leaf(self, node, encoding: str, shape: tuple[int, ...], classes: int = 0,
                  ignore: int | None = None) -> Tensor:
        """The input leaf of a data node in an encoding (one leaf per node, encoding and shape)."""
        key = (node.name, encoding, shape, classes, ignore)
        if key not in self.data:
            suffix = "" if encoding == "value" and tuple(self.values[node.name].shape) == shape else f"_{encoding}"
            base = node.name if not suffix else node.name + suffix
            name = self.fresh(base)
            constant = node.name not in self.varying
            leaf = DataLeaf(name, node.name, encoding, tuple(shape), classes, ignore, constant)
            if constant:
                self.constants[name] = encode(leaf, self.values[node.name], self.torch.float64)
            try:
                self.g.input(name, shape)
            except GraphError as err:
                raise _Refused(str(err)) from None
            self.data[key] = leaf
        return Tensor(self.data[key].name)

    def running_statistics(self, node, mean: Tensor, var: Tensor, count: int, running_mean, running_var,
                           momentum) -> None:
        """Record a training-mode batch norm's running statistics (`RunningStats`), or refuse what the update
        cannot reproduce."""
        names = [self.buffers.get(b.name) if isinstance(b, self.torch.fx.Node) else None
                 for b in (running_mean, running_var)]
        if None in names:
            raise _Refused("batch_norm in training mode whose running statistics are not buffers of the module")
        owner = names[0].rpartition(".")[0]
        if count < 2:
            raise _Refused("batch_norm in training mode over one element per channel (torch refuses it too)")
        tracked = f"{owner}.num_batches_tracked" if owner else "num_batches_tracked"
        has_tracked = tracked in dict(self.module.named_buffers())
        self.running_stats.append(RunningStats(mean.name, var.name, int(count), float(momentum), names[0], names[1],
                                               tracked if has_tracked else None))

    # -- the walk --------------------------------------------------------
    def run(self) -> ImportedModule:
        torch = self.torch
        graph = self.program.graph
        for node in graph.nodes:
            self.node = node
            if node.op == "placeholder":
                if node.name in self.params:
                    self.compute.add(node.name)
                    self.env[node.name] = _LazyWeight(node.name)
                elif node.name in self.user_inputs:
                    self.varying.add(node.name)
                continue
            if node.op in ("output", "get_attr"):
                continue
            inputs = node.all_input_nodes
            if any(n.name in self.varying for n in inputs):
                self.varying.add(node.name)
            if any(n.name in self.failed for n in inputs):
                self.failed[node.name] = self.failed[next(n.name for n in inputs if n.name in self.failed)]
                self.compute.add(node.name)
                continue
            if not any(n.name in self.compute for n in inputs):
                continue  # data: computed from inputs and constants, in torch
            self.compute.add(node.name)
            try:
                self.env[node.name] = self._map(node)
            except _Refused as err:
                self.failed[node.name] = Unsupported(_aten_name(node), str(err), _source_line(node),
                                                     _module_path(node))
        outputs = self._outputs(graph)
        failures = list(dict.fromkeys(self.failed.values()))
        if failures:
            raise TorchImportError(f"{type(self.module).__name__}: {len(failures)} operator(s) parsat cannot "
                                   "import:\n" + "\n".join(str(f) for f in failures))
        built = _pruned(self.g, outputs)
        live = {n.name for n in built.nodes}
        data = {leaf.name: leaf for leaf in self.data.values() if built.leaf(leaf.name) is not None}
        needed = _needed_nodes(graph, [leaf.node for leaf in data.values()
                                       if not leaf.constant and leaf.encoding != "dropout"])
        dropout = tuple(self.dropout)
        weights = {leaf.name: leaf.name for leaf in built.weights}
        return ImportedModule(built, self.program, weights, data,
                              {k: v for k, v in self.constants.items() if k in data},
                              dropout,
                              tuple(self.user_inputs), self.program.call_spec.out_spec, needed,
                              tuple(s for s in self.running_stats if s.mean in live and s.var in live))

    def _outputs(self, graph) -> list[str]:
        out_node = next(n for n in graph.nodes if n.op == "output")
        outs = out_node.args[0]
        outs = list(outs) if isinstance(outs, (tuple, list)) else [outs]
        specs = self.program.graph_signature.output_specs
        names = []
        for spec, value in zip(specs, outs):
            if spec.kind.name != "USER_OUTPUT":
                raise TorchImportError(f"{type(self.module).__name__} mutates its buffers or inputs in forward "
                                       f"({spec.kind.name.lower()} '{spec.target}'); parsat imports pure forwards")
            if isinstance(value, self.torch.fx.Node) and value.name in self.failed:
                continue
            if not self.is_compute(value):
                raise TorchImportError(f"{type(self.module).__name__} returns '{getattr(value, 'name', value)}', "
                                       "which does not depend on any parameter; return the loss or a tensor "
                                       "computed from the weights")
            self.node = value
            handle = self.env[value.name]
            if isinstance(handle, _LazyWeight):
                handle = self.weight(handle.placeholder)
            names.append(handle.name)
        return names

    def _map(self, node):
        """The graph tensor(s) of one compute node; _Refused for what parsat cannot express."""
        target = node.target
        for i, a in enumerate(node.all_input_nodes):  # materialise weight leaves on first use
            got = self.env.get(a.name)
            if isinstance(got, _LazyWeight):
                self.env[a.name] = self.weight(got.placeholder)
        if target is operator.getitem:
            seq, index = node.args
            items = self.env[seq.name]
            if not isinstance(items, list):
                raise _Refused("indexing a tensor with [] is not supported")
            return items[index]
        name = _aten_short(node)
        handler = _HANDLERS.get(name)
        if handler is None:
            raise _Refused("unsupported operator")
        return handler(self, node, *node.args, **node.kwargs)

    # -- arithmetic with broadcasting ----------------------------------------
    def binary(self, kind: str, x, y) -> Tensor:
        """x (+ or *) y with torch's broadcasting, by the cheapest exact form."""
        xs, ys = self.scalar(x), self.scalar(y)
        if xs is not None and ys is not None:
            raise _Refused("arithmetic on two constants")
        if ys is not None or xs is not None:
            t, c = (self.tensor(x), ys) if ys is not None else (self.tensor(y), xs)
            if kind == "add":
                return t if c == 0 else self.op("add_scalar", t, c=c)
            return t if c == 1 else self.op("scale", t, c=c)
        return self.binary_handles(kind, self.tensor(x), self.tensor(y))

    def data_leaf_const(self, node, what: str, shape, value) -> Tensor:
        """A constant data leaf made here (ones and zeros for missing affine parameters, a causal mask)."""
        torch = self.torch
        key = (node.name, what, tuple(shape), 0, None)
        if key not in self.data:
            name = self.fresh(f"{node.name}_{what}")
            if what == "causal":
                s, k = shape[-2], shape[-1]
                tensor = torch.ones(s, k, dtype=torch.float64).tril(diagonal=k - s).expand(shape).contiguous()
            else:
                tensor = torch.full(tuple(shape), float(value), dtype=torch.float64)
            leaf = DataLeaf(name, node.name, "value", tuple(shape), constant=True)
            self.constants[name] = tensor
            self.g.input(name, shape)
            self.data[key] = leaf
        return Tensor(self.data[key].name)

    def binary_handles(self, kind: str, a: Tensor, b: Tensor) -> Tensor:
        """x (+ or *) y of two graph tensors with torch's broadcasting."""
        sa, sb = self.shape(a), self.shape(b)
        if sa == sb:
            return self.op(kind, a, b)
        out = _broadcast_shape(sa, sb)
        if out is None:
            raise _Refused(f"shapes {list(sa)} and {list(sb)} do not broadcast")
        if sa != out and sb == out:
            a, b = b, a
        elif sa != out:
            a = self.expand_to(a, out)
        return self.broadcast_into(kind, a, b, out)

    def broadcast_into(self, kind: str, big: Tensor, small: Tensor, out: tuple[int, ...]) -> Tensor:
        ss = self.shape(small)
        padded = (1,) * (len(out) - len(ss)) + tuple(ss)
        lead = 0
        while lead < len(out) and padded[lead] == 1 and out[lead] != 1:
            lead += 1
        rest = padded[lead:]
        if tuple(rest) == tuple(out[lead:]):
            if rest == tuple(ss):
                return self.op(f"{kind}_bcast", big, small)
            return self.op(f"{kind}_bcast", big, self.reshape(small, rest))
        differ = [d for d in range(len(out)) if padded[d] != out[d]]
        if len(differ) == 1 and len(ss) == len(out):
            d = differ[0]
            squeezed = self.reshape(small, tuple(s for k, s in enumerate(ss) if k != d))
            return self.op(f"{kind}_bcast_dim", big, squeezed, dim=d)
        return self.op(kind, big, self.expand_to(small, out))

    def expand_to(self, t: Tensor, out: Sequence[int]) -> Tensor:
        """`t` broadcast to shape `out` with `broadcast` operators (one per expanded dim)."""
        shape = list(self.shape(t))
        shape = [1] * (len(out) - len(shape)) + shape
        if len(shape) != len(self.shape(t)):
            if not self.shape(t):
                raise _Refused("broadcasting a 0-d tensor computed from the weights is not supported")
            t = self.reshape(t, tuple(shape))
        for d, (have, want) in enumerate(zip(shape, out)):
            if have == want:
                continue
            if have != 1:
                raise _Refused(f"cannot expand {shape} to {list(out)}")
            t = self.reshape(t, tuple(shape[:d] + shape[d + 1:]))
            t = self.op("broadcast", t, dim=d, n=int(want), tag="expand")
            shape[d] = int(want)
        return t

    # -- shapes -------------------------------------------------------------
    def reshape(self, x: Tensor, shape: Sequence[int]) -> Tensor:
        """A reshape as `flatten`s and `unflatten`s of consecutive groups of dims with equal products."""
        src = list(self.shape(x))
        total = math.prod(src)
        dst = [int(d) for d in shape]
        if dst.count(-1) == 1:
            known = math.prod(d for d in dst if d != -1)
            dst[dst.index(-1)] = total // known if known else 0
        if math.prod(dst) != total or any(d < 1 for d in dst):
            raise _Refused(f"cannot reshape {src} to {list(shape)}")
        if src == dst:
            return x
        if not src or not dst:
            raise _Refused(f"reshape between a 0-d tensor and {src or dst} is not supported")
        groups = _reshape_groups(src, dst)
        if groups is None:
            raise _Refused(f"reshape of {src} to {dst} is not a split or merge of neighbouring dims")
        pos = 0
        for n_in, outs in groups:
            for _ in range(n_in - 1):
                x = self.op("flatten", x, dim=pos, tag="merge")
            for i in range(len(outs) - 1):
                x = self.op("unflatten", x, dim=pos + i, k=math.prod(outs[i + 1:]), tag="split")
            pos += len(outs)
        return x

    def transpose(self, x: Tensor, d0: int, d1: int) -> Tensor:
        a, b = sorted((self.dim(x, d0), self.dim(x, d1)))
        return x if a == b else self.op("transpose", x, d0=a, d1=b)

    def permute(self, x: Tensor, dims: Sequence[int]) -> Tensor:
        target = [self.dim(x, d) for d in dims]
        if sorted(target) != list(range(len(self.shape(x)))):
            raise _Refused(f"permute{tuple(dims)} is not a permutation of the dims")
        current = list(range(len(target)))
        for i, want in enumerate(target):
            j = current.index(want)
            if j != i:
                x = self.op("transpose", x, d0=i, d1=j, tag="perm")
                current[i], current[j] = current[j], current[i]
        return x

    def reduce(self, kind: str, x: Tensor, dims, keepdim: bool) -> Tensor:
        shape = self.shape(x)
        if dims is None or (isinstance(dims, (list, tuple)) and len(dims) == 0):
            dims = list(range(len(shape)))
        dims = dims if isinstance(dims, (tuple, list)) else [dims]
        dims = sorted({self.dim(x, d) for d in dims}, reverse=True)
        if kind == "mean" and dims == [3, 2] and len(shape) == 4 and not keepdim:
            return self.op("global_avgpool", x)
        out = x
        for d in dims:
            out = self.op(kind, out, dim=d)
        if keepdim:
            out = self.reshape(out, tuple(1 if d in dims else s for d, s in enumerate(shape)))
        return out


@dataclass(frozen=True)
class _LazyWeight:
    """A parameter placeholder whose weight leaf is made when a compute node first reads it."""

    placeholder: str


# ------------------------------------------------------------------ handlers


def _h_identity(t: _Translator, node, x, *rest, **kwargs):
    dtype = kwargs.get("dtype")
    if dtype is not None and not dtype.is_floating_point:
        raise _Refused(f"a cast of a weight-dependent tensor to {dtype} is not differentiable")
    return t.tensor(x)


def _h_assert(t: _Translator, node, *args, **kwargs):
    return None


def _h_unary(t: _Translator, node, x, *rest, **kwargs):
    return t.op(_UNARY[_aten_short(node)], t.tensor(x))


def _h_gelu(t: _Translator, node, x, approximate="none"):
    return t.op("gelu" if approximate == "none" else "gelu_tanh", t.tensor(x))


def _h_add(t: _Translator, node, x, y, alpha=1):
    if alpha != 1:
        y_s = t.scalar(y)
        if y_s is None:
            raise _Refused("add with alpha other than 1 is not supported")
        y = y_s * alpha
    return t.binary("add", x, y)


def _h_sub(t: _Translator, node, x, y, alpha=1):
    if alpha != 1:
        raise _Refused("sub with alpha other than 1 is not supported")
    ys, xs = t.scalar(y), t.scalar(x)
    if ys is not None:
        return t.binary("add", x, -ys)
    if xs is not None:
        return t.binary("add", t.op("neg", t.tensor(y)), xs)
    a, b = t.tensor(x), t.tensor(y)
    if t.shape(a) == t.shape(b):
        return t.op("sub", a, b)
    return t.binary_handles("add", a, t.op("neg", b))


def _h_rsub(t: _Translator, node, x, y, alpha=1):
    return _h_sub(t, node, y, x, alpha)


def _h_mul(t: _Translator, node, x, y):
    return t.binary("mul", x, y)


def _h_div(t: _Translator, node, x, y, rounding_mode=None):
    if rounding_mode is not None:
        raise _Refused("division with rounding is not differentiable")
    ys, xs = t.scalar(y), t.scalar(x)
    if ys is not None:
        if ys == 0:
            raise _Refused("division by the constant 0")
        return t.binary("mul", x, 1.0 / ys)
    if xs is not None:
        return t.binary("mul", t.op("reciprocal", t.tensor(y)), xs)
    a, b = t.tensor(x), t.tensor(y)
    if t.shape(a) == t.shape(b):
        return t.op("div", a, b)
    return t.binary_handles("mul", a, t.op("reciprocal", b))


def _h_pow(t: _Translator, node, x, exponent):
    e = t.scalar(exponent)
    if e is None:
        raise _Refused("pow with a tensor exponent is not supported")
    a = t.tensor(x)
    if e == 1:
        return a
    if e == 2:
        return t.op("mul", a, a)
    if e == 3:
        return t.op("mul", t.op("mul", a, a, tag="sq"), a)
    if e == 0.5:
        return t.op("sqrt", a)
    if e == -0.5:
        return t.op("rsqrt", a)
    if e == -1:
        return t.op("reciprocal", a)
    raise _Refused(f"pow with exponent {e:g} (parsat maps 1, 2, 3, 0.5, -0.5 and -1)")


def _h_linear(t: _Translator, node, x, w, b=None):
    a = t.tensor(x)
    wt = t.weight_t(w)
    if b is None:
        return t.op("linear_nobias", a, wt)
    return t.op("linear", a, wt, t.tensor(b))


def _h_addmm(t: _Translator, node, bias, x, w, beta=1, alpha=1):
    if beta != 1 or alpha != 1:
        raise _Refused("addmm with beta or alpha other than 1 is not supported")
    return t.op("linear", t.tensor(x), t.tensor(w), t.tensor(bias))


def _h_matmul(t: _Translator, node, x, y):
    a, b = t.tensor(x), t.tensor(y)
    sa, sb = t.shape(a), t.shape(b)
    if len(sa) == 2 and len(sb) == 2:
        return t.op("matmul", a, b)
    if len(sb) == 2 and len(sa) > 2:
        return t.op("linear_nobias", a, b)
    if len(sa) == len(sb) and sa[:-2] == sb[:-2]:
        return t.op("bmm", a, b)
    raise _Refused(f"matmul of shapes {list(sa)} and {list(sb)} (parsat maps 2-D, batched with equal batch "
                   "dims, and [..., k] @ [k, n])")


def _h_embedding(t: _Translator, node, weight, ids, padding_idx=-1, scale_grad_by_freq=False, sparse=False):
    if scale_grad_by_freq or sparse:
        raise _Refused("embedding with scale_grad_by_freq or sparse gradients is not supported")
    if t.is_compute(ids):
        raise _Refused("embedding ids computed from the weights are not supported")
    table = t.tensor(weight)
    vocab = t.shape(table)[0]
    shape = tuple(t.values[ids.name].shape)
    pad = None if padding_idx is None or padding_idx < 0 else int(padding_idx)
    onehot = t.data_leaf(ids, "onehot", shape + (vocab,), classes=vocab)
    if pad is None:
        return t.op("embedding", onehot, table)
    return t.op("embedding_padded", onehot, table, pad=pad)  # row `pad` read, never trained


def _h_layer_norm(t: _Translator, node, x, normalized_shape, weight=None, bias=None, eps=1e-5, cudnn=True):
    a = t.tensor(x)
    shape = t.shape(a)
    if len(normalized_shape) != 1 or shape[-1:] != tuple(normalized_shape):
        raise _Refused("layer_norm is supported over the last dim")
    n = shape[-1]
    gamma = t.tensor(weight) if weight is not None else t.data_leaf_const(node, "ones", (n,), 1.0)
    beta = t.tensor(bias) if bias is not None else t.data_leaf_const(node, "zeros", (n,), 0.0)
    return t.op("layernorm", a, gamma, beta, eps=float(eps))


def _h_batch_norm(t: _Translator, node, x, weight, bias, running_mean, running_var, training, momentum, eps,
                  cudnn=True):
    a = t.tensor(x)
    shape = t.shape(a)
    if len(shape) != 4:
        raise _Refused("batch_norm is supported on [N, C, H, W] tensors")
    n, c, h, w = shape
    gamma = t.tensor(weight) if weight is not None else t.data_leaf_const(node, "ones", (c,), 1.0)
    beta = t.tensor(bias) if bias is not None else t.data_leaf_const(node, "zeros", (c,), 0.0)
    if training or running_mean is None:
        count = n * h * w
        mean = t.op("bn_mean", a, count=count, tag="mean")
        var = t.op("bn_var", a, mean, count=count, tag="var")
        if training and running_mean is not None:
            t.running_statistics(node, mean, var, count, running_mean, running_var, momentum)
    else:
        mean, var = t.tensor(running_mean), t.tensor(running_var)
    return t.op("bn_normalize", a, mean, var, gamma, beta, eps=float(eps))


def _h_conv2d(t: _Translator, node, x, w, b=None, stride=1, padding=0, dilation=1, groups=1):
    step, pad = _square(stride), _square(padding)
    if step is None or pad is None or _square(dilation) != 1 or groups != 1:
        raise _Refused("conv2d is supported with square stride and padding, no dilation, groups=1")
    out = t.op("conv2d", t.tensor(x), t.tensor(w), stride=step, pad=pad)
    if b is None:
        return out
    moved = t.op("transpose", out, d0=1, d1=3, tag="bias_in")  # channels last, for bias_add
    biased = t.op("bias_add", moved, t.tensor(b), tag="bias")
    return t.op("transpose", biased, d0=1, d1=3, tag="bias_out")


def _h_avg_pool2d(t: _Translator, node, x, kernel, stride=None, padding=0, ceil_mode=False,
                  count_include_pad=True, divisor_override=None):
    size, step, pad = _square(kernel), _square(stride if stride else kernel), _square(padding)
    if None in (size, step) or pad != 0 or ceil_mode or divisor_override:
        raise _Refused("avg_pool2d is supported with square kernels and strides, no padding, no ceil_mode")
    return t.op("avgpool2d", t.tensor(x), size=size, stride=step)


def _h_max_pool2d(t: _Translator, node, x, kernel, stride=None, padding=0, dilation=1, ceil_mode=False):
    size, step, pad = _square(kernel), _square(stride if stride else kernel), _square(padding)
    if None in (size, step, pad) or _square(dilation) != 1 or ceil_mode:
        raise _Refused("max_pool2d is supported with square kernels, strides and padding, no dilation, no ceil_mode")
    if pad == 0:
        return t.op("maxpool2d", t.tensor(x), size=size, stride=step)
    if 2 * pad >= size:
        raise _Refused(f"max_pool2d with padding {pad} and kernel {size}: parsat supports padding below half the "
                       "kernel (2 * padding < kernel)")
    return t.op("maxpool2d_padded", t.tensor(x), size=size, stride=step, pad=pad)


def _h_adaptive_avg_pool2d(t: _Translator, node, x, output_size):
    if _square(output_size) != 1:
        raise _Refused("adaptive_avg_pool2d is supported with output size 1 (global average pooling)")
    out = t.op("global_avgpool", t.tensor(x))
    return t.reshape(out, t.shape(out) + (1, 1))


def _h_view(t: _Translator, node, x, shape):
    return t.reshape(t.tensor(x), shape)


def _h_flatten(t: _Translator, node, x, start_dim=0, end_dim=-1):
    a = t.tensor(x)
    shape = t.shape(a)
    if not shape:
        return t.reshape(a, (1,))
    s, e = t.dim(a, start_dim), t.dim(a, end_dim)
    return t.reshape(a, shape[:s] + (math.prod(shape[s:e + 1]),) + shape[e + 1:])


def _h_unflatten(t: _Translator, node, x, dim, sizes):
    a = t.tensor(x)
    shape = list(t.shape(a))
    d = t.dim(a, dim)
    return t.reshape(a, tuple(shape[:d] + [int(s) for s in sizes] + shape[d + 1:]))


def _h_unbind(t: _Translator, node, x, dim=0):
    a = t.tensor(x)
    d = t.dim(a, dim)
    shape = t.shape(a)
    return [t.reshape(t.op("split", a, dim=d, start=i, size=1, tag=f"part{i}") if shape[d] > 1 else a,
                      shape[:d] + shape[d + 1:]) for i in range(shape[d])]


def _h_unsqueeze(t: _Translator, node, x, dim):
    a = t.tensor(x)
    shape = list(t.shape(a))
    d = dim % (len(shape) + 1)
    return t.reshape(a, tuple(shape[:d] + [1] + shape[d:]))


def _h_squeeze(t: _Translator, node, x, dims=None):
    a = t.tensor(x)
    shape = list(t.shape(a))
    if dims is None:
        keep = [s for s in shape if s != 1]
    else:
        drop = {t.dim(a, d) for d in (dims if isinstance(dims, (list, tuple)) else [dims])}
        keep = [s for k, s in enumerate(shape) if not (k in drop and s == 1)]
    return t.reshape(a, tuple(keep))


def _h_expand(t: _Translator, node, x, sizes, implicit=False):
    a = t.tensor(x)
    shape = t.shape(a)
    out = [int(s) for s in sizes]
    pad = len(out) - len(shape)
    out = [shape[k - pad] if s == -1 else s for k, s in enumerate(out)]
    return t.expand_to(a, out)


def _h_transpose(t: _Translator, node, x, d0, d1):
    return t.transpose(t.tensor(x), d0, d1)


def _h_t(t: _Translator, node, x):
    return t.transpose(t.tensor(x), 0, 1)


def _h_permute(t: _Translator, node, x, dims):
    return t.permute(t.tensor(x), dims)


def _h_slice(t: _Translator, node, x, dim=0, start=None, end=None, step=1):
    a = t.tensor(x)
    d = t.dim(a, dim)
    n = t.shape(a)[d]
    lo, hi, stride = slice(start, end, step).indices(n)
    if stride != 1:
        raise _Refused("slicing with a step other than 1 is not supported")
    if hi <= lo:
        raise _Refused("an empty slice")
    if lo == 0 and hi == n:
        return a
    return t.op("split", a, dim=d, start=lo, size=hi - lo)


def _h_narrow(t: _Translator, node, x, dim, start, length):
    return _h_slice(t, node, x, dim, start, start + length)


def _h_select(t: _Translator, node, x, dim, index):
    a = t.tensor(x)
    d = t.dim(a, dim)
    shape = t.shape(a)
    i = index % shape[d]
    piece = a if shape[d] == 1 else t.op("split", a, dim=d, start=i, size=1)
    return t.reshape(piece, shape[:d] + shape[d + 1:])


def _h_split(t: _Translator, node, x, split_size, dim=0):
    a = t.tensor(x)
    d = t.dim(a, dim)
    n = t.shape(a)[d]
    sizes = list(split_size) if isinstance(split_size, (list, tuple)) else \
        [min(split_size, n - s) for s in range(0, n, split_size)]
    pieces, start = [], 0
    for i, size in enumerate(sizes):
        pieces.append(a if size == n else t.op("split", a, dim=d, start=start, size=size, tag=f"part{i}"))
        start += size
    return pieces


def _h_chunk(t: _Translator, node, x, chunks, dim=0):
    a = t.tensor(x)
    n = t.shape(a)[t.dim(a, dim)]
    return _h_split(t, node, x, -(-n // chunks), dim)


def _h_cat(t: _Translator, node, tensors, dim=0):
    items = [t.tensor(v) for v in tensors]
    if not items:
        raise _Refused("cat of no tensors")
    out = items[0]
    for other in items[1:]:
        out = t.op("concat", out, other, dim=t.dim(out, dim))
    return out


def _h_reduce(kind: str):
    def handler(t: _Translator, node, x, dim=None, keepdim=False, *, dtype=None):
        return t.reduce(kind, t.tensor(x), dim, keepdim)
    return handler


def _h_softmax(t: _Translator, node, x, dim, half_to_float=False, *rest, **kwargs):
    a = t.tensor(x)
    return t.op("softmax", a, dim=t.dim(a, dim))


def _h_log_softmax(t: _Translator, node, x, dim, *rest, **kwargs):
    a = t.tensor(x)
    d = t.dim(a, dim)
    if d != len(t.shape(a)) - 1:
        raise _Refused("log_softmax is supported along the last dim")
    lse = t.op("logsumexp", a, tag="lse")
    return t.op("add_bcast_dim", a, t.op("neg", lse, tag="neg_lse"), dim=d)


def _h_dropout(t: _Translator, node, x, p, train=True):
    a = t.tensor(x)
    if not train or p == 0:
        return a
    if p >= 1:
        raise _Refused("dropout with p >= 1")
    return t.op("dropout_masked", a, t.dropout_leaf(node, "", t.shape(a), p), rate=float(p))


def _h_sdpa(t: _Translator, node, q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, *, scale=None,
            enable_gqa=False):
    """softmax(q k^T * scale [masked]) [dropout] v on [..., s, d] tensors, written out with library operators."""
    qh, kh, vh = t.tensor(q), t.tensor(k), t.tensor(v)
    sq, sk, sv = t.shape(qh), t.shape(kh), t.shape(vh)
    if len(sq) < 3 or sq[:-2] != sk[:-2] or sk[:-1] != sv[:-1]:
        if enable_gqa:
            raise _Refused("scaled_dot_product_attention with enable_gqa is not supported (repeat k and v)")
        raise _Refused(f"scaled_dot_product_attention of q {list(sq)}, k {list(sk)}, v {list(sv)}")
    rank = len(sq)
    c = scale if scale is not None else 1.0 / math.sqrt(sq[-1])
    kt = t.op("transpose", kh, d0=rank - 2, d1=rank - 1, tag="kT")
    scores = t.op("scale", t.op("bmm", qh, kt, tag="scores"), c=float(c), tag="scaled")
    shape = t.shape(scores)
    if attn_mask is not None and is_causal:
        raise _Refused("scaled_dot_product_attention with both attn_mask and is_causal")
    if attn_mask is not None:
        if t.is_compute(attn_mask):
            raise _Refused("an attention mask computed from the weights is not supported (masks are data)")
        mask = t.data_leaf(attn_mask, "mask", shape)
        probs = t.op("softmax_masked", scores, mask, tag="probs")
    elif is_causal:
        mask = t.data_leaf_const(node, "causal", shape, None)
        probs = t.op("softmax_masked", scores, mask, tag="probs")
    else:
        probs = t.op("softmax", scores, dim=rank - 1, tag="probs")
    if dropout_p:
        mask = t.dropout_leaf(node, "_attn", t.shape(probs), dropout_p)
        probs = t.op("dropout_masked", probs, mask, rate=float(dropout_p), tag="attn_drop")
    return t.op("bmm", probs, vh, tag="ctx")


def _h_cross_entropy(t: _Translator, node, x, target, weight=None, reduction=1, ignore_index=-100,
                     label_smoothing=0.0):
    if weight is not None or label_smoothing:
        raise _Refused("cross_entropy with class weights or label smoothing is not supported")
    if t.is_compute(target):
        raise _Refused("cross_entropy targets computed from the weights (soft targets) are not supported")
    logits = t.tensor(x)
    shape = t.shape(logits)
    if len(shape) != 2:
        raise _Refused(f"cross_entropy is supported on [N, classes] logits, got {list(shape)}")
    n, classes = shape
    if tuple(t.values[target.name].shape) != (n,):
        raise _Refused("cross_entropy targets must be class indices of shape [N]")
    y = t.data_leaf(target, "onehot", (n, classes), classes=classes, ignore=int(ignore_index))
    lse = t.op("logsumexp", logits, tag="lse")
    total = t.op("nll_sum", logits, lse, y, tag="nll")
    if reduction == 2:  # sum
        return total
    if reduction != 1:
        raise _Refused("cross_entropy with reduction='none' is not supported (return its mean or sum)")
    inv = t.data_leaf(target, "inv_count", (), classes=classes, ignore=int(ignore_index))
    return t.op("mul", total, inv, tag="mean")


def _h_hop_grad(t: _Translator, node, enabled, submod, *args):
    raise _Refused("a region with gradients switched on or off inside forward (torch.no_grad on weights)")


_HANDLERS: dict[str, Callable] = {
    **{name: _h_identity for name in _IDENTITY},
    "_assert_tensor_metadata": _h_assert,
    **{name: _h_unary for name in _UNARY},
    "gelu": _h_gelu,
    "add": _h_add, "sub": _h_sub, "rsub": _h_rsub, "mul": _h_mul, "div": _h_div, "pow": _h_pow,
    "linear": _h_linear, "addmm": _h_addmm, "matmul": _h_matmul, "mm": _h_matmul, "bmm": _h_matmul,
    "embedding": _h_embedding, "layer_norm": _h_layer_norm, "batch_norm": _h_batch_norm,
    "conv2d": _h_conv2d, "avg_pool2d": _h_avg_pool2d, "max_pool2d": _h_max_pool2d, "adaptive_avg_pool2d": _h_adaptive_avg_pool2d,
    "view": _h_view, "reshape": _h_view, "_unsafe_view": _h_view, "flatten": _h_flatten,
    "unsqueeze": _h_unsqueeze, "unflatten": _h_unflatten, "unbind": _h_unbind, "squeeze": _h_squeeze, "expand": _h_expand,
    "transpose": _h_transpose, "t": _h_t, "permute": _h_permute,
    "slice": _h_slice, "narrow": _h_narrow, "select": _h_select, "split": _h_split,
    "split_with_sizes": _h_split, "chunk": _h_chunk, "cat": _h_cat,
    "mean": _h_reduce("mean"), "sum": _h_reduce("reduce_sum"),
    "softmax": _h_softmax, "_softmax": _h_softmax, "log_softmax": _h_log_softmax,
    "dropout": _h_dropout, "scaled_dot_product_attention": _h_sdpa, "cross_entropy_loss": _h_cross_entropy,
    "wrap_with_set_grad_enabled": _h_hop_grad,
}


# ------------------------------------------------------------------ helpers


def _concrete_values(program, inputs: tuple) -> dict:
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


def _needed_nodes(graph, targets: Sequence[str]) -> dict[str, list[str]]:
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


def _pruned(builder: GraphBuilder, outputs: Sequence[str]) -> Graph:
    """The built graph without the nodes and leaves no output depends on."""
    if not outputs:
        raise TorchImportError("the module has no output computed from its weights")
    builder.output(*(Tensor(o) for o in outputs))
    try:
        graph = builder.build()
    except GraphError as err:
        raise TorchImportError(str(err)) from None
    live = set(graph.outputs)
    for node in reversed(graph.nodes):
        if node.name in live:
            live.update(node.inputs)
    return Graph(tuple(l for l in graph.leaves if l.name in live), tuple(n for n in graph.nodes if n.name in live),
                 graph.outputs, graph.name)


def _broadcast_shape(a: Sequence[int], b: Sequence[int]) -> tuple[int, ...] | None:
    rank = max(len(a), len(b))
    pa = (1,) * (rank - len(a)) + tuple(a)
    pb = (1,) * (rank - len(b)) + tuple(b)
    out = []
    for x, y in zip(pa, pb):
        if x != y and 1 not in (x, y):
            return None
        out.append(max(x, y))
    return tuple(out)


def _aten_short(node) -> str:
    """`aten.add.Tensor` -> `add`; in-place `add_` -> `add`; a higher-order op by its name."""
    target = node.target
    packet = getattr(target, "_overloadpacket", None)
    name = getattr(packet, "__name__", None) or getattr(target, "__name__", None) or str(target)
    name = name.split(".")[-1]
    if name.endswith("_") and not name.startswith("_"):
        name = name[:-1]
    return name


def _aten_name(node) -> str:
    return str(node.target) if not callable(node.target) or hasattr(node.target, "_overloadpacket") \
        else getattr(node.target, "__name__", str(node.target))


def _source_line(node) -> str:
    """`file:line: code` of the innermost frame outside torch in the node's stack trace."""
    trace = node.meta.get("stack_trace") or ""
    lines = trace.strip().splitlines()
    frames = []
    for i, line in enumerate(lines):
        line = line.strip()
        if line.startswith('File "'):
            code = lines[i + 1].strip() if i + 1 < len(lines) and not lines[i + 1].strip().startswith('File "') \
                else ""
            path, _, rest = line[6:].partition('", line ')
            number = rest.split(",")[0]
            frames.append((path, number, code))
    user = [f for f in frames if "/torch/" not in f[0] and "/parsat/" not in f[0] and "/backend/" not in f[0]]
    if not user:
        return ""
    path, number, code = user[-1]
    return f"{path}:{number}: {code}" if code else f"{path}:{number}"


def _module_path(node) -> str:
    stack = node.meta.get("nn_module_stack") or {}
    path = ""
    for value in stack.values():
        path = value[0] if isinstance(value, tuple) else str(value)
    return path


def _square(value) -> int | None:
    """An int from an int or a pair of equal ints (kernel sizes, strides, paddings); None otherwise."""
    if isinstance(value, int):
        return value
    if isinstance(value, (tuple, list)) and len(value) == 2 and value[0] == value[1] and isinstance(value[0], int):
        return value[0]
    if isinstance(value, (tuple, list)) and len(value) == 1 and isinstance(value[0], int):
        return value[0]
    return None


def _reshape_groups(src: Sequence[int], dst: Sequence[int]) -> list[tuple[int, list[int]]] | None:
    """Consecutive groups (number of source dims, target dims) with equal products; size-1 dims join a neighbour."""
    groups: list[tuple[int, list[int]]] = []
    i = j = 0
    while i < len(src) or j < len(dst):
        if i == len(src) or j == len(dst):  # only size-1 dims may be left: they join the last group
            rest_src, rest_dst = list(src[i:]), list(dst[j:])
            if any(d != 1 for d in rest_src + rest_dst):
                return None
            if groups:
                n_in, outs = groups[-1]
                groups[-1] = (n_in + len(rest_src), outs + rest_dst)
            else:
                groups.append((len(rest_src), rest_dst))
            break
        n_in, outs = 1, [dst[j]]
        a, b = src[i], dst[j]
        i, j = i + 1, j + 1
        while a != b:
            if a < b:
                if i == len(src):
                    return None
                a *= src[i]
                n_in += 1
                i += 1
            else:
                if j == len(dst):
                    return None
                b *= dst[j]
                outs.append(dst[j])
                j += 1
        groups.append((n_in, outs))
    return [g for g in groups if g[0] or g[1]]


# ------------------------------------------------------------ model files


def load_model_factory(path_spec: str):
    """(module, example inputs) from `file.py:factory`; every failure is a `TorchImportError` with the reason.

    The file is imported as a module of its own (its folder is not added to sys.path).
    """
    try:
        import torch  # noqa: F401 - only to give a clear message when it is missing
    except ImportError:
        raise TorchImportError("importing a torch model needs torch: pip install torch==2.13.0") from None
    file_part, sep, factory = path_spec.rpartition(":")
    if not sep or not file_part or not factory:
        raise TorchImportError(f"'{path_spec}': give a Python file and a factory, like model.py:make_model")
    path = Path(file_part)
    if not path.is_file():
        raise TorchImportError(f"'{file_part}' is not a file")
    module_name = f"parsat_user_model_{abs(hash(str(path.resolve())))}"
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise TorchImportError(f"'{file_part}' cannot be imported as Python")
    user = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = user
    try:
        spec.loader.exec_module(user)
    except Exception as err:  # noqa: BLE001 - a user's file: report its error, not ours
        raise TorchImportError(f"importing {file_part} failed: {type(err).__name__}: {err}") from None
    finally:
        sys.modules.pop(module_name, None)
    make = getattr(user, factory, None)
    if not callable(make):
        raise TorchImportError(f"{file_part} has no function '{factory}'")
    try:
        made = make()
    except Exception as err:  # noqa: BLE001
        raise TorchImportError(f"{file_part}:{factory}() failed: {type(err).__name__}: {err}") from None
    if not isinstance(made, (tuple, list)) or len(made) != 2:
        raise TorchImportError(f"{file_part}:{factory}() must return (module, example_inputs)")
    return made[0], made[1]


def load_model_file(path_spec: str, library=None) -> Graph:
    """The graph of `file.py:factory`: the factory returns (module, example inputs)."""
    module, example_inputs = load_model_factory(path_spec)
    return from_torch(module, example_inputs, library, name=Path(path_spec.rpartition(":")[0]).stem)


__all__ = ["dropout_mask", "DataLeaf", "ImportedModule", "TorchImportError", "Unsupported", "encode", "export_module",
           "from_torch", "import_module", "load_model_factory", "load_model_file"]
