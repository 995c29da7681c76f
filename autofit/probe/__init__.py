"""Probing: what the model, the data and the device are."""

from autofit.probe.device import DeviceInfo, resolve_device
from autofit.probe.model import LoraSpec, ModelInfo, probe_model

__all__ = ["DeviceInfo", "LoraSpec", "ModelInfo", "probe_model", "resolve_device"]
