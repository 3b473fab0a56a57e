"""A compiled Qwen3-style prologue called with a cache position past its cache, in its own process
(a device-side assert leaves the CUDA context unusable):
``python out_of_range_check.py DEVICE fusion|stock|op asserts|no_asserts`` (``op``: the op called
eagerly). Prints one JSON line:
matches, and whether the cache rows in range were written and the others left alone; a failed
assert ends the process with an error instead, as stock torch.compile's ``index_copy_`` does.
Run by ``test_kernels_in_graph.test_gpu_out_of_range_position_asserts_like_stock_compile``."""

from __future__ import annotations

import json
import sys

import torch
import torch._inductor.config as inductor_config

import fusion_pass
from qwen3_style import Qwen3StylePrologue, make_inputs


def main(device: str, variant: str, asserts: str) -> dict:
    torch.manual_seed(0)
    model = Qwen3StylePrologue(hidden=256, q_heads=8, kv_heads=2, head_dim=128).to(device, torch.bfloat16)
    hidden, cos, sin, k_cache, v_cache, _ = (t.to(device) for t in make_inputs(
        seq=3, hidden=256, kv_heads=2, head_dim=128, cache_len=16))
    positions = torch.tensor([2, 16, 5], device=device)  # 16 rows: the second is past the cache
    before = k_cache.clone()
    options = fusion_pass.options(devices=device) if variant == "fusion" else {}
    with inductor_config.patch(assert_indirect_indexing=asserts == "asserts"), torch.no_grad():
        if variant == "op":  # an eager caller of the op
            q, k, v = (torch.randn(2, h, 3, 128, device=device).to(torch.bfloat16) for h in (8, 2, 2))
            weight = torch.ones(128, device=device, dtype=torch.bfloat16)
            torch.ops.fusion_pass.qk_norm_rope_cache(q, k, v, weight, weight, cos, sin,
                                                     k_cache, v_cache, positions, 1e-6, 1e-6)
        else:
            torch.compile(model, options=options)(hidden, cos, sin, k_cache, v_cache, positions)
        torch.cuda.synchronize() if device == "cuda" else None
    untouched = [r for r in range(16) if r not in (2, 5)]
    return dict(matches=fusion_pass.match_counts().get("qk_norm_rope_cache", 0),
                rows_in_range_written=bool((k_cache[:, :, [2, 5]] != before[:, :, [2, 5]]).any()),
                other_rows_untouched=bool(torch.equal(k_cache[:, :, untouched], before[:, :, untouched])))


if __name__ == "__main__":
    print(json.dumps(main(*sys.argv[1:4])))
