"""Emission: the chosen configuration as TrainingArguments fields (``training_args``), as a
tuned YAML/JSON file that ``HfArgumentParser`` loads (``config_file``); checking such fields
as TrainingArguments would (``validate``) and an output path before any work (``output``)."""

from autofit.emit.config_file import check_config_output, read_config, write_config
from autofit.emit.output import check_output
from autofit.emit.training_args import (
    TUNED_FIELDS,
    build_training_arguments,
    config_from_arguments,
    training_arguments_dict,
)
from autofit.emit.validate import check_training_arguments, training_arguments_problems

__all__ = ["TUNED_FIELDS", "build_training_arguments", "check_config_output", "check_output",
           "check_training_arguments", "config_from_arguments", "read_config",
           "training_arguments_dict", "training_arguments_problems", "write_config"]
