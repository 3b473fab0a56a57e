"""A fault inside a family never breaks the user's compile (``fusion_pass.transaction``).

A fault is injected into each family at each stage it goes through (registering its patterns,
rewriting the graph into canonical form, matching, checking a match, building the replacement,
and after the whole family ran): the compile must go on, the graph the hook hands back must be the
graph it got (names, arguments, order, meta keys), the model's results must be stock compile's
bit for bit, and the fault must be reported, counted and warned about once. Strict mode re-raises.
The models are transformers' own (Qwen3 for the forward and per-tensor training families,
HunYuanDenseV1 for the projection family), compiled through Inductor's passes without code
generation (``graph_backend``).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import warnings

import pytest
import torch
import torch._inductor.config as inductor_config
from torch._dynamo.utils import counters

import fusion_pass
from fusion_pass import passes, rewrites
from fusion_pass.install import FORWARD_HOOK, TRAINING_HOOK
from fusion_pass.match_report import COUNTER_KEY, INTERNAL_ERRORS_KEY
from fusion_pass.patterns import qk_norm_rope_backward, qk_norm_rope_cache, qkv_rope_qk_norm
from graph_backend import graph_only_backend

GEOMETRY = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                num_hidden_layers=2, vocab_size=128, max_position_embeddings=64)


class InjectedFault(Exception):
    pass


#: family -> stage -> (the pattern module's function that faults, whether it raises after running:
#: then the graph is already changed, and must be put back). Two stages fault the same way in every
#: family: "rewrite" (the last of the family's ``REWRITES``, after it ran) and "finish" (the undos of
#: the rewrites, after they ran: the whole family has run then).
FAULTS = {
    "qk_norm_rope_cache": {
        "register": ("register", False), "match": ("apply_first_to_last", True),
        "check": ("_aliasing_reason", False), "replace": ("_fused", False)},
    "qkv_rope_qk_norm": {
        "register": ("register", False), "match": ("_check", False), "check": ("_semantics_problem", False),
        "replace": ("_fused_op", False)},
    "qk_norm_rope_backward": {
        "register": ("register", False), "match": ("_find_region", False), "check": ("_refusal", False),
        "replace": ("_replace", True)},
}
STAGES = ["register", "rewrite", "match", "check", "replace", "finish"]
MODULES = {"qk_norm_rope_cache": qk_norm_rope_cache, "qkv_rope_qk_norm": qkv_rope_qk_norm,
           "qk_norm_rope_backward": qk_norm_rope_backward}
FUSIONS = {"qk_norm_rope_cache": 2, "qkv_rope_qk_norm": 2, "qk_norm_rope_backward": 4}


def _model(family: str):
    from transformers import HunYuanDenseV1Config, HunYuanDenseV1ForCausalLM, Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    if family == "qkv_rope_qk_norm":
        return HunYuanDenseV1ForCausalLM(HunYuanDenseV1Config(**GEOMETRY, use_cache=False))
    model = Qwen3ForCausalLM(Qwen3Config(**GEOMETRY))
    return model.to(torch.bfloat16).eval() if family == "qk_norm_rope_cache" else model


def _run(family: str, model) -> list[torch.Tensor]:
    """One compiled call: a StaticCache prefill (the forward family; logits and caches) or a training
    step (logits and every gradient)."""
    from transformers import StaticCache

    compiled = torch.compile(model, backend=graph_only_backend())
    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(1))
    if family == "qk_norm_rope_cache":
        cache = StaticCache(config=model.config, max_cache_len=16)
        with torch.no_grad():
            logits = compiled(input_ids=ids, past_key_values=cache, use_cache=True).logits
        return [logits, *(t for layer in cache.layers for t in (layer.keys, layer.values))]
    out = compiled(input_ids=ids, labels=ids)
    out.loss.backward()
    return [out.logits.detach(), *(p.grad for p in model.parameters() if p.grad is not None)]


class _Recorder:
    """Wraps our pass in a hook: each graph's code (node names, arguments, order) and meta keys, before
    and after it."""

    def __init__(self, inner):
        self.inner, self.before, self.after = inner, [], []

    @staticmethod
    def _state(graph):
        return graph.python_code("self").src, [(n.name, sorted(n.meta)) for n in graph.nodes]

    def __call__(self, graph, is_inference=None):
        self.before.append(self._state(graph))
        self.inner(graph, is_inference=is_inference)
        self.after.append(self._state(graph))

    def uuid(self):
        return None


@functools.lru_cache(maxsize=None)
def _stock(family: str) -> tuple[torch.Tensor, ...]:
    torch._dynamo.reset()
    return tuple(_run(family, _model(family)))


def _faulty(function, family: str, after: bool):
    def faulty(*args, **kwargs):
        if after:
            function(*args, **kwargs)
        raise InjectedFault(f"injected into {family}.{function.__name__}")

    return faulty


def _inject(monkeypatch, family: str, stage: str) -> None:
    module = MODULES[family]
    if stage == "rewrite":
        *first, last = module.REWRITES
        monkeypatch.setattr(module, "REWRITES", (*first, dataclasses.replace(last, run=_faulty(last.run, family, True))))
        return
    if stage == "finish":
        monkeypatch.setattr(rewrites, "undo_rewrites", _faulty(rewrites.undo_rewrites, family, True))
        return
    name, after = FAULTS[family][stage]
    monkeypatch.setattr(module, name, _faulty(getattr(module, name), family, after))
    if stage == "register":  # registration happens once per process: make this compile register again
        passes._family_pass.cache_clear()


@pytest.fixture
def registrations_restored():
    yield
    passes._family_pass.cache_clear()  # a registration made under a fault is not kept


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("family", sorted(FAULTS))
def test_a_fault_leaves_the_graph_as_it_was_and_the_compile_as_stock(family, stage, monkeypatch,
                                                                     registrations_restored):
    stock = _stock(family)
    torch._dynamo.reset()
    fusion_pass.reset_report()
    _inject(monkeypatch, family, stage)
    fusion_pass.install(devices="cpu", families=family, strict=False)
    hook = FORWARD_HOOK if family == "qk_norm_rope_cache" else TRAINING_HOOK
    recorder = _Recorder(getattr(inductor_config, hook))
    with inductor_config.patch(**{hook: recorder}), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        results = _run(family, _model(family))
    assert recorder.before and recorder.after == recorder.before  # every graph handed back unchanged
    assert len(results) == len(stock) and all(torch.equal(a, b) for a, b in zip(results, stock))
    assert fusion_pass.match_counts() == {}
    errors = fusion_pass.internal_errors()
    assert errors and {e.family for e in errors} == {family}, fusion_pass.report()
    assert {e.error_type for e in errors} == {"InjectedFault"}
    assert all(e.where.startswith(("patterns/", "fusion_pass/")) for e in errors)  # our innermost frame
    assert counters[COUNTER_KEY][INTERNAL_ERRORS_KEY] == sum(errors.values())
    assert f"{family}: InjectedFault: injected into {family}." in fusion_pass.report()
    ours = [w for w in caught if "fusion_pass: internal error" in str(w.message)]
    # Warned once per family and exception type in a process: here, or by an earlier test of the same worker.
    assert len(ours) <= 1


@pytest.mark.parametrize("family", sorted(FAULTS))
def test_without_a_fault_the_same_compile_fuses(family):
    """The control: the injection points above are on the path these compiles take."""
    stock = _stock(family)
    torch._dynamo.reset()
    fusion_pass.reset_report()
    fusion_pass.install(devices="cpu", families=family, strict=False)
    results = _run(family, _model(family))
    assert fusion_pass.match_counts() == {family: FUSIONS[family]}, fusion_pass.report()
    assert fusion_pass.internal_errors() == {}
    logits_error = (results[0].float() - stock[0].float()).abs().max() / stock[0].float().abs().max()
    assert logits_error < 2e-2


def test_strict_mode_raises_the_fault(monkeypatch):
    _inject(monkeypatch, "qk_norm_rope_backward", "match")
    fusion_pass.install(devices="cpu", families="qk_norm_rope_backward", strict=True)
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed, match="InjectedFault"):
        _run("qk_norm_rope_backward", _model("qk_norm_rope_backward"))
    assert fusion_pass.internal_errors() == {}


def test_strict_follows_the_environment_unless_install_says(monkeypatch):
    monkeypatch.setenv("FUSION_PASS_STRICT", "1")
    assert fusion_pass.config.FusionConfig().is_strict()
    assert not fusion_pass.config.FusionConfig(strict=False).is_strict()
    monkeypatch.setenv("FUSION_PASS_STRICT", "0")
    assert not fusion_pass.config.FusionConfig().is_strict()
    assert fusion_pass.config.FusionConfig(strict=True).is_strict()


def test_the_warning_comes_once_per_family_and_exception_type(monkeypatch):
    from fusion_pass import transaction

    monkeypatch.setattr(transaction, "_warned", set())
    graph = torch.fx.Graph()
    graph.output(graph.placeholder("x"))
    before = graph.python_code("self").src

    def fault(error):
        def apply():
            graph.call_function(torch.ops.aten.neg.default, (next(iter(graph.nodes)),))  # changes the graph
            raise error
        return apply

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for error in (KeyError("a"), KeyError("b"), ValueError("c")):
            assert transaction.apply_contained("qk_norm_rope_cache", graph, lambda: True, fault(error), strict=False) == 0
            assert graph.python_code("self").src == before
    assert [str(w.message).split("(")[1].split(":")[0] for w in caught] == ["KeyError", "ValueError"]
    assert sum(fusion_pass.internal_errors().values()) == 3


def test_a_malformed_graph_left_by_a_family_is_a_contained_fault():
    """``graph.lint()`` after the family: a node used before it is defined is caught there, not in
    Inductor's next pass."""
    from fusion_pass import transaction

    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    graph.output(graph.call_function(torch.ops.aten.neg.default, (x,)))
    before = graph.python_code("self").src

    def misorder():
        neg = next(n for n in graph.nodes if n.op == "call_function")
        with graph.inserting_before(neg):
            late = graph.call_function(torch.ops.aten.relu.default, (neg,))
        neg.args = (late,)  # a cycle: no topological order exists
        return 1  # said to have fused (a family that fused nothing is put back anyway)

    assert transaction.apply_contained("qk_norm_rope_cache", graph, lambda: True, misorder, strict=False) == 0
    assert graph.python_code("self").src == before
    assert {e.family for e in fusion_pass.internal_errors()} == {"qk_norm_rope_cache"}


def test_the_snapshot_restores_names_and_meta():
    gm = torch.fx.symbolic_trace(lambda x, y: (x + y).relu() * 2)
    graph = gm.graph
    for node in graph.nodes:
        node.meta["mark"] = node.name
    before = graph.python_code("self").src
    from fusion_pass.transaction import GraphSnapshot

    snapshot = GraphSnapshot(graph)
    for node in list(graph.nodes):
        if node.op == "call_function" or node.op == "call_method":
            node.replace_all_uses_with(next(iter(graph.nodes)))
            graph.erase_node(node)
            break
    node = next(iter(graph.nodes))
    node.meta["mark"] = "changed"
    snapshot.restore()
    assert graph.python_code("self").src == before
    assert [n.meta["mark"] for n in graph.nodes] == [n.name for n in graph.nodes]
    assert gm(torch.ones(2), torch.ones(2)).tolist() == [4.0, 4.0]
    copy.deepcopy(gm)  # still a well-formed module


def test_a_family_that_fused_nothing_hands_back_the_graph_it_got():
    """Canonical rewrites no fusion used are put back: the graphs of models the pass does not fuse are
    stock Inductor's, node for node (names and meta keys included)."""
    from fusion_pass import transaction

    gm = torch.fx.symbolic_trace(lambda x: x.sum(-1) / x.shape[-1])
    graph = gm.graph
    before = graph.python_code("self").src

    def rewrite_without_fusing():
        node = next(n for n in graph.nodes if n.op == "call_method")
        with graph.inserting_after(node):
            mean = graph.call_method("mean", (node.args[0], -1))
        node.meta["rewritten"] = True
        next(u for u in node.users).replace_input_with(node, mean)
        return 0

    assert transaction.apply_contained("qk_norm_rope_cache", graph, lambda: True, rewrite_without_fusing,
                                       strict=True) == 0
    assert graph.python_code("self").src == before
    assert all("rewritten" not in n.meta for n in graph.nodes)
    assert fusion_pass.internal_errors() == {}
