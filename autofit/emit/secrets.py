"""Secrets among the TrainingArguments fields: never written to a tuned file, masked or not.

``TrainingArguments.to_dict()`` masks every field whose name ends in ``_token`` (``hub_token``
becomes the text ``"<HUB_TOKEN>"``, even when it is None). Written back as is, the file would
hand that placeholder to the Trainer as the token. So a secret field is dropped from what
autofit writes (a note says where to set it instead), and a file that holds a masked
placeholder is refused when read.

    >>> args = {"hub_token": "<HUB_TOKEN>", "eos_token": "</s>", "per_device_train_batch_size": 4}
    >>> drop_secrets(args), args
    (['hub_token dropped: set it in the environment (HF_TOKEN) or your script, never in the tuned file'], {'eos_token': '</s>', 'per_device_train_batch_size': 4})
    >>> masked_fields({"hub_token": "<HUB_TOKEN>"})
    ['hub_token']

SFTConfig's ``eos_token`` / ``pad_token`` are tokenizer tokens, not secrets (``NOT_SECRET``).
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["NOT_SECRET", "is_secret", "is_masked", "masked_fields", "drop_secrets",
           "refuse_masked"]

# fields named *_token that hold a tokenizer's token (trl.SFTConfig), not a credential
NOT_SECRET = frozenset({"eos_token", "pad_token", "bos_token", "unk_token"})


def is_secret(key: str) -> bool:
    """Whether ``key`` is a field ``to_dict()`` masks as a credential (``*_token``)."""
    return key.endswith("_token") and key not in NOT_SECRET


def is_masked(key: str, value: object) -> bool:
    """Whether ``value`` is ``to_dict()``'s placeholder for ``key`` (``"<HUB_TOKEN>"``)."""
    return key.endswith("_token") and value == f"<{key.upper()}>"


def masked_fields(args: dict[str, object]) -> list[str]:
    """The keys of ``args`` whose value is a masked placeholder."""
    return [k for k, v in args.items() if is_masked(k, v)]


def drop_secrets(args: dict[str, object], real: dict[str, object] | None = None) -> list[str]:
    """Remove every secret field (and every masked placeholder) from ``args`` in place; the
    note lines of those that held something (``real``: the true values when ``args`` is a
    masked ``to_dict()``: a None token is dropped without a note)."""
    notes = []
    for k in [k for k in args if is_secret(k) or is_masked(k, args[k])]:
        v = args.pop(k)
        held = real.get(k) if real is not None else v
        if held is not None:
            notes.append(f"{k} dropped: set it in the environment (HF_TOKEN) or your script, "
                         "never in the tuned file")
    return notes


def refuse_masked(args: dict[str, object], where: str | Path) -> None:
    """Raise ``BadInputError`` when ``args`` holds a masked placeholder (one line)."""
    bad = masked_fields(args)
    if bad:
        from autofit.errors import BadInputError

        raise BadInputError(
            f"{where}: {', '.join(f'{k}: {args[k]}' for k in bad)} is a masked placeholder "
            "(TrainingArguments.to_dict() hides secrets so), not the secret: delete "
            f"{'that line' if len(bad) == 1 else 'those lines'} and set it in the environment "
            "(HF_TOKEN) or your script")
