"""Probing: what the model, the data and the device are."""

from autofit.probe.data import DataInfo, probe_data, worst_case_batch
from autofit.probe.device import DeviceInfo, resolve_device
from autofit.probe.model import LoraSpec, ModelInfo, fingerprint, probe_model
from autofit.probe.run import RunOrder, eval_order, run_order
from autofit.probe.versions import library_versions

__all__ = [
    "DataInfo",
    "DeviceInfo",
    "LoraSpec",
    "ModelInfo",
    "RunOrder",
    "eval_order",
    "run_order",
    "fingerprint",
    "library_versions",
    "probe_data",
    "probe_model",
    "resolve_device",
    "worst_case_batch",
]
