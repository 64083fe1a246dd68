"""The walk over an exported program: each node sorted into compute or data, compute built as a graph.

Each node of the ATen graph is sorted by what it depends on:

* a node that depends on a parameter is *compute*: it is mapped onto the
  library's operators (`rules/ops.rule`) with `GraphBuilder`, which infers
  and checks every shape again, by the handler of its ATen operator
  (`aten.py`, one module per operator family);
* any other node is *data*: work on the inputs, or shape-only constants
  (rotary tables from a buffer). Data becomes a graph input leaf where
  compute reads it (`data_leaf`, `imported.DataLeaf`), never an operator;
  the graph names the constant ones (`Graph.constants`: they carry no
  batch, so data parallelism copies them rather than splitting them).

A node that cannot be mapped is recorded (`errors.Unsupported`) and the
walk goes on, so the one `TorchImportError` lists them all.

Weights keep the module's qualified parameter names and layouts (a Linear's
`[out, in]` weight feeds `linear_nobias_t` or `linear_t`, torch's `F.linear`, as it
is stored, with no transpose; `export.named_blocks` then renames a stack's blocks, the names kept
in `ImportedModule.weights`), so a plan's weights are the module's own tensors and a tied
parameter (GPT-2's word embedding and LM head) stays one weight leaf with
two readers. Weight leaves are made when a compute node first reads them
(`LazyWeight`). Broadcasting, reshapes and reductions come from `ShapeOps`
(`shape_ops.py`).
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass, replace
from typing import Any, Sequence

from parsat.importer.aten import HANDLERS
from parsat.importer.aten_routing import RoutedIndices
from parsat.importer.errors import Refused, TorchImportError, Unsupported, aten_name, aten_short, module_path, source_line
from parsat.importer.imported import DataLeaf, ImportedModule, NodeDtypes, RunningStats, encode
from parsat.importer.program import concrete_values, needed_nodes, value_on_cpu
from parsat.importer.self_check import ImportTrace
from parsat.importer.shape_ops import Empty, ShapeOps
from parsat.ir.graph import Graph, GraphBuilder, GraphError, Tensor

CPU_DATA_ELEMENTS = 2**29   # the largest data value a meta import makes on the CPU (a causal mask [128, 1, 2048,
                            # 2048]: 0.5 GB as booleans)


@dataclass(frozen=True)
class LazyWeight:
    """A parameter placeholder whose weight leaf is made when a compute node first reads it."""

    placeholder: str


# ATen operators whose value is their operand's elements in the same order (a view, or a floating-point cast or
# copy, `view_root` checks): a data leaf of one is a leaf of the operand, reshaped.
DATA_VIEWS = frozenset({"unsqueeze", "squeeze", "view", "reshape", "_unsafe_view", "clone", "contiguous", "alias",
                        "_to_copy", "to", "type_as", "flatten"})

# ATen operators that draw random values: data made from them differs on every call, so it is never folded.
RANDOM = frozenset({"rand", "rand_like", "randn", "randn_like", "randint", "randint_like", "randperm", "bernoulli",
                    "normal", "uniform", "multinomial", "exponential", "native_dropout"})


class Translator(ShapeOps):
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
        self.values = concrete_values(program, inputs)
        self.compute: set = set()        # node names that depend on a parameter
        self.varying: set = set()        # node names that depend on a user input
        self.random: set = set()         # node names that depend on values drawn at random in forward
        self.env: dict = {}              # compute node name -> Tensor handle (or a list of them)
        self.failed: dict = {}           # node name -> Unsupported (the first failure on a path)
        self.weights: dict[str, Tensor] = {}
        self.transposed: dict[str, Tensor] = {}
        self.untransposed: dict[str, Tensor] = {}   # a `weight_t` transpose's name -> the matrix it transposes
        self.picked_rows: dict[str, tuple] = {}     # rows picked by a top-k -> (its one-hot, the table) (aten_routing)
        self.data: dict[tuple, DataLeaf] = {}
        self.leaf_nodes: dict = {}       # data leaf name -> (its data node, its DataLeaf) (`data_leaf`)
        self.shared_reshapes: dict = {}  # (data leaf, shape) -> the leaf reshaped so, made once (`ShapeOps.reshape`)
        self.constants: dict[str, Any] = {}
        self.dropout: list[str] = []
        self.running_stats: list[RunningStats] = []
        self.constant_masks: dict[tuple, bool] = {}           # (mask node, scores' shape, kind) -> whether it is
        self.buffers = dict(sig.inputs_to_buffers)            # placeholder -> buffer name
        self.names: set[str] = set()
        self.node = None
        self.dtypes: dict[str, NodeDtypes] = {}   # graph node -> the dtypes the module computes it in (`note_dtypes`)
        self.param_dtype = next((p.dtype for p in module.parameters() if p.is_floating_point()), None)

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
            out = self.g.op(kind, *args, name=self.fresh(self.node.name + (f"_{tag}" if tag else "")), **attrs)
        except GraphError as err:
            raise Refused(str(err)) from None
        made = getattr(self.values.get(self.node.name), "dtype", None)
        if self.other_dtype(made):   # the ATen node computes in another floating dtype: every operand read so
            self.dtypes[out.name] = NodeDtypes(tuple((i, str(made).removeprefix("torch."))
                                                     for i, a in enumerate(args) if isinstance(a, Tensor)),
                                               str(made).removeprefix("torch."))
        return out

    def other_dtype(self, dtype) -> bool:
        """Whether `dtype` is a floating dtype other than the module's parameters'."""
        return dtype is not None and dtype.is_floating_point and self.param_dtype is not None \
            and dtype != self.param_dtype

    def read_as(self, out: Tensor, position: int, value) -> None:
        """Graph node `out` reads its operand `position` as the module does: cast to the dtype of the ATen
        `value` (a fused pattern's cast inside it, `aten_patterns.rmsnorm_of`), where that is not the
        parameters' dtype."""
        dtype = getattr(self.values.get(getattr(value, "name", None)), "dtype", None)
        if self.other_dtype(dtype):
            old = self.dtypes.get(out.name, NodeDtypes())
            self.dtypes[out.name] = replace(old, reads=tuple(sorted(dict(old.reads) | {
                position: str(dtype).removeprefix("torch.")}.items())))

    def shape(self, t: Tensor) -> tuple[int, ...]:
        return self.g.shape(t)

    def dim(self, t_or_rank, d: int) -> int:
        rank = t_or_rank if isinstance(t_or_rank, int) else len(self.shape(t_or_rank))
        if not -rank <= d < max(rank, 1):
            raise Refused(f"dim {d} is out of range for a tensor of rank {rank}")
        return d % rank if rank else 0

    def is_compute(self, value) -> bool:
        return isinstance(value, self.torch.fx.Node) and value.name in self.compute

    def tensor(self, value) -> Tensor:
        """A compute operand as a graph tensor; data operands become input leaves (their value as it is)."""
        if isinstance(value, Tensor):
            return value
        if self.is_compute(value):
            got = self.env[value.name]
            if isinstance(got, Empty):
                raise Refused(f"an empty tensor (shape {list(got.shape)}, from an empty slice) is read here; parsat "
                              "leaves empty tensors out only where cat joins them")
            if isinstance(got, RoutedIndices):
                raise Refused("the indices of a top-k (computed from the weights) are read here; parsat follows them "
                              "only through reshapes and into a row pick, x[indices]")
            if not isinstance(got, Tensor):
                raise Refused("a list of tensors is used where a tensor is expected")
            return got
        if isinstance(value, self.torch.fx.Node) and isinstance(self.values.get(value.name), self.torch.Tensor):
            return self.data_leaf(value, "value", tuple(self.values[value.name].shape))
        raise Refused(f"expected a tensor, got the constant {value!r}")

    def constant_value(self, node):
        """A data node's value (`values`); on meta tensors, made again on the CPU where it is at most
        `CPU_DATA_ELEMENTS` elements large at every step (`program.value_on_cpu`), else None."""
        value = self.values.get(node.name)
        if isinstance(value, self.torch.Tensor) and value.is_meta:
            return value_on_cpu(self.program, node.name, self.values, CPU_DATA_ELEMENTS)
        return value

    def is_empty(self, value) -> bool:
        """Whether a compute operand is an `Empty` (an empty slice)."""
        return self.is_compute(value) and isinstance(self.env.get(value.name), Empty)

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

    def trained(self, placeholder: str) -> bool:
        """Whether a parameter is trained. A frozen one (`requires_grad=False`: Whisper's sinusoidal encoder
        positions) gets no gradient and no update from torch, so it is data: a constant of the graph, its value
        at import, never a weight whose gradient a plan would sum and whose value the optimizer would change."""
        return self.module.get_parameter(self.params[placeholder]).requires_grad

    def weight(self, placeholder: str) -> Tensor:
        name = self.params[placeholder]
        if name not in self.weights:
            shape = tuple(self.values[placeholder].shape)
            self.names.add(name)
            try:
                self.weights[name] = self.g.weight(name, shape)
            except GraphError as err:
                raise Refused(str(err)) from None
        return self.weights[name]

    def weight_t(self, value) -> Tensor:
        """The transpose of a 2-D operand (a Linear's [out, in] weight read as [in, out]), made once per weight."""
        t = self.tensor(value)
        if len(self.shape(t)) != 2:
            raise Refused(f"expected a 2-D weight, got shape {list(self.shape(t))}")
        if t.name not in self.transposed:
            self.transposed[t.name] = self.op("transpose", t, d0=0, d1=1, tag="t")
            self.untransposed[self.transposed[t.name].name] = t
        return self.transposed[t.name]

    def untransposed_of(self, value) -> Tensor | None:
        """The matrix `value` is the `weight_t` transpose of (`x @ w.t()`, `x @ w.T`), else None: a product that
        reads it is torch's `F.linear` on the [out, in] matrix (`linear_nobias_t`, `linear_t`), and the transpose,
        left unread, is pruned."""
        return self.untransposed.get(self.tensor(value).name)

    def dropout_leaf(self, node, tag: str, shape: tuple[int, ...], rate: float) -> Tensor:
        """A fresh dropout mask leaf for one dropout of the module (in the order the module draws them)."""
        name = self.fresh(f"{node.name}{tag}_mask")
        self.data[(name,)] = DataLeaf(name, node.name, "dropout", tuple(shape), rate=float(rate))
        self.dropout.append(name)
        try:
            self.g.input(name, shape)
        except GraphError as err:
            raise Refused(str(err)) from None
        return Tensor(name)

    def data_leaf(self, node, encoding: str, shape: tuple[int, ...], classes: int = 0,
                  ignore: int | None = None, select: tuple[float, float] = ()) -> Tensor:
        """The input leaf of a data node in an encoding (one leaf per node, encoding, shape and parameters).

        A value read as it is comes from the data node its views start from (`view_root`), so that views made
        of one value in every layer (HF LLaMA's rotary tables, unsqueezed per layer) are one leaf, and each
        reshape of it is made once for all its readers (`ShapeOps.reshape`), as the built-in `llama` flattens
        its `rope_cos` once."""
        if encoding == "value" and math.prod(shape) == self.values[node.name].numel():
            node = self.view_root(node)
        key = (node.name, encoding, shape, classes, ignore, select)
        if node.name in self.random:
            raise Refused("values drawn at random in forward (stochastic depth's `torch.rand`: a drop-path rate above "
                          "0) would be one draw folded into the graph; parsat draws dropout's masks only "
                          "(aten.dropout): set the model's drop-path rate to 0")
        if key not in self.data:
            suffix = "" if encoding == "value" and tuple(self.values[node.name].shape) == shape else f"_{encoding}"
            base = node.name if not suffix else node.name + suffix
            name = self.fresh(base)
            constant = node.name not in self.varying
            leaf = DataLeaf(name, node.name, encoding, tuple(shape), classes, ignore, constant, select=select)
            if constant:
                self.constants[name] = encode(leaf, self.values[node.name], self.torch.float64)
            try:
                self.g.input(name, shape)
            except GraphError as err:
                raise Refused(str(err)) from None
            self.data[key] = leaf
            self.leaf_nodes[name] = (node, leaf)
        return Tensor(self.data[key].name)

    def view_root(self, node):
        """The data node that `node` is a view of, element for element in the same order (through unsqueezes,
        squeezes, views and floating-point casts and copies); `node` itself when it is no such view."""
        while isinstance(node, self.torch.fx.Node) and aten_short(node) in DATA_VIEWS and node.args \
                and isinstance(node.args[0], self.torch.fx.Node) and not self.is_compute(node.args[0]):
            source, value = node.args[0], self.values.get(node.name)
            before = self.values.get(source.name)
            if not (isinstance(value, self.torch.Tensor) and isinstance(before, self.torch.Tensor)) \
                    or value.numel() != before.numel() or value.is_floating_point() != before.is_floating_point() \
                    or source.name in self.random:
                break
            node = source
        return node

    def data_leaf_const(self, node, what: str, shape, value) -> Tensor:
        """A constant data leaf made here (ones and zeros for missing affine parameters, a causal mask)."""
        torch = self.torch
        key = (node.name, what, tuple(shape), 0, None, ())
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

    def running_statistics(self, node, mean: Tensor, var: Tensor, count: int, running_mean, running_var,
                           momentum) -> None:
        """Record a training-mode batch norm's running statistics (`RunningStats`), or refuse what the update
        cannot reproduce."""
        names = [self.buffers.get(b.name) if isinstance(b, self.torch.fx.Node) else None
                 for b in (running_mean, running_var)]
        if None in names:
            raise Refused("batch_norm in training mode whose running statistics are not buffers of the module")
        owner = names[0].rpartition(".")[0]
        if count < 2:
            raise Refused("batch_norm in training mode over one element per channel (torch refuses it too)")
        tracked = f"{owner}.num_batches_tracked" if owner else "num_batches_tracked"
        has_tracked = tracked in dict(self.module.named_buffers())
        self.running_stats.append(RunningStats(mean.name, var.name, int(count), float(momentum), names[0], names[1],
                                               tracked if has_tracked else None))

    # -- the walk --------------------------------------------------------
    def run(self) -> ImportedModule:
        """Sort and map every node, then the `ImportedModule` (one `TorchImportError` listing every failure)."""
        graph = self.program.graph
        for node in graph.nodes:
            self.node = node
            if node.op == "placeholder":
                if node.name in self.params and self.trained(node.name):
                    self.compute.add(node.name)
                    self.env[node.name] = LazyWeight(node.name)
                elif node.name in self.user_inputs:
                    self.varying.add(node.name)
                continue
            if node.op in ("output", "get_attr"):
                continue
            inputs = node.all_input_nodes
            if any(n.name in self.varying for n in inputs):
                self.varying.add(node.name)
            if aten_short(node) in RANDOM or any(n.name in self.random for n in inputs):
                self.random.add(node.name)
            if any(n.name in self.failed for n in inputs):
                self.failed[node.name] = self.failed[next(n.name for n in inputs if n.name in self.failed)]
                self.compute.add(node.name)
                continue
            if not any(n.name in self.compute for n in inputs):
                continue  # data: computed from inputs and constants, in torch
            self.compute.add(node.name)
            try:
                self.env[node.name] = self._map(node)
            except Refused as err:
                self.failed[node.name] = Unsupported(aten_name(node), str(err), source_line(node),
                                                     module_path(node))
        outputs = self._outputs(graph)
        failures = list(dict.fromkeys(self.failed.values()))
        if failures:
            raise TorchImportError(f"{type(self.module).__name__}: {len(failures)} operator(s) parsat cannot "
                                   "import:\n" + "\n".join(str(f) for f in failures))
        built = pruned(self.g, outputs)
        live = {n.name for n in built.nodes}
        data = {leaf.name: leaf for leaf in self.data.values() if built.leaf(leaf.name) is not None}
        built = replace(built, constants=frozenset(name for name, leaf in data.items() if leaf.constant))
        needed = needed_nodes(graph, [leaf.node for leaf in data.values()
                                       if not leaf.constant and leaf.encoding != "dropout"])
        dropout = tuple(self.dropout)
        weights = {leaf.name: leaf.name for leaf in built.weights}
        return ImportedModule(built, self.program, weights, data,
                              {k: v for k, v in self.constants.items() if k in data},
                              dropout,
                              tuple(self.user_inputs), self.program.call_spec.out_spec, needed,
                              tuple(s for s in self.running_stats if s.mean in live and s.var in live),
                              {name: d for name, d in self.dtypes.items() if name in live})

    def trace(self) -> ImportTrace:
        """What the import's self-check needs of this walk: which nodes are compute, and the graph tensor holding
        each compute node's value."""
        handles = {name: h.name for name, h in self.env.items() if isinstance(h, Tensor)}
        return ImportTrace(frozenset(self.compute), handles)

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
            if isinstance(handle, LazyWeight):
                handle = self.weight(handle.placeholder)
            names.append(handle.name)
        return names

    def _map(self, node):
        """The graph tensor(s) of one compute node; Refused for what parsat cannot express."""
        target = node.target
        for i, a in enumerate(node.all_input_nodes):  # materialise weight leaves on first use
            got = self.env.get(a.name)
            if isinstance(got, LazyWeight):
                self.env[a.name] = self.weight(got.placeholder)
        if target is operator.getitem:
            seq, index = node.args
            items = self.env[seq.name]
            if not isinstance(items, list):
                raise Refused("indexing a tensor with [] is not supported")
            return items[index]
        name = aten_short(node)
        handler = HANDLERS.get(name)
        if handler is None:
            raise Refused("unsupported operator")
        return handler(self, node, *node.args, **node.kwargs)


def pruned(builder: GraphBuilder, outputs: Sequence[str]) -> Graph:
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
