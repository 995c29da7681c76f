"""Memory estimation: analytic (closed form) and simulated (fake tensors + allocator model)."""

from autofit.memory.breakdown import COMPONENTS, MemoryEstimate

__all__ = ["COMPONENTS", "MemoryEstimate"]
