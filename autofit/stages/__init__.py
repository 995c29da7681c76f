"""The stages of ``autofit()`` (``autofit.api`` runs them in order), by module: the options
(``TuneOptions``), the probe (``Probed``), the run around the step (``RunPlan``,
``trial_run``), the simulated trials of an absent device, and the result.

    >>> from autofit.stages import TuneOptions
    >>> TuneOptions().max_micro_batch
    256
"""

from autofit.stages.options import METHODS, TuneOptions
from autofit.stages.probed import Probed
from autofit.stages.run import RunPlan, WholeRun, trial_run

__all__ = ["METHODS", "TuneOptions", "Probed", "RunPlan", "WholeRun", "trial_run"]
