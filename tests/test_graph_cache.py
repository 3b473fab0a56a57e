"""The passes and Inductor's FX graph cache: a warm cache serves the fused graph, a changed
configuration never gets a graph compiled under another one."""

from __future__ import annotations

import torch
from torch._dynamo.utils import counters
from torch._inductor.utils import fresh_cache

import fusion_pass
from qwen3_style import Qwen3StylePrologue, make_inputs


def _compile_and_run(model, inputs, devices):
    torch._dynamo.reset()
    compiled = torch.compile(model, options=fusion_pass.options(devices=devices, families=("qk_norm_rope_cache",)))
    with torch.no_grad():
        return compiled(*inputs)


def test_warm_cache_serves_the_fused_graph_and_a_config_change_misses():
    model = Qwen3StylePrologue().to(torch.bfloat16)
    inputs = make_inputs()
    with torch.no_grad():
        q_ref, _ = model(*[t.clone() if isinstance(t, torch.Tensor) else t for t in inputs])
    # The autouse fixture disables caches; this test is about them.
    with torch._inductor.config.patch(force_disable_caches=False, fx_graph_cache=True), fresh_cache():
        hits, misses = counters["inductor"]["fxgraph_cache_hit"], counters["inductor"]["fxgraph_cache_miss"]
        q_cold, _ = _compile_and_run(model, [t.clone() for t in inputs[:5]] + [inputs[5]], ("cpu",))
        assert fusion_pass.match_counts() == {"qk_norm_rope_cache": 1}
        assert counters["inductor"]["fxgraph_cache_miss"] == misses + 1

        # Warm: the graph comes from the cache, the pass does not run (nothing counted), and
        # the served graph is the fused one (bit-exact like the fused compile, unlike stock).
        fusion_pass.reset_report()
        q_warm, _ = _compile_and_run(model, [t.clone() for t in inputs[:5]] + [inputs[5]], ("cpu",))
        assert counters["inductor"]["fxgraph_cache_hit"] == hits + 1
        assert fusion_pass.match_counts() == {}
        assert torch.equal(q_cold, q_ref) and torch.equal(q_warm, q_ref)

        # Another configuration is another uuid: a cache miss, compiled under the new config
        # (CPU graphs are then not rewritten).
        q_other, _ = _compile_and_run(model, [t.clone() for t in inputs[:5]] + [inputs[5]], ("cuda",))
        assert counters["inductor"]["fxgraph_cache_miss"] == misses + 2
        assert fusion_pass.match_counts() == {}
        torch.testing.assert_close(q_other, q_ref, rtol=2e-2, atol=5e-2)
        # ...which rounds like stock Inductor: what makes the bit-exact checks above mean "fused".
        assert not torch.equal(q_other, q_ref)
