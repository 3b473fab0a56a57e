"""A Qwen3-style decode step with its K/V cache as buffers, exported and compiled by AOTInductor
into a package, loaded back and run for three steps, in its own process (a crash in
``aoti_load_package`` then fails one test, not the run):
``python aoti_decode_check.py DEVICE fusion|stock PACKAGE_PATH``. Prints one JSON line: matches,
the largest errors against eager, whether the package's C++ launches our kernel or names a
``fusion_pass`` op. Run by ``test_kernels_in_graph.test_aoti_package_of_a_decode_step_runs_fused``."""

from __future__ import annotations

import copy
import json
import sys
import zipfile

import torch

import fusion_pass
from qwen3_style import Qwen3StylePrologue, make_inputs

BF16 = torch.bfloat16


class DecodeStepWithCache(torch.nn.Module):
    """A Qwen3-style prologue with its K/V cache as module buffers, as an exported decode step
    holds it. (transformers' ``TorchExportableModuleWithStaticCache`` does not get through
    AOTInductor with torch 2.13 even without the pass: ``aot_export_module`` rejects its
    ``cumulative_length.copy_`` of a lifted tensor.)"""

    def __init__(self, prologue, batch, kv_heads, cache_len, head_dim):
        super().__init__()
        self.prologue = prologue
        self.register_buffer("k_cache", torch.randn(batch, kv_heads, cache_len, head_dim).to(BF16))
        self.register_buffer("v_cache", torch.randn(batch, kv_heads, cache_len, head_dim).to(BF16))

    def forward(self, hidden_states, cos, sin, cache_position):
        return self.prologue(hidden_states, cos, sin, self.k_cache, self.v_cache, cache_position)


def main(device: str, variant: str, path: str) -> dict:
    torch.manual_seed(0)
    prologue = Qwen3StylePrologue(hidden=256, q_heads=8, kv_heads=2, head_dim=128)
    model = DecodeStepWithCache(prologue, batch=2, kv_heads=2, cache_len=16, head_dim=128).to(device, BF16)
    eager = copy.deepcopy(model)
    steps = []
    for position in (3, 4, 5):
        hidden, cos, sin, *_ = make_inputs(seq=1, hidden=256, kv_heads=2, head_dim=128, cache_len=16, seed=position)
        steps.append((hidden.to(device), cos.to(device), sin.to(device), torch.tensor([position], device=device)))
    options = fusion_pass.options(devices=device) if variant == "fusion" else {}
    q_err = out_err = 0.0
    with torch.no_grad():
        program = torch.export.export(copy.deepcopy(model), steps[0], strict=False)
        path = torch._inductor.aoti_compile_and_package(program, package_path=path, inductor_configs=options)
        matches = fusion_pass.match_counts().get("qk_norm_rope_cache", 0)
        print(f"compiled {path}, {matches} match(es); loading", file=sys.stderr, flush=True)
        loaded = torch._inductor.aoti_load_package(path)
        for inputs in steps:  # each step reads the cache rows the previous ones wrote
            q_ref, out_ref = eager(*inputs)
            q, out = loaded(*inputs)
            q_err = max(q_err, float((q.float() - q_ref.float()).abs().max() / q_ref.float().abs().max()))
            out_err = max(out_err, float((out.float() - out_ref.float()).abs().max()))
    with zipfile.ZipFile(path) as package:
        wrapper = "\n".join(package.read(name).decode(errors="replace") for name in package.namelist()
                            if name.endswith(".cpp"))
    return dict(matches=matches, q_err=q_err, out_err=out_err, kernel_in_package="_qk_norm_rope_cache" in wrapper,
                op_in_package="fusion_pass" in wrapper, torch=torch.__version__)


if __name__ == "__main__":
    print(json.dumps(main(*sys.argv[1:4])))
