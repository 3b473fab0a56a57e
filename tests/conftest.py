import os
import sys

# `python -m pytest` puts the repository root on sys.path, where transformers (probing for the
# Hugging Face `kernels` package) would import our kernels/ folder a second time as top-level
# `kernels` and register the fusion_pass ops twice. The installed package is what tests import.
_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _REPO_ROOT]

# One process per core (`pytest -n auto`): Inductor's pool of compile workers and OpenMP's threads
# in every test process would oversubscribe the cores (a fifth of the suite on 2 cores: 322 s as
# they were, 308 s with one OpenMP thread, 278 s with Inductor compiling in the test process).
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

# Without a GPU, Triton kernels run in the interpreter on CPU tensors. This must be set
# before anything imports triton (fusion_pass and torch._inductor do): triton.language's own
# jit helpers are built in compiled mode otherwise, and the interpreter cannot call them.
import torch  # noqa: E402  (torch does not import triton at import time)

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# The tests run strict: a fault inside a family raises instead of being contained and reported
# (fusion_pass.transaction), so that containment never hides a bug from us. The containment tests
# install with strict=False.
os.environ.setdefault("FUSION_PASS_STRICT", "1")

import pytest  # noqa: E402

import fusion_pass  # noqa: E402


@pytest.fixture(autouse=True)
def fresh_compile_state():
    """Each test compiles its graphs from scratch: no dynamo cache, no FX graph or AOTAutograd
    cache, empty counters. With a warm graph cache the passes do not run at all and counters
    read 0. Inductor's kernel cache (compiled C++ and Triton kernels, keyed by their source) stays
    on: a kernel's source decides its binary, and tests that build the same kernels reuse them
    (two whole-model tests: 167 s with every kernel rebuilt, 122 s with a cold cache)."""
    torch._dynamo.reset()
    fusion_pass.reset_report()
    torch.manual_seed(0)
    with torch._inductor.config.patch(fx_graph_cache=False, fx_graph_remote_cache=False), \
            torch._functorch.config.patch(enable_autograd_cache=False):
        yield
    fusion_pass.uninstall()
    torch._dynamo.reset()
