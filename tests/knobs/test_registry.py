"""The registry is the one place a knob is named: a knob registered there (a throwaway one,
in this test only) has its fields written and its reason line and note shown, with no
other file touched."""

from __future__ import annotations

import pytest

from autofit.config import TrainConfig
from autofit.emit.training_args import training_arguments_dict
from autofit.knobs import registry
from autofit.knobs.base import Costs, OnOffKnob


class _PinMemory(OnOffKnob):
    """A throwaway lever: no pinned memory for the data loader at large micro batches."""

    name = "pin_memory_off"
    title = "pin"
    fields = ("dataloader_pin_memory",)
    calibrates_apart = False
    option = "pin-memory-off"

    def describe(self, value: bool) -> str:
        return "unpinned loader" if value else "pinned loader"

    def short(self, value: bool) -> str:
        return "yes" if value else "no"

    def _on(self, config: TrainConfig) -> bool:
        return config.micro_batch_size >= 4

    def emit(self, config: TrainConfig, args: dict[str, object]) -> None:
        if self._on(config):
            args["dataloader_pin_memory"] = False

    def read(self, args: dict[str, object]) -> bool:
        return args.get("dataloader_pin_memory") is False

    def trainer_note(self, value: bool, trainer: str) -> str | None:
        return None

    def reason(self, config: TrainConfig, costs: Costs) -> str | None:
        if not self._on(config):
            return None
        return f"loader unpinned: {costs.device_bytes(config)} bytes on the device either way"


class _Costs:
    def device_bytes(self, config: TrainConfig) -> int:
        return 1000 * config.micro_batch_size

    def host_bytes(self, config: TrainConfig) -> int:
        return 0

    def tokens_per_s(self, config: TrainConfig) -> float:
        return 1.0

    def compile_saving_bytes(self, config: TrainConfig) -> int:
        return 0


@pytest.fixture()
def registered(monkeypatch):
    monkeypatch.setattr(registry, "KNOBS", (*registry.KNOBS, _PinMemory()))


def test_a_registered_knob_writes_its_fields(registered):
    assert training_arguments_dict(TrainConfig(micro_batch_size=4))[
        "dataloader_pin_memory"] is False
    assert "dataloader_pin_memory" not in training_arguments_dict(TrainConfig(micro_batch_size=2))


def test_a_registered_knob_says_its_reason(registered):
    lines = registry.reason_lines(TrainConfig(micro_batch_size=4), _Costs())
    assert lines == ["loader unpinned: 4000 bytes on the device either way"]
    assert registry.reason_lines(TrainConfig(micro_batch_size=2), _Costs()) == []


def test_without_it_nothing_is_written_or_said():
    assert "dataloader_pin_memory" not in training_arguments_dict(TrainConfig(micro_batch_size=4))
    assert registry.reason_lines(TrainConfig(micro_batch_size=4), _Costs()) == []


@pytest.mark.parametrize("name, config, start", [
    ("chunked_loss", TrainConfig(chunked_loss=True), "chunked loss: saves ~"),
    ("activation_offloading", TrainConfig(gradient_checkpointing=True,
                                          activation_offloading=True),
     "activation offloading: saves ~"),
    ("torch_compile", TrainConfig(torch_compile=True), "torch.compile: ~"),
])
def test_each_knob_owns_its_reason_line(name, config, start):
    """The lines the pipeline shows come from the knob that owns them (its ``reason``)."""
    line = registry.knob(name).reason(config, _Costs())
    assert line.startswith(start), line
    assert registry.knob(name).reason(TrainConfig(), _Costs()) is None


def test_the_chunked_loss_note_names_liger_for_a_trainer_without_it():
    notes = registry.notes(TrainConfig(chunked_loss=True), "plain")
    assert any("use_liger_kernel is set" in n for n in notes)
    assert any("ChunkedLossTrainer" in n for n in registry.notes(TrainConfig(chunked_loss=True),
                                                                  "autofit"))


def test_each_step_time_term_is_a_knobs_and_counts_only_when_on(monkeypatch):
    """The speed model's per-lever terms are the knobs' own (``step_seconds``, summed by
    the registry), and ``predict_speed`` adds the term of a lever without naming it: a
    term given to torch.compile's knob slows only the configurations that compile."""
    from autofit.knobs.compile import TORCH_COMPILE
    from autofit.probe.device import resolve_device
    from autofit.probe.model import probe_model
    from autofit.search import speed

    assert set(registry.timed_knobs()) <= set(registry.knob_names())
    assert {"chunked_loss", "activation_offloading"} <= set(registry.timed_knobs())
    assert "torch_compile" not in registry.timed_knobs()
    info, t4 = probe_model("tiny-llama"), resolve_device("T4")
    eager, compiled = TrainConfig(micro_batch_size=4), TrainConfig(micro_batch_size=4,
                                                                    torch_compile=True)
    before = speed.predict_speed(info, compiled, 256, t4)
    monkeypatch.setattr(TORCH_COMPILE, "step_seconds",
                        lambda ctx: 0.5 * ctx.config.torch_compile, raising=False)
    assert "torch_compile" in registry.timed_knobs()
    after = speed.predict_speed(info, compiled, 256, t4)
    assert after.step_time_s == pytest.approx(before.step_time_s + 0.5)
    assert speed.predict_speed(info, eager, 256, t4) == speed.predict_speed(
        info, eager.replace(torch_compile=False), 256, t4)
    # the chunked loss's own term: its loop's traffic on a card, its measured cost on a CPU
    for device in (t4, resolve_device("cpu")):
        off = speed.predict_speed(info, eager, 256, device).step_time_s
        on = speed.predict_speed(info, eager.replace(chunked_loss=True), 256, device).step_time_s
        assert on > off


def test_a_knob_says_when_it_is_no_choice_and_narrows_its_own_values(monkeypatch):
    """``is_choice``: a knob that is no choice with a loss leaves ``choice_of`` (and with it
    the space, the tables and the cache key); ``narrow``: a knob settles its own values for
    a tune, with its reason, and the registry asks every knob without naming one."""
    from autofit.knobs.base import Scope
    from autofit.knobs.compile import TORCH_COMPILE
    from autofit.probe.device import resolve_device

    trl = TrainConfig(loss_impl="trl")
    assert "chunked_loss" not in registry.choice_of(trl)  # the chunked loss's own rule
    assert "torch_compile" in registry.choice_of(trl)
    monkeypatch.setattr(TORCH_COMPILE, "is_choice",
                        lambda loss_impl="model", trainer=None: loss_impl != "trl", raising=False)
    assert "torch_compile" not in registry.choice_of(trl)
    assert "torch_compile" in registry.choice_of(TrainConfig())

    reasons: list[str] = []
    scope = Scope(None, "causal-lm", resolve_device("cpu"), "plain", "model", None, reasons)

    def narrow(asked, scope):
        scope.reasons.append("no torch.compile: a test says so")
        return False

    monkeypatch.setattr(TORCH_COMPILE, "narrow", narrow, raising=False)
    out = registry.narrow({"torch_compile": [False, True], "precision": None}, scope)
    assert out["torch_compile"] is False and out["precision"] is None
    assert "no torch.compile: a test says so" in reasons


def test_the_loss_a_trial_and_the_simulation_run_is_the_knobs_own(monkeypatch):
    """``step_loss``: the loss a knob's value makes the trainer compute; the trial's plan and
    the simulated step call what the registry returns, naming no knob. A loss given to the
    optimizer's knob for SGD runs in both when SGD is chosen, and only then."""
    import torch

    from autofit.knobs.loss import causal_lm_chunked_loss
    from autofit.knobs.optimizer import OPTIMIZER
    from autofit.memory.simulate import simulate
    from autofit.probe.model import build_model
    from autofit.trial.step import _forward_loss, plan_step

    assert registry.step_loss(TrainConfig()) is None
    assert registry.step_loss(TrainConfig(chunked_loss=True)) is causal_lm_chunked_loss
    calls = []

    def tagged(model, batch):
        calls.append(type(model).__name__)
        return model(**batch).loss * 1.0

    monkeypatch.setattr(OPTIMIZER, "step_loss",
                        lambda config: tagged if config.optimizer == "sgd" else None,
                        raising=False)
    model, _ = build_model("tiny-llama")
    sgd = TrainConfig(micro_batch_size=1, optimizer="sgd")
    plan = plan_step(model, sgd, use_cpu=True)
    assert plan.loss_fn is tagged
    assert plan_step(model, TrainConfig(micro_batch_size=1), use_cpu=True).loss_fn is None
    ids = torch.randint(0, 100, (1, 8))
    _forward_loss(model, {"input_ids": ids, "labels": ids}, plan.loss_fn)
    assert len(calls) == 1
    simulate(model, sgd, seq_len=16, device="cpu", task="causal-lm")
    assert len(calls) > 1  # the simulated step called it too
    n = len(calls)
    simulate(model, TrainConfig(micro_batch_size=1), seq_len=16, device="cpu", task="causal-lm")
    assert len(calls) == n
