"""Traced search patterns kept on disk between processes.

unfused (before): every process traced each registered variant at its first compile, e.g. the
training family's 48 forward + backward traces (``joint_fwd_bwd``): 21-38 s on a 2-core CPU,
before the first training graph could even be matched.

cached: the first process writes each traced pattern as Python source, in the form Inductor ships
its own pre-traced patterns in (``PatternPrettyPrinter``; ``torch/_inductor/fx_passes/
serialized_patterns``), to ``<Inductor's cache dir>/fusion_pass_patterns/``; later processes
execute that source instead of tracing. A file is named by the variant and keyed by torch's
build (version and git commit), this package's sources (``source_hash``) and the variant's example
inputs, so a new torch, an edited pattern or other example inputs trace afresh (and the variant's
files under older keys are removed); a file that fails to load is traced again and rewritten.
``FUSION_PASS_PATTERN_CACHE=0`` turns the cache off (every process traces).

Given a pre-traced pattern, ``register_replacement`` skips its match-time re-trace of the search
function with the graph's own shapes, the step that checks every int (slice bounds, view sizes)
the traced pattern leaves open. A family that relies on it wraps its check in ``retraced_check``,
which does that re-trace as ``register_replacement`` does it without a pre-traced pattern.
"""

from __future__ import annotations

import functools
import glob
import hashlib
import inspect
import itertools
import logging
import operator
import os
from typing import Callable

import torch
from torch._inductor import pattern_matcher
from torch._inductor.pattern_matcher import Match, PatternExpr, PatternPrettyPrinter, _TargetArgsExpr, fx_to_pattern, is_match
from torch.fx.experimental.symbolic_shapes import statically_known_true
from torch.fx.immutable_collections import immutable_dict, immutable_list

from .source_hash import source_hash

log = logging.getLogger(__name__)

#: Set to "0" to trace every pattern in every process.
ENV_SWITCH = "FUSION_PASS_PATTERN_CACHE"


def cache_dir() -> str:
    """``fusion_pass_patterns`` under Inductor's cache directory (``TORCHINDUCTOR_CACHE_DIR``)."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir as inductor_cache_dir

    return os.path.join(inductor_cache_dir(), "fusion_pass_patterns")


def inputs_signature(example_inputs: list) -> str:
    """The part of a ``signature`` that the example inputs give: each one's shape, strides, dtype
    and ``requires_grad`` (a trace can depend on every one of them)."""
    return repr([(tuple(t.shape), t.stride(), str(t.dtype), t.requires_grad) for t in example_inputs])


def pattern_path(name: str, signature: str = "") -> str:
    """The file of variant ``name`` for this torch build, these sources and ``signature`` (what the
    trace depends on beyond the sources: ``inputs_signature`` and any other argument of the trace)."""
    build = f"{torch.__version__}\0{torch.version.git_version}"
    key = hashlib.sha256(f"{build}\0{source_hash()}\0{name}\0{signature}".encode()).hexdigest()[:20]
    return os.path.join(cache_dir(), f"{name}-{key}.py")


class _Printer(PatternPrettyPrinter):
    """Inductor's printer (written for its attention patterns), made exact for ours:

    - list and tuple arguments (``cat``'s tensors, ``split``'s sizes) are printed item by item (it
      ``repr``s them, i.e. writes sub-patterns as ``*``), and FX's ``immutable_list`` stays one
      (the matcher compares argument containers by type);
    - argument patterns (``KeywordArg``, ``ExclusiveKeywordArg``, ``Ignored``) are shared as in the
      traced pattern (an exclusive argument that appears twice must stay one object, or its second
      occurrence fails to match), with the ``users`` count the tracer gave them.
    """

    def pretty_print(self, obj):
        rebuildable = (list, tuple, dict, immutable_list, immutable_dict)
        if isinstance(obj, (list, tuple, dict)) and type(obj) not in rebuildable:
            raise TypeError(f"cannot write a {type(obj).__name__} argument into a pattern's source")
        if isinstance(obj, (list, tuple)):
            items = ", ".join(self.pretty_print(x) for x in obj)
            if isinstance(obj, immutable_list):
                return f"immutable_list([{items}])"
            return f"[{items}]" if isinstance(obj, list) else f"({items}{',' if len(obj) == 1 else ''})"
        if isinstance(obj, dict):
            items = ", ".join(f"{k!r}: {self.pretty_print(v)}" for k, v in obj.items())
            return f"immutable_dict({{{items}}})" if isinstance(obj, immutable_dict) else f"{{{items}}}"
        if isinstance(obj, PatternExpr) and not isinstance(obj, _TargetArgsExpr):
            if obj not in self.memoized_objs_names:
                source = obj.pretty_print(self) if hasattr(type(obj), "pretty_print") else repr(obj)
                if hasattr(obj, "users"):
                    source = f"_with_users({source}, {obj.users!r})"
                self.memoized_objs_names[obj] = self.namespace.create_name(type(obj).__name__.lower(), None)
                self.memoized_objs_pp[obj] = source
            return self.memoized_objs_names[obj]
        return super().pretty_print(obj)


def _with_users(pattern: PatternExpr, users) -> PatternExpr:
    pattern.users = users
    return pattern


def to_source(pattern: PatternExpr) -> str:
    """Python source that rebuilds ``pattern`` as the variable ``pattern`` (``PatternPrettyPrinter.run``'s
    layout: one line per shared sub-pattern, then the pattern)."""
    printer = _Printer()
    out = pattern.pretty_print(pp=printer)
    lines = [f"{name} = {printer.memoized_objs_pp[obj]}" for obj, name in printer.memoized_objs_names.items()]
    return "\n".join([*lines, f"pattern = {out}"])


@functools.lru_cache(maxsize=1)
def _names() -> dict:
    """What the printed source refers to: torch, the op namespaces and the pattern classes."""
    names = {"torch": torch, "aten": torch.ops.aten, "prims": torch.ops.prims, "operator": operator,
             "immutable_list": immutable_list, "immutable_dict": immutable_dict, "_with_users": _with_users}
    names.update({name: value for name, value in vars(pattern_matcher).items() if isinstance(value, type)})
    return names


def from_source(source: str) -> PatternExpr:
    """The pattern that ``to_source``'s output builds."""
    namespace = dict(_names())
    exec(compile(source, "<fusion_pass pattern>", "exec"), namespace)  # noqa: S102 - our own file, see module docstring
    return namespace["pattern"]


def traced_pattern(name: str, trace: Callable[[], PatternExpr], signature: str = "") -> PatternExpr:
    """Variant ``name``'s pattern: loaded from its file, or ``trace()``d and written there (files of
    the same name under other keys, left by other sources or another torch, are removed).

    Args:
        name: a name unique among this package's registrations (letters, digits, ``_``).
        trace: traces the pattern (e.g. ``gen_pattern(search_fn, example_inputs, trace_fn, ...)``).
        signature: what else the trace depends on (``pattern_path``).
    """
    if os.environ.get(ENV_SWITCH, "1") == "0":
        return trace()
    path = pattern_path(name, signature)
    try:
        with open(path) as f:
            return from_source(f.read())
    except FileNotFoundError:
        pass
    except Exception as e:  # noqa: BLE001 - a damaged file is traced again and replaced
        log.warning("fusion_pass: re-tracing pattern %s, its cached file %s failed to load: %s", name, path, e)
    pattern = trace()
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        partial = f"{path}.{os.getpid()}.tmp"
        with open(partial, "w") as f:
            f.write(to_source(pattern) + "\n")
        os.replace(partial, path)  # atomic: a concurrent reader sees the whole file or none
        for stale in glob.glob(os.path.join(glob.escape(os.path.dirname(path)), f"{name}-*.py")):
            if stale != path:
                os.remove(stale)
    except OSError as e:
        log.warning("fusion_pass: could not cache pattern %s at %s: %s", name, path, e)
    return pattern


def retraced_check(search_fn: Callable, trace_fn: Callable, scalar_workaround: dict, exclusive_arg_names: tuple,
                   extra_check: Callable[[Match], bool]) -> Callable[[Match], bool]:
    """``extra_check`` behind the match-time re-trace that ``register_replacement`` skips when given a
    pre-traced pattern (``search_fn_pattern``): ``search_fn`` traced with ``trace_fn`` on the matched
    values' shapes, strides and dtypes (sizes that are SymInts become inputs of the trace, as
    Inductor does it), must match at the same output node; then ``extra_check`` decides on that
    match. Patterns with every int checked this way need no check of their own for them.

    Args:
        search_fn, trace_fn, scalar_workaround, exclusive_arg_names: as given to ``register_replacement``
            (``search_fn``'s parameters are flat: tensors and scalars).
        extra_check: the registration's own check.
    """
    argnames = list(inspect.signature(search_fn).parameters)

    def check(match: Match) -> bool:
        # A wildcard stands for a tensor unless it is one of the scalars: a Python number bound to it (a
        # weight-free norm times a constant read as a weighted norm) is no match, and cannot be re-traced.
        if any(not isinstance(match.kwargs[name], torch.fx.Node)
               or not isinstance(match.kwargs[name].meta.get("val"), torch.Tensor)
               for name in argnames if name not in scalar_workaround):
            return False
        args = list(torch.fx.map_arg([match.kwargs[name] for name in argnames], lambda node: node.meta["val"]))
        fake_mode = torch._dynamo.utils.detect_fake_mode(args)
        sym_args: list = []
        with fake_mode:
            for i, arg in enumerate(args):
                if isinstance(arg, torch.Tensor):
                    args[i] = torch.empty_strided(arg.size(), arg.stride(), dtype=arg.dtype, device=arg.device)
                    for v in itertools.chain(args[i].shape, args[i].stride()):
                        if isinstance(v, torch.SymInt) and all(statically_known_true(v != a) for a in sym_args):
                            sym_args.append(v)
            try:
                if sym_args:
                    # The sizes as leading inputs (Inductor's way): make_fx would otherwise dedupe their
                    # size queries into the pattern, where the real graph's users differ.
                    def search_with_sizes(*args_and_sizes):
                        return search_fn(*args_and_sizes[len(sym_args):])

                    graph = trace_fn(search_with_sizes, sym_args + args)
                    placeholders = [n for n in graph.graph.nodes if n.op == "placeholder"]
                    names = [p.target for p in placeholders[:len(sym_args)]]
                    for placeholder, name in zip(placeholders[len(sym_args):], argnames):
                        with graph.graph.inserting_after(placeholder):
                            renamed = graph.graph.placeholder(name)
                        renamed.target = renamed.name
                        placeholder.replace_all_uses_with(renamed)
                        graph.graph.erase_node(placeholder)
                    names += argnames
                else:
                    graph = trace_fn(search_fn, args)
                    names = argnames
            except RuntimeError as e:
                log.debug("fusion_pass: re-trace of %s failed: %s", getattr(search_fn, "__name__", search_fn), e)
                return False
            specific = fx_to_pattern(graph, argnames=names, exclusive_arg_names=exclusive_arg_names,
                                     scalar_workaround=scalar_workaround)
        specific_match = specific.match(match.output_nodes()[0])
        return is_match(specific_match) and extra_check(specific_match)

    return check
