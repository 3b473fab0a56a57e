"""A torch.compile backend that runs every pass Inductor runs before code generation, ours included,
then executes the graphs eagerly: the fusions, their containment and their numerics without
Inductor's C++ code generation (~11 s a graph on the CI machines).

Training graphs: AOT autograd with Inductor's decompositions, Inductor's joint-graph passes (the
training hook, ``joint_custom_pre_pass``) and its partitioner. Forward, backward and inference graphs:
``view_to_reshape`` and Inductor's post-grad passes (the forward hook, ``post_grad_custom_pre_pass``,
then Inductor's own patterns and re-inplacing), as ``compile_fx`` runs them.
"""

from __future__ import annotations

import torch
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.aot_autograd import make_boxed_func
from torch._functorch.partitioners import min_cut_rematerialization_partition
from torch._inductor import config as inductor_config
from torch._inductor.decomposition import select_decomp_table
from torch._inductor.fx_passes.joint_graph import joint_graph_passes
from torch._inductor.fx_passes.post_grad import post_grad_passes, view_to_reshape
from torch._inductor.virtualized import V
from torch._subclasses.fake_tensor import FakeTensorMode


def _fake_mode(inputs) -> FakeTensorMode:
    """The inputs' fake mode, as compile_fx takes it (a fresh one where no input is fake)."""
    return torch._guards.detect_fake_mode(inputs) or FakeTensorMode(allow_non_fake_inputs=True)


def graph_only_backend(options: dict | None = None):
    """The backend (a fresh one per call: AOT autograd keeps per-backend state).

    Args:
        options: Inductor config values held while the passes run, as ``torch.compile(model,
            options=...)`` holds them for Inductor (e.g. ``fusion_pass.options()``'s hooks).
    """
    options = dict(options or {})

    def partition(gm, joint_inputs, **kwargs):
        with inductor_config.patch(options), V.set_fake_mode(_fake_mode(joint_inputs)):
            joint_graph_passes(gm)
        return min_cut_rematerialization_partition(gm, joint_inputs, compiler="inductor", **kwargs)

    def compiler(is_inference: bool):
        def compile_graph(gm: torch.fx.GraphModule, example_inputs):
            with inductor_config.patch(options), V.set_fake_mode(_fake_mode(example_inputs)):
                if is_inference:  # compile_fx runs the joint-graph passes on inference graphs too
                    joint_graph_passes(gm)
                view_to_reshape(gm)
                post_grad_passes(gm, is_inference)
            gm.recompile()
            return make_boxed_func(gm.forward)

        return compile_graph

    return aot_autograd(fw_compiler=compiler(False), bw_compiler=compiler(False), inference_compiler=compiler(True),
                        partition_fn=partition, decompositions=select_decomp_table(),
                        keep_inference_input_mutations=True)


#: ``graph_only_backend`` by name, for clients that take a backend name (transformers' Trainer and
#: ``generate``'s ``CompileConfig``).
BACKEND_NAME = "fusion_pass_graph_only"


@torch._dynamo.register_backend(name=BACKEND_NAME)
def _named_backend(gm, example_inputs, **kwargs):
    return graph_only_backend()(gm, example_inputs, **kwargs)
