"""The per-head RMSNorm as model code writes it: the Hugging Face building blocks that the
forward and training families trace into their search patterns.

Each ``NormForm`` pairs one spelling (``fn``, op for op as transformers writes it) with the fused
kernels' ``norm`` argument that computes it bit for bit. Seven forms: Qwen3's ``weight *
n.to(dtype)``; Gemma3's (also Qwen3-Next's and Qwen3.5's) ``n * (1 + weight)`` in fp32;
``torch.nn.RMSNorm`` / ``F.rms_norm`` with and without a weight; Gemma3n's and Gemma4's
``x * pow(ms, -0.5) * weight`` with and without a scale; AFMoE's ``(weight * n).to(dtype)``.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from fusion_pass.kernels.qk_norm_rope_cache_reference import (
    gemma3n_rms_norm_reference,
    gemma_rms_norm_reference,
    rms_norm_reference,
    torch_rms_norm_reference,
    weight_first_fp32_rms_norm_reference,
)


@dataclasses.dataclass(frozen=True)
class NormForm:
    """One spelling of per-head RMSNorm in model code.

    style: the op's ``norm`` argument that computes it bit for bit (``NORM_STYLES``).
    fn: the model code, ``fn(x, weight, eps)`` (weight None for weight-free forms); traced,
        it is the graph matched.
    casts_weight: the graph has ``weight.float()``, which an fp32 weight (autocast over an fp32
        model) does not have: the training family registers such forms once more for autocast.
    copies_strided_input: the graph has a ``clone`` when the norm's input is dense but not
        contiguous (torch's rms_norm decomposition makes its result contiguous; the fp32 upcast
        of a sliced input is contiguous already): with the ``"bhsd"`` layout, whose input is
        Hugging Face's transposed view or a contiguous tensor, such forms are registered twice.
    """

    style: str
    fn: Callable
    copies_strided_input: bool = False
    casts_weight: bool = False

    @property
    def weighted(self) -> bool:
        return self.style != "no_weight"


NORM_FORMS = {
    "qwen3": NormForm("weight", rms_norm_reference),
    "gemma3": NormForm("fp32_one_plus_weight", gemma_rms_norm_reference, casts_weight=True),
    "torch_rms_norm": NormForm("fp32_weight", torch_rms_norm_reference, copies_strided_input=True),
    "torch_rms_norm_no_weight": NormForm("no_weight", lambda x, weight, eps: torch_rms_norm_reference(x, None, eps),
                                         copies_strided_input=True),
    "gemma3n": NormForm("fp32_weight", gemma3n_rms_norm_reference, casts_weight=True),
    "afmoe": NormForm("fp32_weight", weight_first_fp32_rms_norm_reference),
    "pow_no_weight": NormForm("no_weight", lambda x, weight, eps: gemma3n_rms_norm_reference(x, None, eps)),
}
