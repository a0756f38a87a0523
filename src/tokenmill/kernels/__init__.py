"""The only door from the engine to the compiled CPU core (csrc/). Every kernel is a torch.library
custom op with a fake implementation (so compiled graphs call it without a break) and a PyTorch
reference of the same signature: the tests' oracle, and what runs when the extension is absent or
TOKENMILL_NATIVE=0."""
from tokenmill.kernels.native import amx, describe, runnable_variants, set_num_threads, use_amx, use_variant, variant

__all__ = ["amx", "describe", "runnable_variants", "set_num_threads", "use_amx", "use_variant", "variant"]
