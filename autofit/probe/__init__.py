"""Probing: what the model, the data and the device are."""

from autofit.probe.data import DataInfo, probe_data, worst_case_batch
from autofit.probe.device import DeviceInfo, resolve_device
from autofit.probe.model import LoraSpec, ModelInfo, probe_model

__all__ = [
    "DataInfo",
    "DeviceInfo",
    "LoraSpec",
    "ModelInfo",
    "probe_data",
    "probe_model",
    "resolve_device",
    "worst_case_batch",
]
