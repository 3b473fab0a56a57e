"""Triton kernels, their launchers, the custom ops that call them and their PyTorch references.

Each ``*_op`` module registers its ``torch.ops.fusion_pass.*`` ops when imported; the pattern
module of the family that replaces with them imports it (``fusion_pass.families.load_all``).
"""
