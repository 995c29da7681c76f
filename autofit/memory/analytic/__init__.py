"""The analytic method: a closed form per memory component, microseconds per candidate.

``estimate_analytic`` (``_closed_form``) adds up, at each candidate peak of one rank's
training step, what the parameters hold (``_states``: weights, gradients, optimizer
states), the activations the blocks save (``_activations``: the fitted
``coefficients.json``, or coefficients ``derived`` from the model's own forward), the
levers' terms (``_levers``: chunked loss, offloading, ``torch_compile``) and the CPU math
libraries' caches (``_cpu_cache``); on a CUDA card, what the caching allocator reserves
above them (``_reserved``).

    >>> from autofit.memory.analytic import estimate_analytic, weights_bytes
"""

from autofit.memory.allocator._common import pinned_bytes
from autofit.memory.analytic._activations import kept_input_bytes, offloaded_bytes
from autofit.memory.analytic._closed_form import AnalyticTerms, analytic_phases, estimate_analytic
from autofit.memory.analytic._cpu_cache import (
    cpu_half_run_bytes,
    cpu_half_run_growth,
    cpu_library_cache_bytes,
)
from autofit.memory.analytic._levers import (
    chunked_loss_bytes,
    compile_saving_bytes,
    loss_chunk_rows,
    offload_note,
)
from autofit.memory.analytic._reserved import cuda_reserved_bytes
from autofit.memory.analytic._states import (
    gradients_bytes,
    optimizer_state_bytes,
    quantized_weight_bytes,
    weights_bytes,
)
from autofit.memory.analytic.derived import derived_coefficients

__all__ = ["estimate_analytic", "analytic_phases", "AnalyticTerms", "cuda_reserved_bytes",
           "weights_bytes", "gradients_bytes", "optimizer_state_bytes",
           "quantized_weight_bytes", "kept_input_bytes",
           "chunked_loss_bytes", "loss_chunk_rows", "pinned_bytes", "offload_note", "offloaded_bytes",
           "compile_saving_bytes", "cpu_half_run_bytes", "cpu_half_run_growth", "cpu_library_cache_bytes",
           "derived_coefficients"]
