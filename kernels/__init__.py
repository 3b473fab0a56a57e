"""Custom ops in the ``fusion_pass`` namespace, their Triton kernels and PyTorch references.

Importing this package registers every op, so compiled graphs can call them.
"""

from . import qk_norm_rope_cache_op  # noqa: F401
from . import qkv_rope_qk_norm_op  # noqa: F401
from . import qk_norm_rope_backward_op  # noqa: F401
