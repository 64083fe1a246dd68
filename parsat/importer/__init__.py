"""parsat.importer: a torch `nn.Module` as a parsat graph, through `torch.export` (docs/graph-schema.md).

Torch-dependent, beside the runtime: the backend (`parsat.backend`) feeds
an imported module's inputs, dropout masks and running statistics from
what the import recorded (`ImportedModule`), and never exports a module
again when it is given the import.

Modules: `torch_import` (`from_torch`, `import_module`, `ImportedModule`:
the exported program sorted into compute and data, the compute mapped
onto library operators; every unsupported operator listed with its source
line and module path).
"""
