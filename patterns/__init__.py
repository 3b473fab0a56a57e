"""Pattern files, one per fusion family (``fusion_pass.families.NAMES``); each declares its
``FAMILY`` and exposes ``register(pass_dict)``."""
