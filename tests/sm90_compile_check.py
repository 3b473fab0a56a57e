"""Compile our Triton kernels for sm_90 (Hopper) on a machine without a GPU, and report on them.

Run as a script (``python tests/sm90_compile_check.py``) in a process where ``TRITON_INTERPRET`` is
unset: under the interpreter ``@triton.jit`` functions cannot be compiled. Prints one JSON object:
``{variant: {"ok": bool, "error": str, "fma_bf16": int, "evict_first_loads_before_first_store": int,
"registers": int, "spill_bytes": int, "barriers": int}}``. ``tests/test_kernels_compile_for_sm90.py`` runs it
and asserts on the result:
a kernel that compiles under the CPU interpreter can still fail Triton's compiler (the interpreter
does not type-check both branches of an ``if``), and only the real compiler shows whether a rounded
product was contracted into a bf16 FMA.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from fusion_pass.kernels import qk_norm_rope_cache_triton as forward
from fusion_pass.kernels import qkv_rope_qk_norm_backward_triton as backward

TARGET = GPUTarget("cuda", 90, 32)


@triton.jit
def _rope_sum_without_round_sum(a_ptr, b_ptr, c_ptr, d_ptr, out_ptr, BLOCK: tl.constexpr):
    """``round(round(a*b) + round(c*d))`` in bf16 with a plain add: contracted into an FMA."""
    offs = tl.arange(0, BLOCK)
    a = tl.load(a_ptr + offs).to(tl.float32)
    b = tl.load(b_ptr + offs).to(tl.float32)
    c = tl.load(c_ptr + offs).to(tl.float32)
    d = tl.load(d_ptr + offs).to(tl.float32)
    ab = (a * b).to(tl.bfloat16).to(tl.float32)
    cd = (c * d).to(tl.bfloat16).to(tl.float32)
    tl.store(out_ptr + offs, (ab + cd).to(tl.bfloat16))
# Scalars that must not be assumed divisible by 16 (the launcher passes them unaligned too).
UNALIGNED = {"q_eps", "k_eps", "attention_scaling", "seq_len", "GQ", "GK", "GV", "NTT_Q", "NTT_KV",
             "stride_cache_position", "stride_pos_s", "CS_PROGRAMS", "PA", "PB", "NHB", "NB", "P"}


def _contracted_bf16_fmas(ptx: str) -> int:
    """bf16 FMAs that fuse a product with a real addend: what contraction of a rounded product and
    an add makes. Not counted: round_sum's own ``fma.rn.bf16x2(a, one, b)`` and the compiler's
    products written as an FMA with a zero addend (a register set to +0 or -0 pairs)."""
    zeros = set(re.findall(r"mov\.b(?:16|32)\s+(%r[s]?\d+),\s*(?:0|0x0000|-0|-2147450880|0x80008000|-32768|0x8000);", ptx))
    count = 0
    for dst_args in re.findall(r"\bfma\.rn\.bf16(?:x2)?\s+([^;]*);", ptx):
        args = [a.strip() for a in dst_args.split(",")]
        if "one" in args or args[-1] in zeros:
            continue
        count += 1
    return count


def compile_variant(fn, pointer_types: dict, constexprs: dict, float_args: set, options: dict) -> dict:
    """Compile ``fn`` for sm_90 with the given constexprs; every other argument is an int (i32),
    a float (fp32) or a pointer (``pointer_types[name]``, default ``*bf16``), and ints and pointers
    are declared 16-divisible unless listed in UNALIGNED (as Triton specializes typical launches)."""
    signature = {}
    for name in fn.arg_names:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name.endswith("_ptr"):
            signature[name] = pointer_types.get(name, "*bf16")
        elif name in float_args:
            signature[name] = float_args[name] if isinstance(float_args, dict) else "fp32"
        else:
            signature[name] = "i32"
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(fn.arg_names)
             if signature[name] not in ("constexpr", "fp32", "fp64") and name not in UNALIGNED}
    kernel = triton.compile(ASTSource(fn, signature, constexprs, attrs), target=TARGET, options=options)
    ptx = kernel.asm["ptx"]
    ptxas = [triton.knobs.nvidia.ptxas.path, "-v", "--gpu-name=sm_90a", "-o", os.devnull]
    with open(os.path.join(os.environ.get("TMPDIR", "/tmp"), f"sm90_{os.getpid()}.ptx"), "w") as f:
        f.write(ptx)
    info = subprocess.run(ptxas + [f.name], capture_output=True, text=True).stderr
    os.unlink(f.name)
    registers = re.search(r"Used (\d+) registers", info)
    spills = re.search(r"(\d+) bytes spill stores", info)
    first_store = ptx.find("st.global") % (len(ptx) + 1)  # the whole PTX when it stores nothing
    return dict(
        ok=True,
        fma_bf16=_contracted_bf16_fmas(ptx),
        # q/k/v tiles are loaded evict-first; counted in program order up to the first store.
        evict_first_loads_before_first_store=len(re.findall(r"ld\.global\.L1::evict_first", ptx[:first_store])),
        registers=int(registers.group(1)) if registers else -1,
        spill_bytes=int(spills.group(1)) if spills else -1,
        barriers=len(re.findall(r"\bbar\.sync\b", ptx)),
        # Per-element selects of 16-bit values: a ``tl.where`` between packed bf16 pairs unpacks them.
        half_selects=len(re.findall(r"\bselp\.b16\b", ptx)),
    )


def inductor_source(fn):
    """``fn`` as Inductor emits a user-defined kernel into its generated module: the source of the
    kernel and of every jit function it calls, rebuilt from
    ``user_defined_triton_kernel_transitive_closure_source_code`` in a module of their own (its
    imports as Inductor's wrapper has them). A helper imported under another name (``import f as
    g``) is emitted by its own name, and then no longer found: this compile catches that on CPU."""
    import importlib.util
    import tempfile

    from torch._inductor.codegen.wrapper import user_defined_triton_kernel_transitive_closure_source_code

    source = ("import triton\nimport triton.language as tl\n"
              "from torch._inductor.runtime.triton_helpers import libdevice, math as tl_math\n\n@triton.jit\n"
              + user_defined_triton_kernel_transitive_closure_source_code(fn))
    path = os.path.join(tempfile.mkdtemp(), f"inductor_{fn.__name__}.py")
    with open(path, "w") as f:
        f.write(source)
    spec = importlib.util.spec_from_file_location(f"inductor_{fn.__name__}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return getattr(module, fn.__name__)


def variants() -> dict:
    fwd_pointers = {"position_ids_ptr": "*i64", "cache_position_ptr": "*i64", "inv_freq_ptr": "*fp32"}
    fwd_floats = {"q_eps", "k_eps", "attention_scaling"}
    bwd_pointers = {"rq_ptr": "*fp32", "rk_ptr": "*fp32", "gw_ws_ptr": "*fp32", "cs_ws_ptr": "*fp32"}
    out = {}
    for rope_from_positions in (False, True):
        constexprs = dict(HEAD_DIM=128, HALF_BLOCK=64, HEADS_PER_PROGRAM=8, TOKENS_PER_PROGRAM=4, BLOCKS_PER_PROGRAM=1,
                          GROUP_MAJOR=False,
                          ROPE_FROM_POSITIONS=rope_from_positions, INTERPRETED=False, NORM_STYLE=0,
                          ROPE_FIRST=False, ROTARY_DIM=128,
                          INTERLEAVED=False)
        out[f"forward_bf16_d128{'_from_positions' if rope_from_positions else ''}"] = (
            forward._qk_norm_rope_cache_kernel, fwd_pointers, constexprs, fwd_floats,
            dict(num_warps=4))
    # The other RMSNorm forms (NORM_STYLE > 0: the Qwen3 form above is style 0) and RoPE before
    # the norm (HunYuan's order).
    others = {f"norm_{norm}": dict(NORM_STYLE=style) for style, norm in enumerate(forward.NORM_STYLES) if style}
    others["rope_first"] = dict(ROPE_FIRST=True)
    # Partial rotary (GLM-4.5 / Glm4Moe: the first 64 of 128 features rotated).
    others["partial_rotary_64"] = dict(ROTARY_DIM=64)
    # Interleaved (GPT-J) pairs, in both orders.
    others["interleaved"] = dict(INTERLEAVED=True)
    others["interleaved_rope_first"] = dict(INTERLEAVED=True, ROPE_FIRST=True)
    for suffix, change in others.items():
        out[f"forward_bf16_d128_{suffix}"] = (
            forward._qk_norm_rope_cache_kernel, fwd_pointers, dict(out["forward_bf16_d128"][2], **change), fwd_floats,
            dict(num_warps=4))
    # A bf16 autocast region over an fp32 model: bf16 q/k/v, fp32 weights, tables, outputs and k cache.
    out["forward_bf16_d128_autocast_fp32_outputs"] = (
        forward._qk_norm_rope_cache_kernel,
        dict(fwd_pointers, q_weight_ptr="*fp32", k_weight_ptr="*fp32", cos_ptr="*fp32", sin_ptr="*fp32",
             q_out_ptr="*fp32", k_out_ptr="*fp32", k_cache_ptr="*fp32"),
        out["forward_bf16_d128"][2], fwd_floats, dict(num_warps=4))
    # Gemma3's form under the same autocast: the norm rounds to bf16, RoPE to fp32.
    out["forward_bf16_d128_autocast_one_plus_weight"] = (
        out["forward_bf16_d128_autocast_fp32_outputs"][0], out["forward_bf16_d128_autocast_fp32_outputs"][1],
        dict(out["forward_bf16_d128"][2], NORM_STYLE=2), fwd_floats, dict(num_warps=4))
    # nn.RMSNorm with its weight kept in fp32 in a bf16 model.
    out["forward_bf16_d128_norm_fp32_weight_f32_weights"] = (
        forward._qk_norm_rope_cache_kernel, dict(fwd_pointers, q_weight_ptr="*fp32", k_weight_ptr="*fp32"),
        dict(out["forward_bf16_d128"][2], NORM_STYLE=1), fwd_floats, dict(num_warps=4))
    # The kernels as Inductor's generated code defines them (compiled graphs launch these), compiled
    # as Inductor compiles them: device asserts in (``assert_indirect_indexing``), no overflow checks.
    inductor_options = dict(num_warps=4, debug=True, sanitize_overflow=False)
    for name in ("forward_bf16_d128", "forward_bf16_d128_from_positions"):
        fn, pointers, constexprs, floats, options = out[name]
        # Inductor passes Python floats as fp64 scalars.
        out[f"{name}_as_inductor_emits_it"] = (inductor_source(fn), pointers, constexprs,
                                               {f: "fp64" for f in floats}, inductor_options)
    # The in-graph kernel (what compiled graphs launch): Qwen3-8B decode geometry as constexprs,
    # unused pointers None.
    layout = dict(Q_HEADS=32, KV_HEADS=8, CACHE_LEN=2048, STRIDE_Q_H=128, STRIDE_Q_S=4096, STRIDE_K_H=128,
                  STRIDE_K_S=1024, STRIDE_V_H=128, STRIDE_V_S=1024, STRIDE_QO_H=128, STRIDE_QO_S=4096,
                  STRIDE_KO_H=128, STRIDE_KO_S=1024, STRIDE_KC_B=8 * 2048 * 128, STRIDE_KC_H=2048 * 128,
                  STRIDE_KC_L=128, STRIDE_VC_B=8 * 2048 * 128, STRIDE_VC_H=2048 * 128, STRIDE_VC_L=128,
                  STRIDE_COS_S=128, STRIDE_SIN_S=128, STRIDE_POS_S=0, STRIDE_CACHE_POSITION=1,
                  Q_EPS=1e-6, K_EPS=1e-6, ATTENTION_SCALING=1.0)
    fn, pointers, constexprs, floats, options = out["forward_bf16_d128"]
    out["forward_graph_bf16_d128"] = (inductor_source(forward._qk_norm_rope_cache_graph_kernel), pointers,
                                      dict(constexprs, **layout, position_ids_ptr=None, inv_freq_ptr=None), set(),
                                      inductor_options)
    # From 256 tokens on (``launch_config``'s streaming tile): one head x 16 tokens per block, 4 blocks
    # per program, 4 warps; cos/sin read from tables, or computed from positions (Qwen3-Coder: 96/8 heads).
    streaming = dict({k: v for k, v in out["forward_graph_bf16_d128"][2].items()},
                     HEADS_PER_PROGRAM=1, TOKENS_PER_PROGRAM=16, BLOCKS_PER_PROGRAM=4, GROUP_MAJOR=True,
                     Q_HEADS=96,
                     STRIDE_Q_S=96 * 128, STRIDE_QO_S=96 * 128)
    out["forward_graph_bf16_d128_streaming"] = (out["forward_graph_bf16_d128"][0], pointers, streaming, set(),
                                               inductor_options)
    out["forward_graph_bf16_d128_streaming_interleaved"] = (out["forward_graph_bf16_d128"][0], pointers,
                                                           dict(streaming, INTERLEAVED=True), set(), inductor_options)
    # Partial rotary: GLM-4.5's (64 of 128 features rotated), and Qwen3.5's with Gemma3's ``1 + w`` norm.
    partial = dict(streaming, ROTARY_DIM=64, STRIDE_COS_S=64, STRIDE_SIN_S=64)
    out["forward_graph_bf16_d128_streaming_partial_rotary_64"] = (out["forward_graph_bf16_d128"][0], pointers,
                                                                 partial, set(), inductor_options)
    out["forward_graph_bf16_d128_streaming_partial_rotary_64_one_plus_weight"] = (
        out["forward_graph_bf16_d128"][0], pointers, dict(partial, NORM_STYLE=2), set(), inductor_options)
    for suffix, change in (("rope_first", dict(ROPE_FIRST=True)), ("partial_rotary_64", dict(ROTARY_DIM=64)),
                           ("rope_first_partial_rotary_64", dict(ROPE_FIRST=True, ROTARY_DIM=64)),
                           ("one_plus_weight", dict(NORM_STYLE=2))):
        out[f"forward_graph_bf16_d128_streaming_interleaved_{suffix}"] = (
            out["forward_graph_bf16_d128"][0], pointers, dict(streaming, INTERLEAVED=True, **change), set(),
            inductor_options)
    # head_dim 512 (Gemma4's full-attention layers: 32 query / 4 kv heads in the 31B model): the small
    # tile (8 rows of one token) and the streaming one (one head x 4 tokens per block: the same
    # elements per lane as D = 128's 16 tokens).
    d512 = dict(HEAD_DIM=512, HALF_BLOCK=256, ROTARY_DIM=512, Q_HEADS=32, KV_HEADS=4, STRIDE_Q_H=512,
                STRIDE_Q_S=32 * 512, STRIDE_K_H=512, STRIDE_K_S=4 * 512, STRIDE_V_H=512, STRIDE_V_S=4 * 512,
                STRIDE_QO_H=512, STRIDE_QO_S=32 * 512, STRIDE_KO_H=512, STRIDE_KO_S=4 * 512,
                STRIDE_KC_B=4 * 2048 * 512, STRIDE_KC_H=2048 * 512, STRIDE_KC_L=512, STRIDE_VC_B=4 * 2048 * 512,
                STRIDE_VC_H=2048 * 512, STRIDE_VC_L=512, STRIDE_COS_S=512, STRIDE_SIN_S=512)
    out["forward_graph_bf16_d512"] = (out["forward_graph_bf16_d128"][0], pointers,
                                      dict(out["forward_graph_bf16_d128"][2], **d512, HEADS_PER_PROGRAM=4,
                                           TOKENS_PER_PROGRAM=2), set(), inductor_options)
    out["forward_graph_bf16_d512_streaming"] = (out["forward_graph_bf16_d128"][0], pointers,
                                                dict(streaming, **d512, TOKENS_PER_PROGRAM=4), set(), inductor_options)
    out["forward_graph_bf16_d128_streaming_from_positions"] = (
        out["forward_graph_bf16_d128"][0], pointers,
        dict({k: v for k, v in streaming.items() if k not in ("position_ids_ptr", "inv_freq_ptr")},
             ROPE_FROM_POSITIONS=True, cos_ptr=None, sin_ptr=None, STRIDE_POS_S=1),
        set(), inductor_options)
    # Inductor's mutation analysis traces user kernels with their float arguments as Python constants.
    fn, pointers, constexprs, floats, options = out["forward_bf16_d128_as_inductor_emits_it"]
    out["forward_bf16_d128_floats_as_constants"] = (
        fn, pointers, dict(constexprs, q_eps=1e-6, k_eps=1e-6, attention_scaling=1.0), set(), options)
    # Control: the RoPE sum written without rounding.round_sum must show the bf16 FMAs that round_sum prevents.
    out["control_rope_sum_without_round_sum"] = (_rope_sum_without_round_sum, {}, dict(BLOCK=128), set(), dict(num_warps=4))
    for need in (False, True):
        constexprs = dict(HQ=32, HKV=8, D=128, HALF=64, BLOCK_HALF=64, BLOCK_D=128, BHQ=32, BTQ=1, BHK=8,
                          BTK=4, BHV=8, BTV=4, ROUND=1, INTERP=False, NEED_W=need, NEED_CS=need, NORM_FIRST=False,
                          ROUND_Y=1, NORM_STYLE=0, ROT_HALF=64)
        out[f"backward_elementwise_bf16_d128{'_with_grads' if need else ''}"] = (
            backward._qk_norm_rope_bwd_kernel, bwd_pointers, constexprs, set(),
            dict(num_warps=backward.ELEMENTWISE_NUM_WARPS))
    # v5 token rows: with both optional grads and cos/sin written directly (suite B at large M),
    # through the workspace (head slices: small M), and with neither.
    rows_pointers = dict(bwd_pointers, gc_ptr="*bf16", gs_ptr="*bf16")
    for suffix, need, direct, slices in (("", False, False, 1), ("_with_grads", True, True, 1),
                                         ("_with_grads_sliced", True, False, 4)):
        constexprs = dict(HQ=32, HKV=8, D=128, HALF=64, BLOCK_HALF=64, BLOCK_D=128, BT=backward.ROWS_TOKENS, NS=slices,
                          ROUND=1, CS_ROUND=1, INTERP=False, NEED_W=need, NEED_CS=need, CS_DIRECT=direct,
                          STAGES=backward.ROWS_STAGES, NORM_FIRST=False, ROUND_Y=1, NORM_STYLE=0, ROT_HALF=64)
        out[f"backward_rows_bf16_d128{suffix}"] = (
            backward._qk_norm_rope_bwd_rows_kernel, rows_pointers, constexprs, set(),
            dict(num_warps=backward.ROWS_NUM_WARPS))
    for name in ("backward_elementwise_bf16_d128_with_grads", "backward_rows_bf16_d128_with_grads"):
        fn, pointers, constexprs, floats, options = out[name]
        out[f"{name}_as_inductor_emits_it"] = (inductor_source(fn), pointers, constexprs, floats, options)
    for need_w, need_cs in ((True, True), (True, False), (False, True)):
        constexprs = dict(D=128, BLOCK_P=256, BLOCK_L=32, BLOCK_T=16, BLOCK_2D=256, W_ROUND=1, CS_ROUND=1,
                          NEED_W=need_w, NEED_CS=need_cs, RW=128)
        out[f"backward_finish_w{int(need_w)}_cs{int(need_cs)}"] = (
            backward._finish_partials_kernel, {"gw_ws_ptr": "*fp32", "cs_ws_ptr": "*fp32"}, constexprs,
            set(), dict(num_warps=4))
    out["backward_finish_w1_cs1_as_inductor_emits_it"] = (inductor_source(backward._finish_partials_kernel),
                                                         *out["backward_finish_w1_cs1"][1:])
    # The graph entries (static shapes: every size and stride a constexpr), B 2, S 2048, 32/8 heads,
    # D 128, q/k pre-RoPE as views of the [B, S, 6144] projection, grads [B, H, S, D] contiguous.
    S, W, M = 2048, (32 + 16) * 128, 2 * 2048
    layout = dict(gq_sb=32 * S * 128, gq_sh=S * 128, gq_ss=128, gk_sb=8 * S * 128, gk_sh=S * 128, gk_ss=128,
                  gv_sb=8 * S * 128, gv_sh=S * 128, gv_ss=128, q_sb=S * W, q_ss=W, q_sh=128, k_sb=S * W, k_ss=W,
                  k_sh=128, rq_sb=32 * S, rq_sh=S, rq_ss=1, rk_sb=8 * S, rk_sh=S, rk_ss=1, cos_sb=0, cos_ss=128,
                  sin_sb=0, sin_ss=128, dq_sb=S * W, dq_ss=W, dk_off=32 * 128, dk_sb=S * W, dk_ss=W,
                  dv_off=40 * 128, dv_sb=S * W, dv_ss=W, M=M, S=S)
    for name, entry, sizes in (
            ("backward_elementwise_bf16_d128_with_grads", backward._qk_norm_rope_bwd_graph_kernel,
             dict(GQ=8, GK=8, GV=8, NTT_Q=128, NTT_KV=32)),
            ("backward_rows_bf16_d128_with_grads", backward._qk_norm_rope_bwd_rows_graph_kernel, dict(P=132))):
        fn, pointers, constexprs, floats, options = out[name]
        out[name.replace("backward", "backward_graph")] = (
            inductor_source(entry), pointers, dict(constexprs, **layout, **sizes), floats, options)
    # Qwen3's order (norm, then RoPE): the same graph entries with NORM_FIRST.
    for name in ("backward_graph_elementwise_bf16_d128_with_grads", "backward_graph_rows_bf16_d128_with_grads"):
        fn, pointers, constexprs, floats, options = out[name]
        out[f"{name}_norm_first"] = (fn, pointers, dict(constexprs, NORM_FIRST=True), floats, options)
    # The per-tensor training family (one tensor: HKV 0): the fp32 norm forms, and autocast's fp32
    # grads, tables and weights with a bf16 x (Qwen3's form, norm first).
    fn, pointers, constexprs, floats, options = out["backward_graph_rows_bf16_d128_with_grads_norm_first"]
    one_tensor = dict(constexprs, HKV=0)
    for style in (1, 2):
        out[f"backward_graph_rows_one_tensor_norm_style{style}"] = (
            fn, pointers, dict(one_tensor, NORM_STYLE=style), floats, options)
    fp32_operands = {name: "*fp32" for name in ("gq_ptr", "gk_ptr", "gv_ptr", "cos_ptr", "sin_ptr", "wq_ptr",
                                                 "wk_ptr", "gc_ptr", "gs_ptr")}
    out["backward_graph_rows_one_tensor_autocast"] = (
        fn, dict(pointers, **fp32_operands), dict(one_tensor, ROUND_Y=0, CS_ROUND=0), floats, options)
    # Partial rotary, GLM-4.5's half of a 128-wide head (tables 64 wide), in both tilings.
    partial = dict(ROT_HALF=32, cos_ss=64, sin_ss=64)
    out["backward_graph_rows_one_tensor_partial_rotary"] = (fn, pointers, dict(one_tensor, **partial), floats, options)
    fn, pointers, constexprs, floats, options = out["backward_graph_elementwise_bf16_d128_with_grads_norm_first"]
    out["backward_graph_elementwise_partial_rotary"] = (fn, pointers, dict(constexprs, **partial), floats, options)
    fn, pointers, constexprs, floats, options = out["backward_finish_w1_cs1"]
    out["backward_graph_finish_w1_cs1"] = (
        inductor_source(backward._finish_partials_graph_kernel), pointers,
        dict(constexprs, PA=132, PB=132, R=S, M=M, S=S, NHB=1, NB=2, CS_PROGRAMS=128), floats, options)
    return out


def main() -> int:
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("unset TRITON_INTERPRET: the interpreter cannot compile kernels", file=sys.stderr)
        return 2
    report = {}
    for name, (fn, pointers, constexprs, floats, options) in variants().items():
        try:
            report[name] = compile_variant(fn, pointers, constexprs, floats, options)
        except Exception as e:  # noqa: BLE001 - reported per variant, the test asserts on it
            report[name] = dict(ok=False, error=f"{type(e).__name__}: {e}"[-2000:])
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
