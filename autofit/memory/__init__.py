"""Device memory: allocator models that turn recorded allocations into peaks."""
