"""One model family through the passes as a user's compile takes it: inference and a training step.

``stage(family, training)`` builds the family's tiny model (``model_families``) and compiles it, in
strict mode (a fault of ours raises), with every family of the pass installed: on CPU through
Inductor's passes without code generation (``graph_backend``), on CUDA through the whole of
Inductor, the pass's Triton kernels included:

- inference, bf16: a ``StaticCache`` prefill of 8 tokens and one decode step where the model takes a
  static cache (``_can_compile_fullgraph``), else one forward; MRoPE models get positions whose t,
  h and w axes differ;
- training, fp32: one ``loss.backward()`` (a text decoder without an LM head: the mean square of
  its hidden states along a fixed random direction).

It returns what a test asserts on: fusions per pass family and stage, whether every graph was handed
back as the hooks got it, and each result's error against eager next to stock compile's (the same
backend without the pass, run only where something fused: elsewhere the graphs are stock's).
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch
import torch._inductor.config as inductor_config

import fusion_pass
from fusion_pass.install import FORWARD_HOOK, TRAINING_HOOK
from graph_backend import graph_only_backend
from model_families import ModelFamily, build

PREFILL, CACHE_LEN, BATCH = 8, 16, 2


class GraphRecorder:
    """Wraps a hook's pass: each graph's code and meta keys before and after it."""

    def __init__(self, inner):
        self.inner, self.before, self.after = inner, [], []

    @staticmethod
    def state(graph: torch.fx.Graph):
        return graph.python_code("self").src, [(n.name, sorted(n.meta)) for n in graph.nodes]

    def __call__(self, graph, is_inference=None):
        self.before.append(self.state(graph))
        self.inner(graph, is_inference=is_inference)
        self.after.append(self.state(graph))

    def unchanged(self) -> bool:
        return self.before == self.after

    def uuid(self):
        return None


@dataclasses.dataclass
class StageResult:
    """One stage (inference or training) of one family."""

    fusions: dict[str, int]  # pass family -> count
    near_misses: dict[str, int]  # "family: reason" -> count
    unchanged: bool  # every graph handed back as the hooks got it
    errors: dict[str, float]  # result (output, cache, loss, gradient) -> ours against eager
    stock_errors: dict[str, float] | None  # the same for stock compile (None: not run)


def _relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item() if b.numel() else 0.0


def _errors(results: dict[str, torch.Tensor], eager: dict[str, torch.Tensor]) -> dict[str, float]:
    """Each result's error against eager's, by name. A gradient one side leaves None is zero there
    (compiled steps give unused parameters, a pooler under an LM loss, zero gradients)."""
    return {name: _relative_error(results[name] if name in results else torch.zeros_like(eager[name]),
                                  eager[name] if name in eager else torch.zeros_like(results[name]))
            for name in {**eager, **results}}


def _positions(model, seq: int, start: int = 0) -> dict:
    """position_ids for MRoPE models, one row of positions per section, the rows distinct (t, h, w and
    HunYuan-VL's fourth axis: [axes, B, S]); nothing for the others."""
    rope = getattr(model.config, "rope_parameters", None) or {}
    axes = len(rope.get("mrope_section") or ())
    if not axes:
        return {}
    t = torch.arange(start, start + seq)
    rows = torch.stack([t, t // 2 + 1, t % 3 + 2, t // 3][:axes])
    return {"position_ids": rows[:, None, :].expand(axes, BATCH, seq).clone().to(model.device)}


def _outputs(out) -> torch.Tensor:
    return out.logits if hasattr(out, "logits") and out.logits is not None else out.last_hidden_state


def _ids(model) -> torch.Tensor:
    return torch.randint(3, 100, (BATCH, PREFILL), generator=torch.Generator().manual_seed(1)).to(model.device)


def _inference(model, compiled) -> dict[str, torch.Tensor]:
    from transformers import StaticCache

    ids = _ids(model)
    with torch.no_grad():
        if not getattr(model, "_can_compile_fullgraph", False):
            return {"output": _outputs(compiled(input_ids=ids, use_cache=False))}
        cache = StaticCache(config=model.config, max_cache_len=CACHE_LEN)
        prefill = _outputs(compiled(input_ids=ids, past_key_values=cache, use_cache=True, **_positions(model, PREFILL)))
        step = ids[:, -1:]
        decode = _outputs(compiled(input_ids=step, past_key_values=cache, use_cache=True,
                                   cache_position=torch.tensor([PREFILL], device=model.device),
                                   **_positions(model, 1, PREFILL)))
        results = {"prefill": prefill, "decode": decode}
        for i, layer in enumerate(cache.layers):
            for kind in ("keys", "values"):
                value = getattr(layer, kind, None)
                if isinstance(value, torch.Tensor):
                    results[f"layer {i} {kind}"] = value.clone()
        return results


def _training(model, compiled) -> dict[str, torch.Tensor]:
    ids = _ids(model)
    if hasattr(model, "lm_head") or "CausalLM" in type(model).__name__ or "ConditionalGeneration" in type(model).__name__:
        out = compiled(input_ids=ids, labels=ids, use_cache=False, **_positions(model, PREFILL))
        loss = out.loss
    else:
        out = compiled(input_ids=ids, use_cache=False, **_positions(model, PREFILL))
        hidden = _outputs(out).float()
        # hidden states along a fixed random direction: their mean square would be the final norm's
        # constant (unit RMS), a loss whose gradients before that norm are rounding noise
        direction = torch.randn(hidden.shape, generator=torch.Generator().manual_seed(2)).to(hidden.device)
        loss = (hidden * direction).mean()
    loss.backward()
    return {"loss": loss.detach(), **{n: p.grad for n, p in model.named_parameters() if p.grad is not None}}


def _backend(device: str):
    return graph_only_backend() if device == "cpu" else "inductor"


def _run(family: ModelFamily, training: bool, backend, device: str) -> dict[str, torch.Tensor]:
    torch._dynamo.reset()
    model = build(family, torch.float32 if training else torch.bfloat16).to(device)
    model.train(training)
    compiled = model if backend is None else torch.compile(model, backend=backend)
    return (_training if training else _inference)(model, compiled)


def eager(family: ModelFamily, training: bool, device: str = "cpu") -> dict[str, torch.Tensor]:
    """The stage's results in eager (no compile)."""
    return _run(family, training, None, device)


def stage(family: ModelFamily, training: bool, device: str = "cpu", tolerance: float = 0.0,
          compare: bool = True) -> StageResult:
    """Eager, then with the pass (strict, every family, graphs on ``device``), then stock compile where
    something fused and a result is further than ``tolerance`` from eager (elsewhere nothing needs
    stock's error: unfused graphs are stock's, and results within tolerance pass as they are).
    ``compare=False`` (a family expected to fuse nothing, whose graphs are checked unchanged instead)
    runs neither eager nor stock: ``errors`` is then empty."""
    eager = _run(family, training, None, device) if compare else None
    fusion_pass.reset_report()
    fusion_pass.install(devices=device, strict=True)
    recorders = {hook: GraphRecorder(getattr(inductor_config, hook)) for hook in (FORWARD_HOOK, TRAINING_HOOK)}
    try:
        with inductor_config.patch(**recorders):
            ours = _run(family, training, _backend(device), device)
    finally:
        fusions = fusion_pass.match_counts()
        near_misses = {f"{m.family}: {m.reason}": n for m, n in fusion_pass.near_misses().items()}
        fusion_pass.uninstall()
    stock_results = None
    errors = _errors(ours, eager) if compare else {}
    if fusions and max(errors.values(), default=0.0) > tolerance:
        stock_results = _run(family, training, _backend(device), device)
    return StageResult(
        fusions=fusions,
        near_misses=near_misses,
        unchanged=all(r.unchanged() for r in recorders.values()),
        errors=errors,
        stock_errors=None if stock_results is None else _errors(stock_results, eager),
    )


def stock_failure(family: ModelFamily, training: bool, device: str = "cpu") -> BaseException | None:
    """What stock compile (the same backend, no pass) raises on the stage; None when it runs."""
    fusion_pass.uninstall()
    try:
        _run(family, training, _backend(device), device)
    except Exception as error:  # noqa: BLE001 - reported by the caller
        return error
    return None


@contextlib.contextmanager
def quiet():
    """transformers' warnings about tiny configs (ids, deprecated arguments) off."""
    import warnings

    import transformers

    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        transformers.logging.set_verbosity(verbosity)
