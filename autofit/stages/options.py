"""What the search may do: ``TuneOptions``, the keyword options of ``autofit()`` besides the
model, typed, each with one default, validated once at the boundary.

    >>> opts = TuneOptions.of({"max_micro_batch": 64, "precision": ["bf16-mixed"]})
    >>> opts.max_micro_batch, opts.asked("precision"), opts.confirm_top
    (64, ['bf16-mixed'], 3)

``autofit()`` builds one (``TuneOptions.of``: every unknown name and every bad number
reported at once, as before anything is built); the stages only read it. The two stages
that narrow it return a new one: ``fix_recipe`` (the user's launch recipe fixes knobs and
ranks) and ``guard_evidence`` (a guarded run's rescues lower ``max_micro_batch``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from types import MappingProxyType
from typing import Any

from autofit.errors import BadInputError, fix
from autofit.knobs import knob_names
from autofit.knobs.trainer import normalize_trainer

__all__ = ["TuneOptions", "METHODS", "check_method", "fix_recipe", "guard_evidence"]

METHODS = ("analytic", "simulate")

# The model's keywords of autofit(): they make its ModelSpec (autofit.trial.model.model_spec).
MODEL_OPTIONS = ("task", "attn_implementation", "lora", "peft_config", "load_in_4bit",
                 "load_in_8bit", "quantization_config")


@dataclass(frozen=True)
class TuneOptions:
    """The keyword options of ``autofit()`` (its docstring says what each does); a knob's
    keyword restricts that knob (``knobs``: name -> the value or values asked)."""

    max_micro_batch: int = 256
    training_args: Any = None  # a TrainingArguments / SFTConfig, or a dict of its fields
    method: str = "analytic"  # METHODS
    tokenizer: Any = None
    collator: Any = None
    text_column: str | None = None
    cache: bool | str = True  # False, True or a storage URL
    confirm_top: int = 3
    max_trials: int = 12
    progress: Any = False  # False, True, a callable(line) or a TrialProgress
    isolation: str = "auto"
    trial_timeout_s: float = 600.0
    optim_args: str | None = None
    world_size: int | None = None
    generate_max_new_tokens: int | None = None
    nproc_per_node: int | None = None
    nnodes: int | None = None
    block_size: int | None = None
    deepspeed_config: Any = None  # a path or a dict (autofit.knobs.recipe)
    accelerate_config: Any = None
    trainer: str | None = None  # None: the one implied (autofit.knobs.trainer)
    guard_record: Any = None  # a path to <name>-guard.jsonl
    knobs: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    recipe: Any = None  # autofit.knobs.recipe.Recipe, set by fix_recipe (never by the caller)

    def asked(self, knob: str) -> Any:
        """What the caller asked of ``knob`` (a value, a list of values), or None."""
        return self.knobs.get(knob)

    def with_knobs(self, **asked: object) -> TuneOptions:
        return dataclasses.replace(self, knobs=MappingProxyType({**self.knobs, **asked}))

    @property
    def layout_fields(self) -> dict[str, Any] | None:
        """The ``Layout`` fields of the user's recipe, or None."""
        return self.recipe.layout_fields if self.recipe is not None else None

    @classmethod
    def of(cls, constraints: Mapping[str, object], objective: str = "throughput",
           **numbers: object) -> TuneOptions:
        """The keyword options, validated before anything is built: every unknown name is one
        line naming the known ones; every bad number is reported, all in one line.
        ``numbers``: the named parameters of ``autofit()`` checked with them (the target
        batch, the margin, ...); the model's keywords are accepted and left out."""
        options = {f.name for f in fields(cls)} - {"knobs", "recipe"}
        known = options | set(MODEL_OPTIONS) | set(knob_names())
        unknown = set(constraints) - known
        if unknown:
            raise BadInputError(f"unknown option(s) {', '.join(sorted(unknown))}; "
                                f"known: {', '.join(sorted(known))}")
        if objective != "throughput":
            raise BadInputError(f"unknown objective {objective!r}; use 'throughput'")
        check_method(constraints.get("method", cls.method))
        if constraints.get("trainer") is not None:
            normalize_trainer(constraints["trainer"])  # unknown: before anything is built
        problems = _number_problems({**numbers, **constraints})
        if problems:
            raise BadInputError("; ".join(problems))
        return cls(**{k: v for k, v in constraints.items() if k in options},
                   knobs=MappingProxyType({k: v for k, v in constraints.items()
                                           if k in knob_names()}))


def check_method(method: Any) -> None:
    if method not in METHODS:
        raise BadInputError(f"unknown method {method!r}; choose one of {', '.join(METHODS)}")


# The command line's flag of each option that has one (messages name the caller's own).
_FLAGS = {"target_batch_size": "--target-batch-size", "max_micro_batch": "--max-micro-batch",
          "margin": "--margin", "time_budget_s": "--time-budget", "max_trials": "--max-trials",
          "max_seq_len": "--max-seq-len"}


def _named(option: str) -> str:
    """``option`` as the caller spells it: its flag on the command line, else the keyword."""
    return fix(_FLAGS[option], option) if option in _FLAGS else option


def _number_problems(values: Mapping[str, object]) -> list[str]:
    """What is wrong with the numeric options (None: the default), one phrase each."""
    from autofit.search.space import check_batch_size

    def number(v: object) -> bool:
        return isinstance(v, int | float) and not isinstance(v, bool) and not math.isnan(v)

    def whole(v: object) -> bool:
        return isinstance(v, int) and not isinstance(v, bool)

    problems = []
    for name in ("target_batch_size", "max_micro_batch"):
        try:
            check_batch_size(_named(name), values.get(name), optional=True)
        except BadInputError as e:
            problems.append(str(e))
    margin = values.get("margin")
    if margin is not None and not (number(margin) and 0 <= margin < 1):
        problems.append(f"{_named('margin')} must be a fraction in [0, 1) of the capacity kept "
                        f"free (e.g. 0.1), got {margin!r}")
    time_budget = values.get("time_budget_s")
    if time_budget is not None and not (number(time_budget) and time_budget > 0):
        problems.append(f"{_named('time_budget_s')} must be a positive number of seconds "
                        f"{fix('(or leave it out', '(or None')} for no limit), got {time_budget!r}")
    timeout = values.get("trial_timeout_s")
    if timeout is not None and not (number(timeout) and 0 < timeout < math.inf):
        problems.append(f"trial_timeout_s must be a positive, finite number of seconds, "
                        f"got {timeout!r}")
    for name in ("max_trials", "confirm_top", "world_size", "max_seq_len",
                 "generate_max_new_tokens", "nproc_per_node", "nnodes"):
        v = values.get(name)
        if v is not None and not (whole(v) and v >= 1):
            problems.append(f"{_named(name)} must be a positive integer, got {v!r}")
    return problems


def fix_recipe(options: TuneOptions, reasons: list[str]) -> TuneOptions:
    """``options`` with the user's launch recipe (``deepspeed_config=`` /
    ``accelerate_config=``, else the ``training_args``' ``deepspeed`` / ``fsdp`` fields): the
    knobs it fixes get its one value (a different constraint is bad input), its ranks
    replace the options', and ``recipe`` carries it to the estimator, the trials and the
    tuned file. Its batch numbers are not kept: the tuned file's DeepSpeed config gets the
    tuned ones."""
    from autofit.knobs.recipe import check_batch, read_recipe, recipe_of_fields

    ds, acc = options.deepspeed_config, options.accelerate_config
    args = options.training_args
    fields_ = (args.to_dict() if hasattr(args, "to_dict") else dict(args)
               if isinstance(args, dict) else None)
    if ds is None and acc is None:
        recipe = recipe_of_fields(fields_, "training_args") if fields_ else None
    else:
        recipe = read_recipe(deepspeed=ds, accelerate=acc)
        if recipe is not None and fields_ is not None:
            check_batch(recipe, fields_, "training_args")
    if recipe is None:
        return options
    fixed: dict[str, Any] = {}
    for name, value in recipe.search_constraints().items():
        asked = options.asked(name)
        allowed = [asked] if isinstance(asked, str | bool) else list(asked or [])
        if asked is not None and value[0] not in allowed:
            raise BadInputError(f"{recipe.source} fixes {name} {value[0]} but {name}="
                                f"{asked!r} was asked: drop one")
        fixed[name] = value
    ranks = {name: getattr(recipe, name) for name in ("nproc_per_node", "nnodes")
             if getattr(recipe, name) is not None}
    if recipe.optim_args is not None:
        ranks["optim_args"] = recipe.optim_args
    options = dataclasses.replace(options.with_knobs(**fixed), recipe=recipe, **ranks)
    world = options.world_size or (options.nproc_per_node or 1) * (options.nnodes or 1)
    first, *rest = recipe.lines(int(world))
    reasons += [first + "; kept as given, the rest searched", *rest]
    return options


def guard_evidence(options: TuneOptions, reasons: list[str]) -> TuneOptions:
    """``options`` with the rescues of a guarded run of the previous tuned file
    (``guard_record=``) as evidence: a training micro step of b samples ran out of memory in
    the real run (a batch, a neighbour or a fragmentation no plan saw), so the search tries
    micro batches below b only (``max_micro_batch``), and the reasons say why."""
    path = options.guard_record
    if path is None:
        return options
    from pathlib import Path

    from autofit.trial.guard import read_record

    if not Path(path).is_file():
        raise BadInputError(f"guard_record: {path} is not a file (the JSON lines autofit.guard "
                            "writes, <name>-guard.jsonl beside a tuned file)")
    rescues = [r for r in read_record(path) if r.kind == "train" and r.batch_shape]
    if not rescues:
        return options
    worst = min(rescues, key=lambda r: (r.batch_shape[0], r.step))
    b = int(worst.batch_shape[0])
    shape = " x ".join(str(d) for d in worst.batch_shape)
    seen = (f"a guarded run ran out of memory {len(rescues)} time(s) in a training micro step "
            f"(the smallest: micro batch {shape} at step {worst.step}, run in {worst.k} pieces; "
            f"{Path(path).name})")
    if b <= 1:
        reasons.append(f"{seen}: one sample is the smallest micro batch, nothing smaller to try")
        return options
    if b - 1 < int(options.max_micro_batch):
        options = dataclasses.replace(options, max_micro_batch=b - 1)
    reasons.append(f"micro batches of {b} and more not tried: {seen}")
    return options
