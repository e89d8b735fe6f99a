"""The memory-reward variants by name (`MEMORY_REWARDS`), the choices of `memory_reward_type` (docs/algorithm.md,
"Variants").

Each maps P_mem and P_full of the scored rounds, tensors of shape (N,), to their memory rewards, shape (N,). They use
tensor methods only, so that the settings (and `mempo-trl train --help`) read the names without importing torch. A new
variant is one function here.
"""


def diff_reward(p_mem, p_full, eps: float):
    """``p_mem - p_full`` (the paper's memory reward); ``eps`` is unused."""
    return p_mem - p_full


def log_ratio_reward(p_mem, p_full, eps: float):
    """``log(p_mem + eps) - log(p_full + eps)``; ``eps`` > 0."""
    if eps <= 0:
        raise ValueError(f"eps must be > 0 for mode='log_ratio', got {eps}")
    return (p_mem + eps).log() - (p_full + eps).log()


MEMORY_REWARDS = {"diff": diff_reward, "log_ratio": log_ratio_reward}
"""Each variant's function ``(p_mem, p_full, eps) -> reward``, by the name `memory_reward_type` gives it."""
