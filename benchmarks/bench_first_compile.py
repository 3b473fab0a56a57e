"""What the pass adds to a user's first compile: stock vs with the pass, each in a fresh process.

    python benchmarks/bench_first_compile.py --out DIR [--rounds 3] [--device cpu|cuda]

Cases: a 2-layer Hugging Face ``Qwen3ForCausalLM`` prefill (StaticCache; the inference family) and a
``Qwen3ForCausalLM`` training step (forward + backward; the training family), tiny random configs.
Each (case, variant) runs in a process of its own, so the pass's pattern registration (traced, or
loaded from ``fusion_pass.pattern_cache``) counts as a user's first compile pays it; Inductor's FX
graph caches are off, its kernel cache is warmed by one untimed process per case first, so both
variants compile the same kernels warm. Variants take turns (stock, pass, then pass, stock, ...)
and the medians are reported, with the pass's registration time measured inside its process.
Writes DIR/<date>-first-compile.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

CHILD = r"""
import json, sys, time, torch
sys.path[:] = [p for p in sys.path if p not in ("", ".")]
import fusion_pass, transformers
from fusion_pass import passes
case, variant, device = sys.argv[1:4]
torch._inductor.config.force_disable_caches = False
torch._inductor.config.fx_graph_cache = False
torch._functorch.config.enable_autograd_cache = False
config = transformers.Qwen3Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64)
model = transformers.Qwen3ForCausalLM(config).to(device)
ids = torch.randint(0, 128, (2, 7), device=device)
options = fusion_pass.options(devices=(device,)) if variant == "pass" else None
registration = {}
if variant == "pass":  # time every family the compile registers
    original = passes._family_pass.__wrapped__
    def timed(f):
        t = time.perf_counter(); out = original(f); registration[f] = time.perf_counter() - t; return out
    passes._family_pass = __import__("functools").lru_cache(maxsize=None)(timed)
t0 = time.perf_counter()
if case == "prefill":
    model = model.to(torch.bfloat16).eval()
    cache = transformers.StaticCache(config=config, max_cache_len=32)
    pos = torch.arange(7, device=device)
    with torch.no_grad():
        torch.compile(model, options=options)(input_ids=ids, past_key_values=cache, cache_position=pos,
                                              position_ids=pos[None].expand(2, -1), use_cache=True)
else:
    torch.compile(model, options=options)(input_ids=ids, labels=ids).loss.backward()
if device == "cuda":
    torch.cuda.synchronize()
seconds = time.perf_counter() - t0
print(json.dumps(dict(seconds=seconds, registration=sum(registration.values()),
                      fused=fusion_pass.match_counts())))
"""


def run(case: str, variant: str, device: str) -> dict:
    done = subprocess.run([sys.executable, "-c", CHILD, case, variant, device], capture_output=True, text=True,
                          timeout=1200, cwd=os.path.dirname(os.path.abspath(__file__)))
    if done.returncode != 0:
        raise RuntimeError(f"{case} {variant}: rc {done.returncode}\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    args = p.parse_args()
    from bench_common import result_header  # imports torch: only the timed children need not

    os.makedirs(args.out, exist_ok=True)
    result = dict(**result_header("first-compile"), device=args.device, rounds=args.rounds, cases={})
    for case in ("prefill", "train"):
        run(case, "pass", args.device)  # warms Inductor's kernel cache and the pattern cache
        samples = {"stock": [], "pass": []}
        for r in range(args.rounds):
            for variant in (("stock", "pass") if r % 2 == 0 else ("pass", "stock")):
                samples[variant].append(run(case, variant, args.device))
        med = {v: statistics.median(s["seconds"] for s in samples[v]) for v in samples}
        result["cases"][case] = dict(
            stock_s=med["stock"], pass_s=med["pass"], difference_s=med["pass"] - med["stock"],
            registration_s=statistics.median(s["registration"] for s in samples["pass"]),
            fused=samples["pass"][0]["fused"], samples=samples)
        print(case, json.dumps({k: v for k, v in result["cases"][case].items() if k != "samples"}), flush=True)
    path = os.path.join(args.out, f"{result['date']}-first-compile")
    with open(path + ".json", "w") as f:
        json.dump(result, f, indent=1)
    lines = [f"# First compile, stock vs the pass ({args.device}, torch {result['torch']}, {result['date']})", "",
             "Median of fresh processes taking turns; the pattern cache warm (the usual state after a machine's "
             "first run).", "",
             "| case | stock s | with the pass s | difference s | pattern registration s | fused |",
             "|---|---|---|---|---|---|"]
    for case, c in result["cases"].items():
        lines.append(f"| {case} | {c['stock_s']:.1f} | {c['pass_s']:.1f} | {c['difference_s']:+.1f} | "
                     f"{c['registration_s']:.1f} | {c['fused']} |")
    with open(path + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
