"""The run around the step, for ``autofit()``: the Trainer's plan of the run
(``RunPlan``, from ``autofit.probe.run``, where ``autofit check`` reads it too), the eval
batch, the short run a trial replays besides its worst-case steps (``trial_run``), and
the chosen configuration's whole-run need (``whole_run``).

    >>> RunPlan.of({"eval_strategy": "steps", "eval_steps": 50}).eval_steps
    50
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from autofit.config import TrainConfig
from autofit.errors import BadInputError
from autofit.knobs import KNOBS
from autofit.memory.breakdown import MemoryEstimate
from autofit.probe.device import DeviceInfo
from autofit.probe.run import RunPlan
from autofit.stages.options import TuneOptions
from autofit.stages.probed import Probed

if TYPE_CHECKING:
    from autofit.memory.simulate import Simulator
    from autofit.probe.model import ModelInfo
    from autofit.search.engine import Engine, SearchOutcome
    from autofit.search.margin import RunMargin

__all__ = ["RunPlan", "WholeRun", "trial_run", "whole_run", "eval_from_trial",
           "eval_micro_batch", "eval_working_set", "RUN_TRIAL_STEPS", "RUN_TRIAL_REPLAY_S",
           "RUN_TRIAL_REPLAY_WITHIN"]


def eval_working_set(info: ModelInfo, config: TrainConfig, seq_len: int, dev: DeviceInfo,
                     eval_micro: int | None, generate_max_new_tokens: int | None) -> int:
    """Bytes an evaluation with ``eval_micro`` adds between the training steps of ``config``
    (0 for a model whose evaluation step is not estimated: evaluated at the training micro
    batch, its forward under no_grad holds about what a training step does, or less)."""
    if eval_micro is None or not info.is_transformer:
        return 0
    from autofit.memory.analytic import weights_bytes
    from autofit.memory.eval import estimate_eval
    from autofit.memory.run import eval_working_set

    ev = estimate_eval(info, eval_micro, seq_len, dev, training=config,
                       generate_max_new_tokens=generate_max_new_tokens)
    return eval_working_set(ev, weights_bytes(info, config))


class WholeRun:
    """The run around the step, for one ``autofit`` call: its plan (``RunPlan`` of the
    user's training arguments), the eval batch the estimate gives a configuration at a
    margin (memoised: the margin, every trial and the result ask for it), and the replay
    of a configuration's run through the target's allocator model (one ``Simulator``,
    built when first needed)."""

    def __init__(self, probed: Probed, base_args: dict[str, object] | None,
                 options: TuneOptions) -> None:
        self.probed, self.base_args, self.options = probed, base_args, options
        self.plan = RunPlan.of(base_args)
        self._eval: dict[tuple[TrainConfig, float], tuple[int | None, list[str]]] = {}
        self._sim: Simulator | None = None
        self._growth: dict[TrainConfig, tuple[int, int]] = {}

    def order(self, config: TrainConfig) -> Any:
        return self.plan.order(self.probed.data.lengths, config, None)

    def half_growth(self, config: TrainConfig) -> tuple[int, int]:
        """(bytes, shapes): what the run's other micro-batch shapes (samples x padded
        length) add above its longest step on a CPU whose 16-bit matmuls run on oneDNN
        (``memory.analytic.cpu_half_run_bytes``: kept for good, one set of kernels per
        shape), with the evaluations' forwards when the run evaluates; (0, 0) elsewhere."""
        from autofit.memory.analytic import cpu_half_run_growth

        p = self.probed
        if p.device.allocator == "cuda" or (len(set(p.data.lengths)) < 2
                                            and not self.padding_free):
            return 0, 0
        if config not in self._growth:
            shapes, _ = self.order(config).other_shapes(self.padding_free)
            extra = cpu_half_run_growth(p.info, config, p.device, shapes,
                                        evaluates=self.plan.eval_steps is not None)
            self._growth[config] = (extra, shapes)
        return self._growth[config]

    def counted(self, step: Callable[[TrainConfig], int]) -> Callable[[TrainConfig], int]:
        """``step`` (config -> the step's device total) + ``half_growth`` on a CPU."""
        if self.probed.device.allocator == "cuda":
            return step
        return lambda config: step(config) + self.half_growth(config)[0]

    @property
    def padding_free(self) -> bool:
        """The script runs each micro batch as one row of its tokens (SFTTrainer's "bfd"
        packing): its shapes are the batches' token counts."""
        seen = self.probed.seen
        return bool(seen is not None and seen.padding_free)

    def with_growth(self, result: Any, config: TrainConfig) -> Any:
        """A trial's ``TrialResult`` as the run counts it, with a note for each addition to
        its device totals (step and evaluation): ``half_growth``, the run's shapes the
        trial did not run itself (its replayed lengths ran theirs), and on a CPU what its
        set-up step left resident (``setup_bytes``: ``autofit run`` counts a process from
        its model's construction; ``setup_counted`` says it is in)."""
        from autofit.memory.analytic import cpu_half_run_growth
        from autofit.probe.device import format_bytes
        from autofit.trial.result import setup_left_out, with_run_additions

        extra, shapes = self.half_growth(config)
        once = setup_left_out(result)
        if (not extra and not once) or result.device_total_bytes is None:
            return result
        notes = []
        if extra:
            _, ran = self.order(config).other_shapes(self.padding_free, result.run_steps)
            if ran:
                p = self.probed
                extra = cpu_half_run_growth(p.info, config, p.device, shapes, ran=ran,
                                            evaluates=self.plan.eval_steps is not None)
            notes.append(f"+ {format_bytes(extra)} for the run's {shapes - ran} micro-batch "
                         "shapes the trial did not run: on this CPU oneDNN keeps its 16-bit "
                         "kernels of every matmul shape for good")
        if once:
            notes.append(f"+ {format_bytes(once)} that its set-up step left resident (autograd's "
                         "and the math libraries' one-time set-up), which a run counts")
        return with_run_additions(result, extra, notes)

    def eval_batch(self, config: TrainConfig, margin: float,
                   reasons: list[str] | None = None) -> int | None:
        """``eval_micro_batch`` of ``config`` at ``margin``; its reason line goes to
        ``reasons`` when given. None when evaluating by generation is not sized here. On a
        CPU whose 16-bit matmuls keep their kernels (``half_growth``), the evaluation runs
        beside what the run's shapes left: the budget it is sized to is that much smaller."""
        key = (config, float(margin))
        if key not in self._eval:
            lines: list[str] = []
            p = self.probed
            growth, shapes = self.half_growth(config)
            kept = min(0.99, margin + growth / p.device.capacity_bytes)
            b = eval_micro_batch(p.info, config, p.seq_len, p.device, kept,
                                 int(self.options.max_micro_batch),
                                 self.options.generate_max_new_tokens, lines)
            if growth and b is not None and lines:
                from autofit.probe.device import format_bytes

                lines[-1] += (f", beside the {format_bytes(growth)} of oneDNN's 16-bit kernels "
                              f"the run's {shapes} other micro-batch shapes leave")
            self._eval[key] = (b, lines)
        b, lines = self._eval[key]
        if reasons is not None:
            reasons.extend(lines)
        return b

    def replay(self, config: TrainConfig, eval_micro: int | None) -> Any:
        """``search.margin.run_margin`` of ``config``'s run (evaluating at ``eval_micro``)."""
        from autofit.memory.simulate import Simulator
        from autofit.search.margin import run_margin

        p = self.probed
        if self._sim is None:
            self._sim = Simulator(p.module, task=p.task, device=p.device,
                                  model_name=p.info.name, sharding=self.options.layout_fields)
        gen = self.options.generate_max_new_tokens
        return run_margin(self._sim, config, self.order(config), p.device,
                          eval_steps=self.plan.eval_steps,
                          eval_bytes=eval_working_set(p.info, config, p.seq_len, p.device,
                                                       eval_micro, gen),
                          save_steps=self.plan.save_steps)


RUN_TRIAL_STEPS = 12  # micro batches of the run's order a trial replays before its steps


# the replay's time bound: a slow step replays fewer lengths (the first always runs, and the
# longest, the timed steps, after it); the 12 short steps of a fast model take well under it
RUN_TRIAL_REPLAY_S = 10.0


# on the CPU the replay runs only for a trial whose longest step peaks within this fraction
# of the budget: the whole run's fragmentation measured by benchmarks/soak.py is at most
# +4.7% of a step (gpt2-dropout: +5.4 MiB of 114 MiB), so further under the budget the
# replay cannot change the verdict (twice that bound, for models the soak did not see)
RUN_TRIAL_REPLAY_WITHIN = 0.10


def trial_run(probed: Probed, config: TrainConfig, kept: RunMargin | None,
              base_args: dict[str, object] | None, options: TuneOptions,
              whole: WholeRun | None = None, outpaced_below: float | None = None) -> Any:
    """The short run a trial of ``config`` replays besides its worst-case steps
    (``autofit.trial.step.RunSpec``), or None.

    - an evaluation step at the eval batch the estimate gives ``config`` (inside the run:
      the optimizer states alive), measured apart, so that the eval batch written is one
      that ran (not when evaluating by generation: a trial runs the forward only);
    - the first ``RUN_TRIAL_STEPS`` micro batches of the run's order, each cut to its
      padded length, before the measured steps: on a caching allocator whose modelled run
      needs more than its longest step (``kept.run_bytes``), and on the CPU whenever the
      lengths vary — short batches put their activations on glibc's heap (blocks under
      its mmap threshold), which the longest batch then finds fragmented: measured on
      ``benchmarks/soak.py``'s gpt2-dropout, +3.7 MiB of a 114 MiB step after 12 steps,
      +5.4 MiB over the whole run (the CPU's margin, ``SAFETY``, is 3%: the replay is kept
      there). Within ``RUN_TRIAL_REPLAY_S`` seconds: slow steps replay fewer lengths; on
      the CPU only when the first timed step peaks within ``RUN_TRIAL_REPLAY_WITHIN`` of
      the budget (further under it the replay cannot change the verdict);
    - the search's budget (``capacity * (1 - margin)``): a trial whose peak passes it stops
      at once (``TrialResult.over_budget``), and the timed steps stop after two that agree
      within half the search's speed tie (``autofit.trial.loop``); with ``outpaced_below``
      (the engine's word: a confirmed rival's speed over ``OUTPACED``) a trial whose first
      timed step is slower stops there.
    """
    from autofit.search.engine import SPEED_TIE
    from autofit.search.margin import SAFETY
    from autofit.trial.step import RunSpec

    dev, seq = probed.device, probed.seq_len
    whole = whole if whole is not None else WholeRun(probed, base_args, options)
    margin = kept.fraction if kept is not None else SAFETY
    eval_b = None
    if not options.generate_max_new_tokens:
        eval_b = whole.eval_batch(config, margin)
    lengths: tuple[int, ...] = ()
    fragments = (kept is not None and kept.run_bytes > 0 if dev.allocator == "cuda"
                 else len(set(probed.data.lengths)) > 1)
    if fragments:
        lengths = tuple(whole.order(config).lengths[:RUN_TRIAL_STEPS])
    return RunSpec(lengths=lengths, eval_batch_size=eval_b, eval_length=seq,
                   stop_above_bytes=int(dev.capacity_bytes * (1 - margin)),
                   replay_s=RUN_TRIAL_REPLAY_S, decisive_spread=SPEED_TIE / 2,
                   outpaced_below_tokens_per_s=outpaced_below,
                   replay_within=RUN_TRIAL_REPLAY_WITHIN if dev.allocator != "cuda" else None)


def whole_run(probed: Probed, engine: Engine, outcome: SearchOutcome, est: MemoryEstimate,
              kept: RunMargin, eval_micro: int | None, whole: WholeRun, reasons: list[str],
              eval_need: int | None = None, eval_how: str = "") -> tuple[MemoryEstimate, int]:
    """The chosen configuration's whole run: ``est`` with its run fields (the estimate's
    step + what the modelled run adds; an evaluation when it needs more), and the
    predicted run need: the max over the training and the evaluation phases, each from
    the trial when it ran them (the measured step; ``eval_need``, the evaluation by the
    trial: ``eval_from_trial``, described by ``eval_how``), else from the estimate."""
    import dataclasses

    from autofit.memory.eval import estimate_eval
    from autofit.probe.device import format_bytes

    config, dev, info, seq = outcome.config, probed.device, probed.info, probed.seq_len
    run = kept.run
    if dev.allocator == "cuda" and kept.config is not None and kept.config != config:
        run = whole.replay(config, eval_micro).run  # the chosen configuration's own run
    extra = run.fragmentation_bytes if run is not None else 0
    best = outcome.choice
    b = config.micro_batch_size
    measured = best.measured.get(b) if best is not None and outcome.confirmed else None
    # on a CPU in 16-bit: the kernels the run's other lengths leave (in the engine's
    # estimates and a trial's figures already: ``WholeRun.with_growth``)
    growth, shapes = whole.half_growth(config)
    step = measured if measured is not None else (
        engine.estimated(best, b) if best is not None else est.device_total_bytes + growth)
    estimable = eval_micro is not None and info.is_transformer  # (else: the training batch)
    # the file says its run does not evaluate (no eval_strategy, no do_eval): its eval batch
    # is sized to fit, but no evaluation is in the run's need
    evaluates = whole.plan.eval_steps is not None
    evaluation = (estimate_eval(info, eval_micro, seq, dev, training=config,
                                generate_max_new_tokens=whole.options.generate_max_new_tokens)
                  .device_total_bytes if estimable and evaluates else 0)
    evaluation += growth if evaluation else 0
    # a CPU run counts its one-time set-up: in the tune's trial totals already (folded),
    # added where a trial's peaks leave it out (once); the estimates never hold it
    once, folded = setup_residue(outcome), setup_residue(outcome, counted=True)
    setup = max(once, folded)
    predicted = max(step + extra + once,
                    eval_need + once if eval_need is not None and evaluates
                    else evaluation + setup)
    total = max(est.device_total_bytes + growth + extra, evaluation) + setup
    est = dataclasses.replace(est, run_device_total_bytes=total,
                              run_peak_reserved_bytes=total - dev.overhead_bytes,
                              fits=total <= est.capacity_bytes)
    source = f"{'measured' if measured is not None else 'estimated'} step {format_bytes(step)}"
    parts = [source] + ([f"+ {format_bytes(extra)} over the run"] if extra else [])
    if growth:
        parts.append(f"with {format_bytes(growth)} of oneDNN's 16-bit kernels for the run's "
                     f"{shapes} other micro-batch shapes, kept for good on this CPU")
    if setup:
        parts.append(f"{'with' if measured is not None and not once else '+'} "
                     f"{format_bytes(setup)} that the first step's one-time set-up leaves "
                     "resident, measured by the trial")
    reasons.append(f"whole run: needs ~{format_bytes(predicted)} of "
                   f"{format_bytes(dev.capacity_bytes)} ({' '.join(parts)}"
                   + (f"; an evaluation at eval batch {eval_micro} "
                      + (eval_how if eval_need is not None
                         else f"needs ~{format_bytes(evaluation)}" if estimable
                         else "not estimated, within about the training step")
                      if eval_micro is not None and evaluates else
                      f"; no evaluation counted: the run does not evaluate (no eval_strategy "
                      f"or do_eval), its eval batch {eval_micro} is sized to fit all the same"
                      if eval_micro is not None else "")
                   + ")")
    return est, int(predicted)


def setup_residue(outcome: SearchOutcome, *, counted: bool = False) -> int:
    """What the first step's one-time set-up left resident in the trials of ``outcome``
    (their most; 0 where none measured it: trials on an accelerator, on several ranks, or
    none ran), among those whose device totals leave it out (``counted``: those that hold
    it, ``WholeRun.with_growth``). A trial on the CPU runs its set-up step before its
    baseline (autograd's and the math libraries' one-time set-up, the first-touch pages of
    their code: 20 MiB for tiny-gpt2), so its peaks leave it out, while ``autofit run``
    counts a process from its model's construction: the whole-run figure holds it once."""
    return max((int(t.setup_bytes) for t in outcome.trials if getattr(t, "setup_bytes", None)
                and bool(getattr(t, "setup_counted", False)) == counted), default=0)


def eval_from_trial(outcome: SearchOutcome, config: TrainConfig, eval_micro: int | None,
                    info: ModelInfo, seq: int, dev: DeviceInfo, margin: float, max_micro: int,
                    reasons: list[str]) -> tuple[int | None, int | None, str]:
    """The eval batch checked against the evaluation step the chosen configuration's trial
    ran (``trial_run``): kept when it fitted the budget, else re-tuned with the estimate
    scaled to what the trial measured. Returns the eval batch and what its evaluation
    needs by the trial: the measured bytes when the trial ran that batch, the re-tuned
    batch's estimate scaled by the same ratio when it did not (None when no trial ran an
    evaluation: the raw estimate is all there is), and how it was found, for the whole-run
    line ("measured 1013 MiB"; "" when None)."""
    from autofit.memory.eval import estimate_eval
    from autofit.probe.device import format_bytes

    ran = [t for t in outcome.trials if getattr(t, "eval_device_total_bytes", None) is not None
           and not t.oom and t.config.get("micro_batch_size") == config.micro_batch_size
           and all(t.config.get(k.name) == getattr(config, k.name) for k in KNOBS)]
    if eval_micro is None or not ran:
        return eval_micro, None, ""
    t = ran[-1]
    measured = int(t.eval_device_total_bytes)
    once = setup_residue(outcome)  # counted by the run besides the step (whole_run adds it)
    budget = int(dev.capacity_bytes * (1 - margin))
    with_once = f" + {format_bytes(once)} of one-time set-up" if once else ""
    if not t.eval_oom and measured + once <= budget:
        reasons.append(f"eval micro batch {eval_micro}: its evaluation step measured "
                       f"{format_bytes(measured)}{with_once} in the trial, inside the run "
                       f"(≤ budget {format_bytes(budget)})")
        return eval_micro, measured, f"measured {format_bytes(measured)}"
    estimated = estimate_eval(info, eval_micro, seq, dev, training=config).device_total_bytes
    # what the trial saw, as a ratio to the estimate (an OOM: at least the capacity)
    ratio = max(1.0, (dev.capacity_bytes * 1.05 if t.eval_oom else measured) / estimated)
    # need x ratio + once <= budget  <=>  need <= cap x (1 - scaled)
    scaled = 1 - (1 - margin - once / dev.capacity_bytes) / ratio
    what = ("ran out of memory" if t.eval_oom else f"measured {format_bytes(measured)}"
            f"{with_once} > budget {format_bytes(budget)}")
    smaller = eval_micro_batch(info, config, seq, dev, min(scaled, 0.99),
                               min(eval_micro - 1, max_micro) if eval_micro > 1 else 1, None, [])
    if smaller is None or smaller >= eval_micro:
        reasons.append(f"eval batch not tuned: the evaluation step at eval batch {eval_micro} "
                       f"{what} in the trial, and no smaller one is estimated to fit")
        return None, None, ""
    need = int(estimate_eval(info, smaller, seq, dev, training=config).device_total_bytes * ratio)
    reasons.append(f"eval micro batch {smaller}: the trial's evaluation step at {eval_micro} "
                   f"{what} inside the run; the estimate scaled x{ratio:.2f} to it "
                   f"(~{format_bytes(need)})")
    return smaller, need, (f"needs ~{format_bytes(need)} (its estimate x{ratio:.2f}, "
                           "the trial's ratio)")


def eval_micro_batch(info: ModelInfo, config: TrainConfig, seq_len: int, dev: DeviceInfo,
                     margin: float, max_micro: int, generate_max_new_tokens: int | None,
                     reasons: list[str]) -> int | None:
    """per_device_eval_batch_size: tuned apart from training, so an eval OOM never shrinks it."""
    from autofit.errors import DoesNotFitError
    from autofit.memory.eval import tune_eval_batch

    if not info.is_transformer and not generate_max_new_tokens:
        # no closed form of its evaluation step (RWKV): the training micro batch, whose
        # step fits, where the Trainer's default (8) may not
        b = config.micro_batch_size
        reasons.append(f"eval micro batch {b}: the training micro batch ({info.name}'s "
                       "evaluation step is not estimated: not a transformer autofit "
                       "recognises; its forward under no_grad keeps no gradients or saved "
                       "activations: about the training step that fits, or less; a trial "
                       "measures it)")
        return b
    try:
        b = tune_eval_batch(info, seq_len, dev, margin, training=config,
                            max_micro_batch=max_micro,
                            generate_max_new_tokens=generate_max_new_tokens)
    except (DoesNotFitError, BadInputError) as e:
        reasons.append(f"eval batch not tuned: {e}")
        return None
    reasons.append(f"eval micro batch {b}: the largest whose evaluation step inside the run "
                   f"(the {config.optimizer} states alive; no gradients or saved activations) "
                   "is estimated to fit the same budget"
                   + (f", generating {generate_max_new_tokens} tokens"
                      if generate_max_new_tokens else ""))
    return b
