"""Pattern files, one per fusion family; each exposes ``register(pass_dict)``.

- ``qk_norm_rope_cache``: per-head RMSNorm(q, k) -> RoPE -> K/V cache write (inference).
- ``qkv_rope_qk_norm``: QKV projection -> RoPE -> per-head RMSNorm (training and no_grad).
"""
