"""A TRL file's ``datasets`` mixture, loaded as ``trl sft`` loads it.

``trl sft --config`` reads local data through TRL's ``DatasetMixtureConfig`` (a list of
``datasets.load_dataset`` calls, each with ``data_files``, ``columns``, ``fraction``)
rather than ``dataset_name``; ``autofit.emit.args_file`` reads the list and this module
loads its train split with TRL's own ``get_dataset``.
"""

from __future__ import annotations

from typing import Any

from autofit.errors import BadInputError

__all__ = ["load_trl_mixture"]


def load_trl_mixture(entries: tuple[dict[str, Any], ...], *, streaming: bool = False,
                     test_split_size: object = None, split: str = "train",
                     name: str = "the file") -> Any:
    """The ``split`` of a TRL file's ``datasets`` mixture, loaded by ``trl.get_dataset`` as
    ``trl sft`` loads it (each entry through ``datasets.load_dataset``, its ``columns`` and
    ``fraction`` applied, concatenated, split by ``test_split_size``).

    Raises:
        BadInputError: TRL is not installed, the mixture streams (no lengths to read), or
            an entry cannot be loaded here (a missing file; a hub dataset offline).
    """
    if streaming:
        raise BadInputError(f"{name}: streaming: true, a streamed dataset has no lengths to "
                            "plan for: give --dataset (a sample of it as .jsonl) or --seq-len")
    try:
        from trl import DatasetMixtureConfig, get_dataset
        from trl.scripts.utils import DatasetConfig
    except ImportError:
        raise BadInputError(f"{name}: reading its datasets mixture needs TRL "
                            "(`pip install trl`), as trl sft does; or give --dataset") from None
    mixture = DatasetMixtureConfig(datasets=[DatasetConfig(**e) for e in entries],
                                   test_split_size=test_split_size)
    try:
        data = get_dataset(mixture)
    except Exception as e:  # noqa: BLE001 - datasets raises many types
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise BadInputError(f"{name}: its datasets mixture could not be loaded here "
                            f"({first[:300]}); give --dataset") from None
    if split not in data:
        raise BadInputError(f"{name}: the datasets mixture has no {split!r} split "
                            f"(dataset_train_split; it has {', '.join(data)})")
    return data[split]
