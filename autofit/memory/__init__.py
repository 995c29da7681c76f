"""Memory estimation: analytic (closed form) and simulated (fake tensors + allocator model)."""

from autofit.memory.breakdown import COMPONENTS, Component, MemoryEstimate

__all__ = ["COMPONENTS", "Component", "MemoryEstimate"]
