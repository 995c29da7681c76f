"""Emission: the chosen configuration as TrainingArguments fields (``training_args``) and
as a tuned YAML/JSON file that ``HfArgumentParser`` loads (``config_file``)."""

from autofit.emit.config_file import read_config, write_config
from autofit.emit.training_args import (
    TUNED_FIELDS,
    build_training_arguments,
    config_from_arguments,
    training_arguments_dict,
)

__all__ = ["TUNED_FIELDS", "build_training_arguments", "config_from_arguments", "read_config",
           "training_arguments_dict", "write_config"]
