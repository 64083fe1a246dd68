"""The table the translator maps ATen operators with: operator name -> handler, by operator family.

A compute node's operator (`errors.aten_short`: `aten.add.Tensor` and the
in-place `add_` are both `add`) is looked up here; an operator with no
handler is reported as unsupported. Each family lives in its own module:

* `aten_elementwise`: casts and copies, unary functions, arithmetic, pow
  (a `mul` ending an RMS normalization is `rmsnorm`: `aten_patterns`);
* `aten_layers`: linear and matmul, embedding, layer and batch norm,
  convolution and pooling;
* `aten_views`: views and reshapes, transposes, slices, splits, `cat`,
  `mean` and `sum`;
* `aten_attention`: softmax, dropout, scaled dot-product attention,
  cross-entropy;
* `aten_routing`: top-k routing (its indices as a one-hot) and
  `repeat_interleave`.

To support an operator, add its handler to its family's `HANDLERS`.
"""

from __future__ import annotations

from typing import Callable

from parsat.importer import aten_attention, aten_elementwise, aten_layers, aten_routing, aten_views
from parsat.importer.errors import Refused


def _h_hop_grad(t, node, enabled, submod, *args):
    raise Refused("a region with gradients switched on or off inside forward (torch.no_grad on weights)")


HANDLERS: dict[str, Callable] = {
    **aten_elementwise.HANDLERS,
    **aten_layers.HANDLERS,
    **aten_views.HANDLERS,
    **aten_attention.HANDLERS,
    **aten_routing.HANDLERS,
    "wrap_with_set_grad_enabled": _h_hop_grad,
}
