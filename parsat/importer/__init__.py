"""parsat.importer: a torch `nn.Module` as a parsat graph, through `torch.export` (docs/graph-schema.md).

Torch-dependent, beside the runtime: the backend (`parsat.backend`) feeds
an imported module's inputs, dropout masks and running statistics from
what the import recorded (`ImportedModule`), and never exports a module
again when it is given the import. Every module imports torch inside the
functions that use it, so `import parsat.importer` loads neither torch nor
the translator; the facade's `parsat.from_torch` is the public entry.

Modules, in the order an import runs through them:

* `model_file`: `load_model_factory`, `load_model_file` (a module and
  example inputs from `model.py:factory`);
* `export`: `from_torch`, `import_module`, `export_module` (the one
  `torch.export` call; the module's buffers left as they were);
* `program`: running the exported program's nodes on concrete values;
* `translator`: the walk that sorts each node into compute or data and
  builds the graph, with `shape_ops` (torch's broadcasting, reshapes and
  reductions as library operators);
* `aten`: the table of ATen operators onto library operators, one module
  per family: `aten_elementwise`, `aten_layers`, `aten_views`,
  `aten_attention`, `aten_routing` (top-k routing, its indices kept as a
  one-hot); `aten_patterns`: several ATen nodes recognised as one fused
  library operator (HF's RMSNorm pieces as `rmsnorm`);
* `export.named_blocks`: a stack of identical blocks (found by structure,
  `ir.block_layout`) renamed `b{i}_...`, the names the repeated-block
  search, pipeline stages and recomputation cut a model by; the module's
  parameter names stay in `ImportedModule.weights`;
* `call_count`: `count_module_calls` (one eager forward counted: the
  calls and autograd nodes beyond the graph and the Python bytecode
  instructions it runs, `ir.module_calls`, which the simulator prices for
  the torch-native runtime);
* `imported`: `ImportedModule` (the result, and each batch's data leaves),
  `DataLeaf`, `dropout_mask`, `RunningStats`;
* `self_check`: `check_import`, the graph evaluated against the module in
  float64 (outputs and every parameter's gradient) before the import
  returns it, refused naming the first node that differs;
* `torch_ops`: the library's operators in torch and `evaluate_graph` (a
  graph's single-process semantics), here so that the self-check and the
  backend, which runs plans with them, share one implementation;
* `errors`: `TorchImportError`, every unsupported operator listed with its
  source line and module path.
"""
