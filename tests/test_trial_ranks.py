"""Trials on several ranks (issue 14): the exact step under torchrun, each rank measured.

Fast: how the ranks' files become one trial (the peaking rank's numbers, the verdict,
which rank hung), the progress line, what a machine cannot run, the DeepSpeed config's
``"auto"`` values filled as transformers fills them. One real 2-process FSDP trial
proves the feature; DDP against FSDP, an out-of-memory on one rank, a hanging rank and
ZeRO are slow (tens of seconds each: every rank imports torch and transformers).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import torch
from proc_watch import processes
from transformers import GPT2LMHeadModel

from autofit.config import TrainConfig
from autofit.errors import BadInputError
from autofit.knobs.base import installed
from autofit.trial import TrialResult, measure, trial_from_dict
from autofit.trial import ranks as trial_ranks
from autofit.trial.distributed import RankSpec
from autofit.trial.rank_process import peer_gone

MiB = 1 << 20
TINY_GPT2 = dict(n_embd=64, n_layer=2, n_head=2, vocab_size=2048, n_positions=128)
# weights (54 MB in fp32) well above what a rank's process holds besides them (~5 MB)
SMALL_GPT2 = dict(n_embd=384, n_layer=4, n_head=4, vocab_size=16384, n_positions=128)


def _tiny_gpt2(cls=GPT2LMHeadModel, dims=TINY_GPT2):
    from transformers import AutoConfig

    torch.manual_seed(0)
    return cls(AutoConfig.for_model("gpt2", **dims))


def _param_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def _rank_processes() -> list[int]:
    return [pid for pid, _, cmd in processes() if b"autofit.trial.rank_process" in cmd]


# ---------------------------------------------------------------- the ranks' files


def _write_rank(work: Path, rank: int, **fields) -> None:
    from autofit.trial.rank_process import result_path

    base = {"oom": False, "error": None, "timed_out": False, "peak_allocated_bytes": None,
            "peak_reserved_bytes": None, "device_total_bytes": None, "step_times_s": [],
            "warmup_done": 1, "resident_bytes": None, "notes": [], "rank": rank,
            "capacity_bytes": 1 << 30, "stopped_by": None}
    result_path(work, rank).write_text(json.dumps({**base, **fields}))


def _status(work: Path, rank: int, phase: str, n: int) -> dict:
    from autofit.trial.rank_process import status_path

    s = {"phase": phase, "n": n, "t": time.time()}
    status_path(work, rank).write_text(json.dumps(s))
    return s


SPEC2 = RankSpec(nproc_per_node=2, strategy="fsdp", caps=(1 << 30, 1 << 30))


def test_the_peaking_rank_gives_the_top_level_numbers(tmp_path):
    _write_rank(tmp_path, 0, device_total_bytes=300 * MiB, peak_allocated_bytes=300 * MiB,
                peak_reserved_bytes=300 * MiB, resident_bytes=40 * MiB,
                step_times_s=[1.0, 1.2, 1.1])
    _write_rank(tmp_path, 1, device_total_bytes=320 * MiB, peak_allocated_bytes=320 * MiB,
                peak_reserved_bytes=320 * MiB, resident_bytes=41 * MiB,
                step_times_s=[1.1, 1.0, 1.3])
    done = trial_ranks._collect(tmp_path, SPEC2, [None, None], timed_out=False, timeout_s=60)
    assert [p["rank"] for p in done.per_rank] == [0, 1]
    assert done.raw.device_total_bytes == 320 * MiB  # rank 1 peaks
    assert done.raw.resident_bytes == 41 * MiB
    assert done.raw.step_times_s == [1.1, 1.2, 1.3]  # each step as long as its slowest rank
    assert done.raw.error is None and not done.raw.oom


def test_one_rank_out_of_memory_is_the_trial_s_verdict(tmp_path):
    _write_rank(tmp_path, 0, device_total_bytes=300 * MiB, error="warm-up step: stopped: "
                "another rank ran out of memory", stopped_by="another rank ran out of memory")
    _write_rank(tmp_path, 1, oom=True, device_total_bytes=160 * MiB,
                error="warm-up step: RuntimeError: DefaultCPUAllocator: can't allocate memory",
                stopped_by="its own out of memory")
    done = trial_ranks._collect(tmp_path, SPEC2, [None, None], timed_out=False, timeout_s=60)
    assert done.raw.oom
    assert done.raw.error.startswith("rank 1: warm-up step: RuntimeError: DefaultCPUAllocator")
    assert [p["oom"] for p in done.per_rank] == [False, True]


def test_a_rank_stopped_by_a_peer_is_not_the_failure(tmp_path):
    _write_rank(tmp_path, 0, error="warm-up step: stopped: another rank stopped (RuntimeError: "
                "Connection closed by peer)", stopped_by="another rank stopped")
    _write_rank(tmp_path, 1, error="warm-up step: ValueError: the model returned no loss",
                stopped_by="its own failure")
    done = trial_ranks._collect(tmp_path, SPEC2, [None, None], timed_out=False, timeout_s=60)
    assert not done.raw.oom
    assert done.raw.error == "rank 1: warm-up step: ValueError: the model returned no loss"


def test_a_hung_rank_is_named_with_its_phase_and_last_output(tmp_path):
    from autofit.trial.rank_process import log_path

    statuses = [_status(tmp_path, 0, "warm-up step 1/1: backward", 14),
                _status(tmp_path, 1, "warm-up step 1/1: forward", 12)]
    log_path(tmp_path, 1).write_text("loading\nrank 1 hangs now\n")
    log_path(tmp_path, 0).write_text("[transformers] `loss_type=None` was set in the config\n")
    done = trial_ranks._collect(tmp_path, SPEC2, statuses, timed_out=True, timeout_s=40)
    assert done.raw.timed_out and not done.raw.oom
    assert done.raw.error == (
        "timeout after 40s: rank 1 was furthest behind, in 'warm-up step 1/1: forward' (its "
        "last output: rank 1 hangs now); rank 0 waited in 'warm-up step 1/1: backward'")
    assert done.per_rank[0]["last_output"] is None  # a library's chatter is no output


def test_a_rank_that_died_names_its_signal(tmp_path):
    from autofit.trial.rank_process import log_path

    _write_rank(tmp_path, 0, error="warm-up step: stopped: another rank stopped (x)",
                stopped_by="another rank stopped")
    statuses = [None, _status(tmp_path, 1, "measured step 1/3: backward", 20)]
    log_path(tmp_path, 1).write_text("about to die\n")
    (tmp_path / "launch.log").write_text(
        "torch.distributed.elastic.multiprocessing.errors.ChildFailedError:\n"
        "  rank      : 1 (local_rank: 1)\n  exitcode  : -9 (pid: 4242)\n")
    done = trial_ranks._collect(tmp_path, SPEC2, statuses, timed_out=False, timeout_s=60)
    assert not done.raw.oom  # SIGKILL from outside says nothing about memory
    assert done.raw.killed_by == "SIGKILL"
    assert done.raw.error.startswith(
        "rank 1: died (SIGKILL (signal 9)) in 'measured step 1/3: backward'")
    assert "about to die" in done.raw.error


def test_a_launcher_that_started_no_rank_says_why(tmp_path):
    (tmp_path / "launch.log").write_text("torch.distributed.elastic.rendezvous.api."
                                         "RendezvousConnectionError: the port is taken\n")
    done = trial_ranks._collect(tmp_path, SPEC2, [None, None], timed_out=False, timeout_s=60)
    assert done.raw.error == ("torchrun started no rank: torch.distributed.elastic.rendezvous"
                              ".api.RendezvousConnectionError: the port is taken")


def test_progress_line_shows_each_rank_s_step():
    line = trial_ranks._progress_line([{"phase": "measured step 2/3: backward", "n": 3}, None],
                                      SPEC2)
    assert line == "2 ranks (fsdp): rank 0 measured step 2/3 · rank 1 starting"


def test_torchrun_keeps_its_logs_in_the_work_dir(tmp_path):
    args = trial_ranks._torchrun_args(tmp_path, 4)
    assert args[args.index("--nproc-per-node") + 1] == "4"
    assert args[args.index("--log-dir") + 1] == str(tmp_path / "torchrun")  # removed with it
    module = args[args.index("-m") + 1:args.index("-m") + 3]
    assert module == ["autofit.trial.rank_process", "worker"]


def test_peer_gone_is_a_closed_connection():
    assert peer_gone(RuntimeError("[pair.cc:553] Connection closed by peer [127.0.0.1]:677"))
    assert not peer_gone(RuntimeError("DefaultCPUAllocator: can't allocate memory"))


# ---------------------------------------------------------------- the plan


def test_ranks_that_do_not_fit_the_machine_are_refused():
    from autofit.probe.device import resolve_device

    dev = resolve_device("cpu:8GiB")
    config = TrainConfig(nproc_per_node=2, nnodes=(dev.total_bytes // (8 << 30)) + 1)
    with pytest.raises(BadInputError, match="ranks x cpu:8GiB need .* more than this machine"):
        trial_ranks.check_ranks(config, dev)
    trial_ranks.check_ranks(TrainConfig(nproc_per_node=2), dev)  # 16 GiB: fits here


def test_each_rank_gets_the_device_s_cap():
    from autofit.probe.device import resolve_device

    assert trial_ranks.rank_caps(resolve_device("cpu:1GiB"), 3) == (1 << 30,) * 3
    assert trial_ranks.rank_caps(resolve_device("cpu"), 2) == (None, None)


def test_find_unused_parameters_as_the_trainer_sets_it():
    model = _tiny_gpt2()
    assert trial_ranks._find_unused(model, TrainConfig(nproc_per_node=2))
    assert not trial_ranks._find_unused(model, TrainConfig(nproc_per_node=2,
                                                           gradient_checkpointing=True))
    assert trial_ranks._find_unused(torch.nn.Linear(2, 2), TrainConfig(nproc_per_node=2,
                                                                       gradient_checkpointing=True))


@pytest.mark.skipif(not installed("deepspeed"), reason="DeepSpeed not installed")
def test_deepspeed_config_auto_values_filled_as_transformers_fills_them():
    from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled

    from autofit.probe.device import resolve_device

    model = _tiny_gpt2()
    config = TrainConfig(micro_batch_size=3, grad_accum_steps=4, nproc_per_node=2,
                         strategy="zero3", offload="optimizer", precision="bf16-mixed")
    spec = trial_ranks.rank_spec(config, model, resolve_device("cpu:1GiB"), 60)
    ds = spec.deepspeed

    def autos(d):
        return [k for k, v in d.items() if v == "auto" or (isinstance(v, dict) and autos(v))]

    assert autos(ds) == []
    assert ds["train_micro_batch_size_per_gpu"] == 3
    assert ds["gradient_accumulation_steps"] == 4
    assert ds["train_batch_size"] == 3 * 4 * 2
    assert ds["gradient_clipping"] == 1.0
    assert ds["bf16"]["enabled"] is True and ds["fp16"]["enabled"] is False
    h = TINY_GPT2["n_embd"]
    assert ds["zero_optimization"]["reduce_bucket_size"] == h * h
    assert ds["zero_optimization"]["stage3_param_persistence_threshold"] == 10 * h
    assert ds["zero_allow_untested_optimizer"] is True  # the Trainer's own optimizer
    assert ds["zero_force_ds_cpu_optimizer"] is False  # ... kept under offload
    assert not is_deepspeed_zero3_enabled()  # no global ZeRO-3 state left in this process


def test_several_ranks_never_run_in_process():
    with pytest.raises(BadInputError, match="2 ranks run as 2 processes"):
        measure(_tiny_gpt2(), TrainConfig(nproc_per_node=2), seq_len=16, device="cpu",
                isolation="in-process")


def test_per_rank_survives_a_round_trip():
    r = TrialResult(oom=False, peak_allocated_bytes=2, peak_reserved_bytes=2,
                    device_total_bytes=2, step_time_s=1.0, tokens_per_s=1.0, samples_per_s=1.0,
                    error=None, config={}, device="cpu", batch_shape=(1, 2), isolation="subprocess",
                    isolation_reason="", steps=1,
                    per_rank=({"rank": 0, "device_total_bytes": 2}, {"rank": 1}))
    back = trial_from_dict(json.loads(json.dumps(r.to_dict())))
    assert back.per_rank == r.per_rank


# ---------------------------------------------------------------- real ranks


def test_fsdp_trial_on_two_ranks_shards_each_rank_s_weights(own_tmp):
    """The feature end to end: 2 processes under torchrun, FSDP2 over gloo, each rank
    capped and measured; each rank holds about half of the weights."""
    model = _tiny_gpt2(dims=SMALL_GPT2)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    progress: list[str] = []
    r = measure(model, TrainConfig(micro_batch_size=2, nproc_per_node=2, strategy="fsdp"),
                seq_len=32, device="cpu:1GiB", measure_steps=1, timeout_s=240,
                progress=progress.append)
    assert r.fits, r.error
    assert [p["rank"] for p in r.per_rank] == [0, 1]
    assert all(p["device_total_bytes"] and p["error"] is None for p in r.per_rank)
    assert r.device_total_bytes == max(p["device_total_bytes"] for p in r.per_rank)
    assert r.capacity_bytes == 1 << 30 and r.config["world_size"] == 2
    full = _param_bytes(model)
    for p in r.per_rank:  # a shard of the weights (+ buffers, gloo's): well under them all
        assert p["resident_bytes"] < 0.8 * full, (p, full)
    assert any("rank 0 measured step 1/1" in line for line in progress)
    # the user's model: unchanged, not wrapped, no leftovers
    assert type(model).__name__ == "GPT2LMHeadModel" and not hasattr(model, "reshard")
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert not _rank_processes()
    assert not any(own_tmp.iterdir())


@pytest.mark.slow
def test_ddp_holds_a_replica_fsdp_a_shard(own_tmp):
    model = _tiny_gpt2(dims=SMALL_GPT2)
    full = _param_bytes(model)
    got = {}
    for strategy in ("ddp", "fsdp"):
        r = measure(model, TrainConfig(micro_batch_size=2, nproc_per_node=2, strategy=strategy),
                    seq_len=32, device="cpu:1GiB", measure_steps=1, timeout_s=240)
        assert r.fits, r.error
        got[strategy] = r
    ddp, fsdp = got["ddp"], got["fsdp"]
    for p in ddp.per_rank:  # the replica, and DDP's gradient buckets beside it
        assert p["resident_bytes"] >= full
    assert max(p["resident_bytes"] for p in fsdp.per_rank) < 0.8 * full
    assert fsdp.device_total_bytes < ddp.device_total_bytes


@pytest.mark.slow
def test_out_of_memory_on_one_rank_stops_both(own_tmp, monkeypatch):
    # rank 1 capped far below what a replica's step needs, rank 0 with room to spare
    monkeypatch.setattr(trial_ranks, "rank_caps", lambda dev, world: (1 << 30, 160 * MiB))
    r = measure(_tiny_gpt2(dims=SMALL_GPT2), TrainConfig(micro_batch_size=4, nproc_per_node=2),
                seq_len=64, device="cpu:1GiB", timeout_s=240)
    assert r.oom and not r.fits
    assert r.error.startswith("rank 1: ") and "can't allocate memory" in r.error
    r0, r1 = r.per_rank
    assert r1["oom"] and r1["capacity_bytes"] == 160 * MiB
    assert not r0["oom"] and r0["stopped_by"].startswith("another rank")
    assert r.capacity_bytes == 160 * MiB  # the smallest rank's limit
    assert r.steps == 0  # no rank went on to the measured steps
    assert not _rank_processes()


class HangingGPT2(GPT2LMHeadModel):
    """Rank 1 sleeps in its third forward: the warm-up step's (set-up, wrapped set-up,
    warm-up). Each rank unpickles this class from this module."""

    calls = 0

    def forward(self, *args, **kwargs):
        import torch.distributed as dist

        HangingGPT2.calls += 1
        if dist.is_initialized() and dist.get_rank() == 1 and HangingGPT2.calls >= 3:
            print("rank 1 hangs now", flush=True)
            time.sleep(3600)
        return super().forward(*args, **kwargs)


@pytest.mark.slow
def test_a_hanging_rank_is_a_timeout_naming_it(own_tmp):
    r = measure(_tiny_gpt2(HangingGPT2), TrainConfig(micro_batch_size=2, nproc_per_node=2),
                seq_len=32, device="cpu:1GiB", timeout_s=45)
    assert r.timed_out and not r.oom
    assert r.error.startswith("timeout after 45s: rank 1 was furthest behind, in 'warm-up step")
    assert "rank 1 hangs now" in r.error
    assert not _rank_processes()  # every rank killed
    assert not any(own_tmp.iterdir())


class DyingGPT2(GPT2LMHeadModel):
    """Rank 1's process exits in its third forward (a crash: no result written)."""

    calls = 0

    def forward(self, *args, **kwargs):
        import torch.distributed as dist

        DyingGPT2.calls += 1
        if dist.is_initialized() and dist.get_rank() == 1 and DyingGPT2.calls >= 3:
            print("rank 1 crashes now", flush=True)
            os._exit(7)
        return super().forward(*args, **kwargs)


@pytest.mark.slow
def test_a_dying_rank_is_a_failure_naming_it(own_tmp):
    r = measure(_tiny_gpt2(DyingGPT2), TrainConfig(micro_batch_size=2, nproc_per_node=2),
                seq_len=32, device="cpu:1GiB", timeout_s=120)
    assert not r.oom and not r.timed_out and not r.fits
    assert r.error.startswith("rank 1: exited with status 7 in 'warm-up step 1/1"), r.error
    assert "rank 1 crashes now" in r.error
    assert r.per_rank[0]["stopped_by"] == "another rank stopped"
    assert not _rank_processes()


@pytest.mark.slow
def test_ranks_die_with_a_killed_parent(tmp_path):
    """SIGKILL to autofit mid-trial: the launcher, every rank and the work dir (the pickled
    model) are gone within seconds."""
    import signal
    import subprocess
    import sys

    from proc_watch import GONE_WITHIN_S, leftovers, script_env, wait_for

    tmp = tmp_path / "tmp"
    tmp.mkdir()
    script = ("from autofit.config import TrainConfig\nfrom autofit.trial import measure\n"
              "measure('tiny-gpt2', TrainConfig(micro_batch_size=1, nproc_per_node=2), "
              "seq_len=32, device='cpu:1GiB', measure_steps=100000)\n")
    parent = subprocess.Popen([sys.executable, "-c", script], env=script_env(tmp),
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        def measuring():
            return all(any("measured" in f.read_text() for f in tmp.glob(f"autofit-trial-*/"
                                                                       f"rank-{r}.status"))
                       for r in (0, 1))

        wait_for(measuring, 300, "both ranks in their measured steps")
        ranks = _rank_processes()
        assert len(ranks) >= 3  # the launcher and two ranks
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        wait_for(lambda: not _rank_processes(), GONE_WITHIN_S + 5, "every rank process gone")
        wait_for(lambda: not leftovers(tmp), GONE_WITHIN_S, "the work dir removed")
    finally:
        parent.kill()


@pytest.mark.slow
@pytest.mark.skipif(not installed("deepspeed"), reason="DeepSpeed not installed")
def test_zero2_trial_partitions_the_optimizer(own_tmp):
    model = _tiny_gpt2()
    r = measure(model, TrainConfig(micro_batch_size=2, nproc_per_node=2, strategy="zero2"),
                seq_len=32, device="cpu:1GiB", measure_steps=1, timeout_s=400)
    assert r.fits, r.error
    assert len(r.per_rank) == 2 and all(p["device_total_bytes"] for p in r.per_rank)
    assert os.environ.get("DS_ACCELERATOR") in (None, "cpu")
