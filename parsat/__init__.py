"""parsat: proven rewrites, jointly optimized parallelization (docs/ARCHITECTURE.md).

The facade, on top of every stage: the public API is re-exported here,
lazily, so importing `parsat` imports neither torch, z3 nor egglog (each is
imported by the subpackage that needs it, when it is used).

Modules: `api` (`optimize` with only the rules the verifier PROVED),
`cli` (the `parsat` command; each subcommand lives with its stage),
`optimize_cli` (`parsat optimize`, which joins verifier, search and torch
import), `terminal` (what the CLI prints shows control characters, never obeys
them), `__main__` (`python -m parsat`). The stages are the packages
`parsat.dsl`, `parsat.ir`, `parsat.verifier`, `parsat.cost`,
`parsat.egraph`, `parsat.search`, `parsat.generate`, `parsat.importer`,
`parsat.backend` and `parsat.report` (docs/ARCHITECTURE.md).
"""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["__version__", "load_rules", "check", "verify", "optimize", "explain", "from_torch", "parallelize",
           "gather_weights", "Machine", "Graph", "GraphBuilder", "Limits"]

# Lazy re-exports of the saturation API (importing parsat must not import egglog).
_LAZY = {
    "Machine": "parsat.ir.machine",
    "Graph": "parsat.ir.graph",
    "GraphBuilder": "parsat.ir.graph",
    "Limits": "parsat.egraph.runner",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'parsat' has no attribute {name!r}")


def optimize(graph, machine="h100x8", rules=None, limits=None, devices=None, **options):
    """The cheapest plan the proven rules reach: see `parsat.api.optimize`."""
    from parsat.api import optimize as run

    return run(graph, machine=machine, rules=rules, limits=limits, devices=devices, **options)


def explain(plan, limit=40):
    """A plan as text, what `parsat explain` prints: see `parsat.report.explain.explain_plan`.

    `plan` is a `Plan`, a plan dict or a plan JSON file; long plans show the
    first `limit` parallel operators and nodes (None: all).
    """
    from parsat.report.explain import explain_plan

    return explain_plan(plan, limit)


def from_torch(module, example_inputs, library=None, name=None, *, check=True):
    """The parsat `Graph` of a torch `nn.Module` (torch.export): see `parsat.importer.export.from_torch`.

    Weights are named by the module's parameter names; unsupported
    operators raise one `TorchImportError` listing each with its source line.
    With `check` (the default) the graph is evaluated against the module on
    the example inputs in float64 (loss or outputs, every parameter's
    gradient, relative 1e-6) and refused, naming the first node that
    differs and its source line; skipped for meta tensors.
    """
    from parsat.importer.export import from_torch as run

    return run(module, example_inputs, library, name, check=check)


def parallelize(module, plan, example_inputs=None, *, imported=None, seed=0, dtype=None, runtime="interpreter",
                mp_policy=None, weight_names=None):
    """The module as `plan` runs it on this rank, under torchrun; call it on every rank.

    `runtime="torch"` lowers the plan onto PyTorch's own distributed stack
    (`parsat.backend.torch_native.entry.parallelize_native`, docs/TORCH_NATIVE.md):
    the user's module itself comes back, its forward its own, run on this
    rank's local batch, every parameter a DTensor on the plan's mesh
    (tensor parallelism as `parallelize_module` styles, data parallelism as
    `replicate`, ZeRO as `fully_shard`, with `mp_policy` if given); where
    the plan computes otherwise than the module's graph (an algebraic
    rewrite) and `example_inputs` or `imported` is given, its forward is
    replaced by one computing the plan's graph on its parameters
    (`torch_native/rewritten.py`), so
    `clip_grad_norm_`, optimizers, `torch.distributed.checkpoint`,
    `torch.compile` and autocast work unchanged; a plan torch's pieces
    cannot express is refused, naming the node. `example_inputs` or
    `imported`, when given, have the module's graph compared with the plan's;
    `weight_names` (graph weight -> parameter name) names the plan's weights
    in a module that names them otherwise. A pipelined plan needs
    `example_inputs` (one step's local batch) and returns a
    `PipelinedModule` (`torch.distributed.pipelining` stages and schedule):
    the loop calls `model.step(*batch)` instead of forward and backward, and
    `model.clip_grad_norm_` for the norm over every stage.

    The default, `runtime="interpreter"`, is `parsat.backend.parallelize.parallelize`:
    the plan's nodes interpreted one by one (the `--check` reference). Every
    rank passes the same global batch to the result's forward; its
    parameters are this rank's pieces of the module's own weights. Give
    `example_inputs` (the module is exported again to know how its inputs
    feed the plan's graph) or, to skip that second export, `imported`: the
    module's `ImportedModule` from `parsat.importer.export.import_module(module,
    inputs)`, whose `.graph` is what `from_torch` returns.
    """
    if runtime == "torch":
        if dtype is not None or seed != 0:
            raise ValueError("runtime='torch' runs the module's own forward: cast the module yourself (dtype=) and "
                             "seed torch's generator (seed=); mp_policy= sets a mixed-precision policy")
        from parsat.backend.torch_native.entry import parallelize_native

        return parallelize_native(module, plan, mp_policy=mp_policy, example_inputs=example_inputs,
                                  imported=imported, weight_names=weight_names)
    if runtime != "interpreter":
        raise ValueError(f"runtime must be 'interpreter' or 'torch', got {runtime!r}")
    if mp_policy is not None or weight_names is not None:
        raise ValueError("mp_policy= and weight_names= are for runtime='torch' (the interpreter takes dtype=)")
    from parsat.backend.parallelize import parallelize as run

    return run(module, plan, example_inputs, imported=imported, seed=seed, dtype=dtype)


def gather_weights(pmodule):
    """The trained weights written back into the user's module; its `state_dict()` (call on every rank)."""
    from parsat.backend.parallelize import gather_weights as run

    return run(pmodule)


def load_rules(paths=None):
    """The checked `Library` of the given files or folders (default: shipped).

    Raises `parsat.dsl.errors.DslError` listing every diagnostic.
    """
    from parsat.dsl.checker import load_checked

    return load_checked(paths)


def check(paths=None):
    """A `CheckReport` (diagnostics and counts) for files or folders."""
    from parsat.dsl.checker import check_paths

    return check_paths(paths)


def verify(rules=None, **options):
    """`[Verdict]` for a `Library`, files or folders (default: shipped); see `parsat.verifier.api`."""
    from parsat.verifier.api import verify as run

    return run(rules, **options)
