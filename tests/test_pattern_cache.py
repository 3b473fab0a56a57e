"""``fusion_pass.pattern_cache``: traced patterns written once, loaded by later processes, exactly."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode, unset_fake_temporarily

from fusion_pass import pattern_cache
from fusion_pass.patterns import qkv_rope_qk_norm


def _tracing():
    """As ``fusion_pass.passes`` registers: no compile context, fresh fake mode, autograd on."""
    import contextlib

    stack = contextlib.ExitStack()
    for ctx in (torch._guards.tracing(None), unset_fake_temporarily(), FakeTensorMode(), torch.inference_mode(False)):
        stack.enter_context(ctx)
    return stack


@pytest.mark.parametrize("name", ["fused_nobias_lowp_joint_normgrad_ropeconst",
                                  "separate_bias_fp32_joint_normfrozen_ropegrad",
                                  "fused_nobias_lowp_joint_normgrad_ropeconst_normfirst"])
def test_a_training_pattern_survives_the_round_trip_through_source(name):
    """Printed and rebuilt, the pattern prints the same and has the same structure (repr), shared
    sub-patterns and the list arguments (``cat``, ``split_with_sizes``) included."""
    with _tracing():
        (registration,) = [r for r in qkv_rope_qk_norm.registrations() if r.name == name]
        pattern = registration.trace()
    source = pattern_cache.to_source(pattern)
    rebuilt = pattern_cache.from_source(source)
    assert pattern_cache.to_source(rebuilt) == source
    assert_same_structure(pattern, rebuilt)
    assert "*" not in source  # no sub-pattern written as its repr


def assert_same_structure(a, b, seen=None, path="pattern"):
    """The same types, containers and attribute values everywhere, and the same sharing: an object
    that occurs twice in ``a`` occurs twice in ``b`` as one object (the matcher keys on identity)."""
    seen = {} if seen is None else seen
    assert type(a) is type(b), (path, type(a), type(b))
    if isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same_structure(x, y, seen, f"{path}[{i}]")
    elif isinstance(a, dict):
        assert list(a) == list(b), path
        for k in a:
            assert_same_structure(a[k], b[k], seen, f"{path}[{k!r}]")
    elif hasattr(a, "__dict__") and not callable(a):
        if id(a) in seen:
            assert seen[id(a)] is b, f"{path}: shared in the traced pattern, not in the rebuilt one"
            return
        seen[id(a)] = b
        assert sorted(vars(a)) == sorted(vars(b)), path
        for k, v in vars(a).items():
            assert_same_structure(v, vars(b)[k], seen, f"{path}.{k}")
    else:
        assert a == b, (path, a, b)


def test_traced_once_then_loaded(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    traces = []

    def trace():
        traces.append(1)
        with _tracing():
            return qkv_rope_qk_norm.registrations()[0].trace()

    first = pattern_cache.traced_pattern("probe", trace)
    path = pattern_cache.pattern_path("probe")
    assert path.startswith(str(tmp_path)) and os.path.exists(path) and len(traces) == 1
    second = pattern_cache.traced_pattern("probe", trace)
    assert len(traces) == 1 and repr(second) == repr(first) and second is not first
    # A damaged file is traced again and replaced.
    with open(path, "w") as f:
        f.write("pattern = (")
    third = pattern_cache.traced_pattern("probe", trace)
    assert len(traces) == 2 and repr(third) == repr(first)
    assert repr(pattern_cache.traced_pattern("probe", trace)) == repr(first) and len(traces) == 2
    # Switched off: traced every time, nothing read.
    monkeypatch.setenv(pattern_cache.ENV_SWITCH, "0")
    pattern_cache.traced_pattern("probe", trace)
    assert len(traces) == 3


def test_the_file_is_keyed_by_torch_and_the_sources(tmp_path, monkeypatch):
    from fusion_pass.source_hash import source_hash

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    path = pattern_cache.pattern_path("probe")
    monkeypatch.setattr(torch, "__version__", torch.__version__ + "+other")
    assert pattern_cache.pattern_path("probe") != path
    monkeypatch.undo()
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    source_hash.cache_clear()
    monkeypatch.setattr("fusion_pass.pattern_cache.source_hash", lambda: "edited")
    assert pattern_cache.pattern_path("probe") != path
    monkeypatch.undo()
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    assert pattern_cache.pattern_path("probe", "other inputs") != path == pattern_cache.pattern_path("probe")


def test_a_file_under_another_key_is_replaced(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    old = pattern_cache.pattern_path("probe", "old inputs")
    os.makedirs(os.path.dirname(old), exist_ok=True)
    with open(old, "w") as f:
        f.write("pattern = None\n")

    def trace():
        with _tracing():
            return qkv_rope_qk_norm.registrations()[0].trace()

    pattern_cache.traced_pattern("probe", trace, "new inputs")
    assert os.listdir(os.path.dirname(old)) == [os.path.basename(pattern_cache.pattern_path("probe", "new inputs"))]


def test_a_container_the_source_cannot_rebuild_is_refused():
    import collections

    from torch._inductor.pattern_matcher import CallFunction, Ignored

    pair = collections.namedtuple("pair", "a b")
    with pytest.raises(TypeError, match="pair"):
        pattern_cache.to_source(CallFunction(torch.ops.aten.cat.default, pair(Ignored(), Ignored())))


FRESH_PROCESS = r"""
import json, sys, time, torch
import fusion_pass
from fusion_pass import passes
t0 = time.perf_counter()
passes._family_pass("qkv_rope_qk_norm")
registration_s = time.perf_counter() - t0
torch._inductor.config.force_disable_caches = True
sys.path.insert(0, sys.argv[1])
from qkv_rope_qk_norm_models import FusedQKVAttention, rope_tables
block = FusedQKVAttention()
cos, sin = rope_tables(5)
hidden = torch.randn(2, 5, 64, requires_grad=True)
compiled = torch.compile(block, options=fusion_pass.options(devices=("cpu",)))
compiled(hidden, cos, sin).sum().backward()
print(json.dumps(dict(registration_s=registration_s, fused=fusion_pass.match_counts().get("qkv_rope_qk_norm", 0))))
"""


@pytest.mark.slow
def test_a_fresh_process_with_a_warm_cache_registers_in_a_second_and_fuses():
    """Once this process has registered the training family (tracing its 48 patterns, 21-38 s on
    the 2-core CI machine, unless an earlier process left them on disk), a fresh process loads them
    from Inductor's cache dir instead of tracing, and fuses a block with them."""
    from fusion_pass import passes

    passes._family_pass("qkv_rope_qk_norm")
    assert all(os.path.exists(pattern_cache.pattern_path(f"qkv_rope_qk_norm_{r.name}", r.signature()))
               for r in _registrations())
    here = os.path.dirname(os.path.abspath(__file__))
    done = subprocess.run([sys.executable, "-c", FRESH_PROCESS, here], capture_output=True, text=True, cwd=here,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    run = json.loads(done.stdout.strip().splitlines()[-1])
    assert run["fused"] == 1 and run["registration_s"] < 8.0, run  # warm: ~1.2 s; traced: 21-38 s


def _registrations():
    with _tracing():
        return qkv_rope_qk_norm.registrations()
