"""`ImportedModule`: an imported module's graph, and how to feed its data leaves for each batch.

Integer and boolean work on the user's inputs (labels shifted by one, masks
built from `arange`, comparisons and `cumsum`) never enters the graph as
operators: where compute reads it, it is a graph input leaf, encoded for the
operator that reads it (`DataLeaf`): ids one-hot over the vocabulary, masks
0/1 over the attention scores, the inverse count of cross-entropy's targets.
Data that depends only on shapes and buffers is folded to a constant once;
data that depends on the user's inputs is recomputed from each batch by
`ImportedModule.data_values`, running the same ATen nodes in torch (every
rank reads the same batch). Dropout masks are data too (`dropout_mask`:
seeded, the same on every rank), and a training-mode batch norm's running
statistics are recorded (`RunningStats`) so the backend can update them as
torch does. The backend (`parsat.backend.parallelize`) runs a plan from this.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any, Mapping, Sequence

from parsat.importer.errors import TorchImportError
from parsat.importer.program import run_node
from parsat.ir.block_layout import renamed
from parsat.ir.graph import Graph


@dataclass(frozen=True)
class DataLeaf:
    """A graph input leaf and how to make its value from the data node it encodes.

    `encoding`: "value" (the tensor as it is, in the compute dtype, expanded
    to `shape`), "onehot" (integer ids -> one-hot rows over `classes`; an id
    outside [0, classes) or equal to `ignore` gives a zero row), "mask"
    (boolean or 0/-inf attention mask -> 0/1, expanded to `shape`),
    "inv_count" (1 / the number of targets that are not ignored), "select"
    (a boolean condition -> `select[0]` where it holds, `select[1]` where
    not, expanded to `shape`: `torch.where`'s condition as a 0/1 factor, or
    its scalar branch as the value it puts where it is taken), or "dropout"
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
    select: tuple[float, float] = ()


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


@dataclass(frozen=True)
class NodeDtypes:
    """The dtypes the module computes one graph node in, where they are not its parameters' (the graph itself
    has no dtypes: casts between floating dtypes import as the identity they are in value). `reads`: (operand
    position, dtype) for each operand the module reads cast so (HF's causal loss reads its logits
    `logits.float()`, `LlamaRMSNorm` its input `hidden_states.to(torch.float32)`); `makes`: the dtype of the
    node's value, "" where it is the parameters'. A forward evaluating the graph (`backend.torch_native.
    rewritten`) applies them, so its float32 sections round as the module's do."""

    reads: tuple[tuple[int, str], ...] = ()
    makes: str = ""


@dataclass
class ImportedModule:
    """A module's graph and everything needed to feed it: the result of `import_module`.

    Holds torch objects (the exported program): the importer makes it and
    the backend runs a plan from it; `graph` is what the optimizer sees.
    """

    graph: Graph
    program: Any                           # torch.export.ExportedProgram
    weights: dict[str, str]                # graph weight leaf -> module parameter name: the same name, but for
                                           # a block's (`renamed`: `b3_model.layers.#.mlp.up_proj.weight` is
                                           # the parameter `model.layers.3.mlp.up_proj.weight`)
    data: dict[str, DataLeaf]              # graph input leaf -> its encoding
    constants: dict[str, Any]              # graph input leaf -> its value, for leaves that are constant
    dropout: tuple[str, ...]               # dropout mask leaves, in the order the module draws them
    user_inputs: tuple[str, ...]           # placeholder names of the user's inputs, in call order
    output_spec: Any = None                # pytree spec of the module's outputs
    _needed: dict = field(default_factory=dict, repr=False)  # data node -> nodes to evaluate, in order
    running_stats: tuple[RunningStats, ...] = ()  # batch norms in training mode with running statistics
    dtypes: dict[str, NodeDtypes] = field(default_factory=dict)   # graph node -> where the module computes it
                                                                   # in another dtype than its parameters'

    def data_values(self, inputs: Sequence[Any], dtype, seed: int = 0, step: int = 0,
                    shapes: Mapping[str, tuple[int, ...]] | None = None) -> dict[str, Any]:
        """Every non-constant data leaf's value (full tensor) for one batch of the user's inputs; dropout
        masks are those of `step` under `seed`. `shapes` (leaf -> shape) encodes those leaves at another
        shape than the import's: a rank given its local batch (`backend.torch_native.rewritten`)."""
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
                        env[name] = run_node(nodes[name], env, self.program)
                shaped = replace(leaf, shape=tuple(shapes[leaf.name])) if shapes and leaf.name in shapes else leaf
                out[leaf.name] = encode(shaped, env[leaf.node], dtype)
        return out

    def renamed(self, renaming: Mapping[str, str]) -> "ImportedModule":
        """The same import with its graph's tensors renamed (the importer names a stack's identical blocks
        `b{i}_...`, `ir.block_layout.block_names`): every leaf and node this record names follows, while the
        module's parameters, buffers and exported nodes keep theirs (`weights` maps the one to the other)."""
        new = lambda name: renaming.get(name, name)  # noqa: E731
        return replace(self, graph=renamed(self.graph, renaming),
                       weights={new(leaf): param for leaf, param in self.weights.items()},
                       data={new(name): replace(leaf, name=new(leaf.name)) for name, leaf in self.data.items()},
                       constants={new(name): value for name, value in self.constants.items()},
                       dropout=tuple(new(name) for name in self.dropout),
                       running_stats=tuple(replace(s, mean=new(s.mean), var=new(s.var)) for s in self.running_stats),
                       dtypes={new(name): d for name, d in self.dtypes.items()})

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
        value = value.to(dtype)
        if value.numel() == math.prod(leaf.shape):   # the node's value, or a view of it (`Translator.view_root`)
            return value.reshape(leaf.shape).contiguous()
        return value.expand(leaf.shape).contiguous()
    if leaf.encoding == "select":
        on, off = (torch.tensor(v, dtype=dtype) for v in leaf.select)
        return torch.where(value.bool(), on, off).expand(leaf.shape).contiguous()
    if leaf.encoding == "mask":
        return mask_keep(value, leaf.node).to(dtype).expand(leaf.shape).contiguous()
    ids = value.long()
    valid = (ids >= 0) & (ids < leaf.classes)
    if leaf.ignore is not None:
        valid &= ids != leaf.ignore
    if leaf.encoding == "inv_count":
        return (1.0 / valid.sum().to(dtype)).reshape(())
    onehot = torch.nn.functional.one_hot(torch.where(valid, ids, 0), leaf.classes).to(dtype)
    return (onehot * valid.unsqueeze(-1).to(dtype)).contiguous()


def mask_keep(value, node: str):
    """Which elements an attention mask keeps (boolean, its own shape: not yet expanded to the scores'), from a
    boolean or 0/-inf mask; TorchImportError for any other."""
    import torch

    if value.dtype == torch.bool:
        return value
    finite = value[torch.isfinite(value)]
    low = torch.finfo(value.dtype).min if value.is_floating_point() else None
    if not bool(((finite == 0) | (finite == low)).all()):
        raise TorchImportError(f"attention mask '{node}' has values other than 0 and -inf; parsat supports "
                               "boolean and 0/-inf masks")
    return value == 0
