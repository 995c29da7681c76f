"""Ground-truth per-rank peak memory of one data-parallel training step on the CPU.

The yardstick for autofit's several-process estimates (DDP, FSDP2, DeepSpeed ZeRO),
so it shares no code with the ``autofit`` package: it imports only torch,
transformers, deepspeed, the standard library and the protocol helpers of
``benchmarks/measure_cpu.py`` (kernel counters, batch maker, spec check), which are
themselves autofit-free. Memory is read from the kernel (``/proc/self/statm``,
``VmHWM``), never from torch's counters.

Usage::

    python benchmarks/distributed_measure.py --names ddp2-fp32 --repeat 3
    python benchmarks/distributed_measure.py --all --out benchmarks/results/distributed_measured.json
    python benchmarks/distributed_measure.py --names A,B --out benchmarks/results/distributed_measured.json --merge
    python benchmarks/distributed_measure.py --spec '{"name": "x", ..., "nproc": 2, "strategy": "ddp", ...}'

Spec: measure_cpu.py's dict (``task`` causal-lm, no lora/peft/chunked loss/compile)
plus six keys, all required::

    "nproc": 2,                        # processes (ranks) on this machine
    "strategy": "ddp" | "fsdp" | "zero1" | "zero2" | "zero3",
    "offload": "none" | "optimizer" | "optimizer+params",   # zero*: DeepSpeed offload
                                       # to cpu ("optimizer+params" is ZeRO-3 only)
    "reshard_after_forward": true,     # fsdp only (false = SHARD_GRAD_OP)
    "gradient_as_bucket_view": false,  # ddp only
    "bucket_cap_mb": 25                # ddp only

A key that does not apply to the strategy must keep its default (above).

What each strategy and precision runs (one set of fresh processes per configuration,
launched like ``torchrun``: one ``python`` child per rank with ``RANK``,
``WORLD_SIZE``, ``MASTER_ADDR/PORT``; gloo)::

    ddp    torch DistributedDataParallel(model, bucket_cap_mb, gradient_as_bucket_view),
           torch defaults otherwise (find_unused_parameters=False, broadcast_buffers);
           torch.optim.AdamW(lr=1e-5, weight_decay=0) (foreach resolves to False on CPU);
           clip_grad_norm_(1.0). bf16-mixed = fp32 weights + torch.autocast(bf16) with the
           outputs copied to fp32 (the Trainer's step, as in measure_cpu.py).
    fsdp   FSDP2: fully_shard(layer) for every decoder layer, then fully_shard(model) (the
           root group holds embeddings, final norm, lm_head), mesh = init_device_mesh("cpu",
           (nproc,)), reshard_after_forward as given (the same for layers and root);
           torch AdamW on the sharded DTensor parameters; clip_grad_norm_(1.0).
           bf16-mixed = MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32): fp32
           sharded parameters, bf16 all-gathered parameters, no autocast.
           32-true = MixedPrecisionPolicy() (fp32 everywhere).
           The optional ``fsdp_mp`` names another bf16-mixed recipe: "accelerate" is what
           accelerate's FSDP2 runs for ``mixed_precision="bf16"`` (the Trainer's path):
           MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=bf16) AND torch.autocast
           around forward with the outputs copied to fp32; "autocast" is a hand-written
           loop's: no policy (fp32 all-gathered parameters) and torch.autocast(bf16).
    zero*  deepspeed.initialize(model, model.parameters(), config) with
           {"zero_optimization": {"stage": N, ...}, "optimizer": {"type": "AdamW",
           "params": {"lr": 1e-5, "weight_decay": 0}}, "gradient_clipping": 1.0,
           "bf16": {"enabled": bf16-mixed}}; the zero section is the one autofit emits
           (overlap_comm, contiguous_gradients, sizes "auto", max_live_parameters =
           max_reuse_distance = 1e9) as the Trainer resolves "auto" (``ds_buckets``
           "trainer-auto", the default): reduce_bucket_size = h*h,
           stage3_prefetch_bucket_size = 0.9*h*h, stage3_param_persistence_threshold =
           10*h (h = hidden_size); ``"ds_buckets": "deepspeed-default"`` leaves every size
           at DeepSpeed's default (5e8-element buckets). Offload: {"device": "cpu",
           "pin_memory": false} (pinning needs CUDA). The result records the effective
           zero config and the optimizer classes that ran.
           bf16-mixed = DeepSpeed bf16: the module cast to bf16, fp32 master partitions in
           the optimizer, no autocast. engine(**batch).loss; engine.backward; engine.step.

Protocol (per rank; every rank of a configuration runs the same):

1. Children run with ``MALLOC_MMAP_THRESHOLD_=131072 MALLOC_TRIM_THRESHOLD_=131072
   MALLOC_ARENA_MAX=1 OMP_NUM_THREADS=1`` (+ ``torch.set_num_threads(1)``,
   ``DS_ACCELERATOR=cpu``): blocks >= 128 KiB are their own mmap and go back to the
   kernel when freed, so RSS follows the live tensors. (measure_cpu.py's 64 KiB /
   trim 0 works too; with glibc's defaults per-rank RSS keeps freed full-size
   weights and shows no sharding savings.)
2. Imports, process-group init (``dist.init_process_group("gloo")``, or
   ``deepspeed.init_distributed("gloo")``).
3. Warm-up BEFORE the real model exists: a tiny model of the same class (1 layer,
   hidden 256, vocab 1024: big enough that ZeRO-3 partitions some of it), wrapped by
   the same strategy with the same precision/checkpointing/offload, runs one step at
   batch 1 x seq 8 and is freed (``gc.collect()``). This absorbs one-time setup:
   autograd engine, gloo's first collectives, DeepSpeed's op loading (cpu_adam /
   fused_adam .so, already compiled), kernel setup.
4. Baseline = RSS (``/proc/self/statm``) after a barrier. It contains the interpreter,
   the imports, the process group and the warm-up's residue, and NO tensor of the
   measured model. So every number below INCLUDES the rank's weights (full for DDP,
   its shard for FSDP2/ZeRO-3, plus whatever flat copies the strategy makes): an
   estimator's absolute per-rank peak is compared with ``peak_bytes`` directly.
   ``local_param_bytes`` reports the parameter bytes the rank holds after wrapping
   (storages, each once; ZeRO-3: the partitions ``ds_tensor``), for reference only.
5. The real model is built on every rank (fixed seed, real fp32 weights), checkpointing
   enabled, wrapped, optimizer made; ``model_resident_bytes`` = RSS - baseline then.
   (The full fp32 model exists on every rank before sharding; that transient is before
   the high-water mark is reset and is not counted.)
6. One step (optimizer state appears), reset the high-water mark (``5`` ->
   ``/proc/self/clear_refs``), two more steps; ``peak_bytes = VmHWM - baseline``.
   ``phase_peaks`` from the last step, resetting before each of forward (forward +
   loss), backward, optimizer (clip + step + zero_grad; DeepSpeed: ``engine.step()``).
7. ``steady_rss_after_step_bytes`` = RSS after the last step - baseline.

The result has one entry per rank (``ranks``) and the top-level ``peak_bytes`` /
``peak_rank`` of the rank that peaks.

Facts found on this machine (2 shared cores, torch 2.13.0+cpu, transformers 5.24,
deepspeed 0.19.8):
    - ``pip install deepspeed==0.19.8``: builds a wheel without CUDA (~40 s; pulls hjson,
      ninja, msgpack, einops). ``DS_ACCELERATOR=cpu`` selects the CPU accelerator and the
      op builders ``deepspeed.ops.op_builder.cpu.*``. Their first load JIT-compiles into
      ~/.cache/torch_extensions/py311_cpu/: ``fused_adam`` 113 s, ``cpu_adam`` 201 s here
      (under load; compile once ahead with
      ``DS_ACCELERATOR=cpu python -c "from deepspeed.accelerator import get_accelerator as
      g; [g().create_op_builder(n).load() for n in ('FusedAdamBuilder', 'CPUAdamBuilder')]"``).
      A config whose op is not compiled yet spends that time inside its first
      ``deepspeed.initialize`` (the warm-up here; it stays out of the measurement).
    - Optimizer classes that ran for ``{"type": "AdamW"}`` (recorded per row):
      ZeRO-1/2 ``DeepSpeedZeroOptimizer`` over ``deepspeed.ops.adam.FusedAdam`` (the CPU
      build of fused_adam); ZeRO-3 ``DeepSpeedZeroOptimizer_Stage3`` over ``FusedAdam``;
      with ``offload_optimizer`` ``DeepSpeedCPUAdam`` (fp32 states). NB: autofit's
      emitted config has no optimizer section, so a Trainer run passes its own
      torch AdamW instead (same states, other temporaries).
    - One configuration takes 30-65 s with 2 processes, 115-125 s with 4 (warm-up
      8-15 s; a step 3-20 s; the cores are shared with other work).
    - Repeatable: the ranks of one run agree within 0.25%; three runs of one rank
      within 0.10% (fsdp2-bf16, zero3-bf16) and 0.23% (zero2-bf16-dsdefault); ddp2-fp32
      gave 699.6 MiB in three separate runs (``repeat_peaks`` / ``repeat_spread``).
    - ``warmup_residue_bytes`` (what the warm-up and its imports leave, in the baseline):
      163-180 MiB for DDP/FSDP2, 209-234 MiB for DeepSpeed.
    - With glibc's default malloc thresholds per-rank RSS does not drop when full-size
      tensors are freed (the thresholds grow dynamically up to 32 MiB), so sharding
      shows no saving; with the 128 KiB fixed thresholds above it does.
    - The full fp32 model built on every rank before wrapping is freed by
      ``fully_shard`` / ``deepspeed.initialize`` (RSS after wrapping minus baseline =
      the rank's own share: ``model_resident_bytes``).
    - DeepSpeed's default bucket sizes cost memory even on the CPU: with
      ``"deepspeed-default"`` ZeRO-1 fp32 peaked at 552 MiB vs 518 MiB with the Trainer's
      "auto" sizes, ZeRO-3 bf16 at 530 MiB vs 457 MiB (2 ranks, this llama); ZeRO-2
      bf16 392 MiB either way (the 5e8-element buffers' untouched pages cost nothing
      here; on a GPU they would).
    - ZeRO-3 peaks above ZeRO-2 here (bf16 457 vs 392 MiB, fp32 644 vs 519 MiB, 2 ranks):
      its forward rises above the steady state by about one more full copy of the
      parameters in the compute dtype than ZeRO-2's does (bf16: +190 vs +129 MiB, 2P =
      60 MiB; fp32: +314 vs +194 MiB, 4P = 120 MiB). Neither
      ``stage3_max_reuse_distance = 0`` (456.7 MiB) nor building the model under
      ``deepspeed.zero.Init`` as the Trainer does (456.6 MiB) changes it (one-off runs,
      2026-12-01). The first step peaks lower (317 MiB) only because the optimizer
      states do not exist yet during its forward and backward.
    - ZeRO-1 and ZeRO-2 measure the same to 0.2 MiB (fp32 518.5 / 518.7, bf16 391.9 /
      391.9): both run ``DeepSpeedZeroOptimizer``; here stage 2's gradient
      partitioning saves nothing measurable.

Known limitations:
    NB: RSS counts touched pages only: a buffer allocated with ``torch.empty`` and
    never written (DDP's bucket before its first all-reduce, DeepSpeed's 5e8-element
    reduce bucket beyond what is used) costs nothing here but would on a GPU.
    NB: gloo's own communication buffers (and DeepSpeed's on CPU) are host memory a
    GPU run would hold partly on the host (NCCL) instead.
    NB: offload to cpu on a CPU device moves nothing: it changes which optimizer runs
    (DeepSpeedCPUAdam) and which buffers exist; all of it is in this RSS, so an
    estimate's device peak + host bytes is what compares with it.
    NB: torch DDP's defaults, not the Trainer's: the Trainer passes
    ``find_unused_parameters = not gradient_checkpointing`` for a PreTrainedModel.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

import measure_cpu as mc  # noqa: E402  (autofit-free protocol helpers, benchmarks dir)

CHILD_ENV = {
    "MALLOC_MMAP_THRESHOLD_": "131072",  # bytes; larger blocks are mmap'd, freed to the OS
    "MALLOC_TRIM_THRESHOLD_": "131072",
    "MALLOC_ARENA_MAX": "1",  # one arena: no per-thread heaps (gloo/autograd threads)
    "OMP_NUM_THREADS": "1",
    "DS_ACCELERATOR": "cpu",
    "CUDA_VISIBLE_DEVICES": "",
    "TOKENIZERS_PARALLELISM": "false",
}

DIST_KEYS = ("nproc", "strategy", "offload", "reshard_after_forward",
             "gradient_as_bucket_view", "bucket_cap_mb")
DIST_DEFAULTS = {"reshard_after_forward": True, "gradient_as_bucket_view": False,
                 "bucket_cap_mb": 25}
DIST_OPTIONAL = ("ds_buckets",  # zero*: "trainer-auto" (default) | "deepspeed-default"
                 "fsdp_mp")  # fsdp bf16-mixed: "policy" (default) | "accelerate" | "autocast"
FSDP_MP = ("policy", "accelerate", "autocast")
DS_BUCKETS = ("trainer-auto", "deepspeed-default")
STRATEGIES = ("ddp", "fsdp", "zero1", "zero2", "zero3")
OFFLOADS = ("none", "optimizer", "optimizer+params")
DIST_PRECISIONS = ("32-true", "bf16-mixed")
KEY_STRATEGY = {"reshard_after_forward": ("fsdp",), "gradient_as_bucket_view": ("ddp",),
                "bucket_cap_mb": ("ddp",)}
LR = 1e-5
WARMUP_CONFIG = {"hidden_size": 256, "num_hidden_layers": 1, "num_attention_heads": 4,
                 "num_key_value_heads": 2, "intermediate_size": 688, "vocab_size": 1024}
RESULT_MARK = "@@DIST_RESULT@@ "


def check_spec(spec: dict[str, Any]) -> None:
    """Raise ValueError listing every problem of ``spec`` (measure_cpu's keys + DIST_KEYS)."""
    problems = []
    base = {k: v for k, v in spec.items() if k not in DIST_KEYS + DIST_OPTIONAL}
    try:
        mc.check_spec(base)
    except ValueError as e:
        problems.append(str(e).split(": ", 1)[1])
    missing = [k for k in DIST_KEYS if k not in spec]
    if missing:
        problems.append(f"missing keys {missing}")
    n = spec.get("nproc")
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        problems.append(f"nproc must be an int >= 1, got {n!r}")
    strategy = spec.get("strategy")
    if strategy not in STRATEGIES:
        problems.append(f"strategy {strategy!r} not in {list(STRATEGIES)}")
    offload = spec.get("offload")
    if offload not in OFFLOADS:
        problems.append(f"offload {offload!r} not in {list(OFFLOADS)}")
    elif offload != "none" and not str(strategy).startswith("zero"):
        problems.append(f"offload {offload!r} is measured for zero1/2/3 only")
    elif offload == "optimizer+params" and strategy != "zero3":
        problems.append("offload 'optimizer+params' needs strategy zero3 (ZeRO offloads "
                        "parameters at stage 3 only)")
    for key, owners in KEY_STRATEGY.items():
        if key in spec and strategy not in owners and spec[key] != DIST_DEFAULTS[key]:
            problems.append(f"{key} applies to {'/'.join(owners)} only: keep "
                            f"{DIST_DEFAULTS[key]!r} for {strategy}")
    if "ds_buckets" in spec:
        if spec["ds_buckets"] not in DS_BUCKETS:
            problems.append(f"ds_buckets {spec['ds_buckets']!r} not in {list(DS_BUCKETS)}")
        elif not str(strategy).startswith("zero"):
            problems.append("ds_buckets applies to zero1/2/3 only")
    if "fsdp_mp" in spec:
        if spec["fsdp_mp"] not in FSDP_MP:
            problems.append(f"fsdp_mp {spec['fsdp_mp']!r} not in {list(FSDP_MP)}")
        elif strategy != "fsdp" or spec.get("precision") != "bf16-mixed":
            problems.append("fsdp_mp applies to fsdp with bf16-mixed only")
    if not isinstance(spec.get("reshard_after_forward", True), bool):
        problems.append("reshard_after_forward must be true or false")
    if not isinstance(spec.get("gradient_as_bucket_view", False), bool):
        problems.append("gradient_as_bucket_view must be true or false")
    cap = spec.get("bucket_cap_mb", 25)
    if not isinstance(cap, (int, float)) or isinstance(cap, bool) or cap <= 0:
        problems.append(f"bucket_cap_mb must be a positive number, got {cap!r}")
    if spec.get("precision") not in DIST_PRECISIONS:
        problems.append(f"precision {spec.get('precision')!r} not in {list(DIST_PRECISIONS)} "
                        "(what each means per strategy: see the module docstring)")
    if spec.get("task") != "causal-lm":
        problems.append("task must be causal-lm")
    if spec.get("optimizer") != "adamw_torch" or spec.get("optim_args") is not None:
        problems.append("optimizer must be adamw_torch with optim_args null (zero*: "
                        "DeepSpeed's {'type': 'AdamW'} runs)")
    for key in ("lora", "peft", "chunked_loss", "torch_compile"):
        if spec.get(key):
            problems.append(f"{key} is not measured with several processes")
    if problems:
        raise ValueError(f"spec {spec.get('name')!r}: " + "; ".join(problems))


# --------------------------------------------------------------------------- parent side


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def parse_rank_output(stdout: str) -> dict[str, Any] | None:
    """The result dict a rank printed after RESULT_MARK, or None when it printed none."""
    for line in stdout.splitlines():
        if line.startswith(RESULT_MARK):
            return json.loads(line[len(RESULT_MARK):])
    return None


def combine(spec: dict[str, Any], ranks: list[dict[str, Any]], wall_s: float) -> dict[str, Any]:
    """One configuration's result from its ranks' results: the peak of the rank that peaks,
    the spread between ranks, shared facts from rank 0."""
    ranks = sorted(ranks, key=lambda r: r["rank"])
    if [r["rank"] for r in ranks] != list(range(spec["nproc"])):
        raise RuntimeError(f"{spec['name']}: got ranks {[r['rank'] for r in ranks]}, "
                           f"expected 0..{spec['nproc'] - 1}")
    peaks = [r["peak_bytes"] for r in ranks]
    top = max(range(len(ranks)), key=lambda i: peaks[i])
    r0 = ranks[0]
    shared = ("param_count", "optimizer_class", "basic_optimizer_class", "zero_config",
              "torch_version", "transformers_version", "deepspeed_version")
    return {
        "name": spec["name"],
        "nproc": spec["nproc"],
        "strategy": spec["strategy"],
        "peak_bytes": peaks[top],
        "peak_rank": ranks[top]["rank"],
        "rank_spread": (max(peaks) - min(peaks)) / max(peaks),
        **{k: r0.get(k) for k in shared},
        "wall_s": wall_s,
        "ranks": [{k: v for k, v in r.items() if k not in shared + ("spec",)} for r in ranks],
        "spec": spec,
    }


def measure(spec: dict[str, Any], timeout_s: float = 900.0) -> dict[str, Any]:
    """Measure one spec with ``spec["nproc"]`` fresh processes; return the combined result.

    Raises:
        ValueError: the spec is malformed.
        RuntimeError: a rank failed or timed out (its stderr tail is in the message).
    """
    check_spec(spec)
    n = spec["nproc"]
    port = _free_port()
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="distmeas-") as tmp:
        procs, files = [], []
        for rank in range(n):
            env = {**os.environ, **CHILD_ENV, "MASTER_ADDR": "127.0.0.1",
                   "MASTER_PORT": str(port), "RANK": str(rank), "LOCAL_RANK": str(rank),
                   "WORLD_SIZE": str(n), "LOCAL_WORLD_SIZE": str(n)}
            out = open(Path(tmp) / f"rank{rank}.out", "w+")  # noqa: SIM115 (closed below)
            err = open(Path(tmp) / f"rank{rank}.err", "w+")  # noqa: SIM115
            files.append((out, err))
            cmd = [sys.executable, str(Path(__file__).resolve()), "--child", json.dumps(spec)]
            procs.append(subprocess.Popen(cmd, env=env, stdout=out, stderr=err, cwd=tmp))
        deadline = time.monotonic() + timeout_s
        failed = None
        try:
            while any(p.poll() is None for p in procs):
                if time.monotonic() > deadline:
                    failed = f"timed out after {timeout_s:.0f} s"
                    break
                if any(p.poll() not in (None, 0) for p in procs):
                    failed = "a rank exited with an error"
                    break
                time.sleep(0.2)
        finally:
            for p in procs:  # only the processes started here, by their own handle
                if p.poll() is None:
                    p.kill()
                    p.wait()
        results, tails = [], []
        for rank, (out, err) in enumerate(files):
            out.seek(0)
            err.seek(0)
            r = parse_rank_output(out.read())
            if r is None:
                tails.append(f"--- rank {rank} (exit {procs[rank].returncode}):\n"
                             + err.read()[-3000:])
            else:
                results.append(r)
            out.close()
            err.close()
    if failed or tails:
        raise RuntimeError(f"measuring {spec['name']!r} failed ({failed or 'no result'}):\n"
                           + "\n".join(tails))
    return combine(spec, results, time.perf_counter() - t0)


# --------------------------------------------------------------------------- child side


def _storage_bytes(tensors) -> int:
    """Bytes of the storages behind ``tensors``, each storage once (DTensor: local shard)."""
    seen: dict[int, int] = {}
    for t in tensors:
        local = t.to_local() if hasattr(t, "to_local") else t
        if hasattr(local, "ds_tensor"):  # ZeRO-3: the partition this rank owns
            local = local.ds_tensor
        storage = local.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def _build(spec: dict[str, Any], config_kwargs: dict[str, Any]):
    """A causal LM from its config (fixed seed, real fp32 weights), checkpointing as asked."""
    import torch
    import transformers

    config = transformers.AutoConfig.for_model(spec["model_type"], **config_kwargs)
    torch.manual_seed(mc.SEED_MODEL)
    model = transformers.AutoModelForCausalLM.from_config(
        config, attn_implementation=spec["attn_implementation"])
    if spec["gradient_checkpointing"]:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
    model.train()
    return model, config


def _ds_config(spec: dict[str, Any]) -> dict[str, Any]:
    """The DeepSpeed config: ZeRO stage, offload to cpu as asked, AdamW, clipping, bf16.

    ``ds_buckets`` "trainer-auto" (the default): the zero section a Trainer user writes
    (overlap_comm, contiguous_gradients, sizes ``"auto"``) as transformers resolves it
    (``HfTrainerDeepSpeedConfig.trainer_config_finalize``): reduce_bucket_size = h*h,
    stage3_prefetch_bucket_size = int(0.9*h*h), stage3_param_persistence_threshold = 10*h
    (h = hidden_size); stage3_max_live_parameters = stage3_max_reuse_distance = 1e9.
    "deepspeed-default": only the stage and offload; DeepSpeed's defaults for the rest."""
    stage = int(spec["strategy"][-1])
    zero: dict[str, Any] = {"stage": stage}
    if spec.get("ds_buckets", "trainer-auto") == "trainer-auto":
        h = spec["config"]["hidden_size"]
        zero.update({"overlap_comm": True, "contiguous_gradients": True,
                     "reduce_bucket_size": h * h})
        if stage == 3:
            zero.update({"stage3_prefetch_bucket_size": int(0.9 * h * h),
                         "stage3_param_persistence_threshold": 10 * h,
                         "stage3_max_live_parameters": int(1e9),
                         "stage3_max_reuse_distance": int(1e9)})
    if spec["offload"] in ("optimizer", "optimizer+params"):
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": False}
    if spec["offload"] == "optimizer+params":
        zero["offload_param"] = {"device": "cpu", "pin_memory": False}
    return {
        "train_micro_batch_size_per_gpu": spec["batch"],
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0}},
        "zero_optimization": zero,
        "bf16": {"enabled": spec["precision"] == "bf16-mixed"},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }


class _Run:
    """A wrapped model + its optimizer: ``step(batch, mark)`` runs one training step."""

    def __init__(self, spec: dict[str, Any], model) -> None:
        import torch

        self.spec = spec
        self.model = model
        self.autocast = None
        self.info: dict[str, Any] = {}
        strategy = spec["strategy"]
        if strategy == "ddp":
            from torch.nn.parallel import DistributedDataParallel as DDP

            self.module = DDP(model, bucket_cap_mb=spec["bucket_cap_mb"],
                              gradient_as_bucket_view=spec["gradient_as_bucket_view"])
            if spec["precision"] == "bf16-mixed":
                self.autocast = torch.bfloat16
            self.optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
        elif strategy == "fsdp":
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

            mesh = init_device_mesh("cpu", (spec["nproc"],))
            recipe = spec.get("fsdp_mp", "policy") if spec["precision"] == "bf16-mixed" else None
            mp = {"policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                 reduce_dtype=torch.float32),
                  "accelerate": MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                     reduce_dtype=torch.bfloat16),
                  }.get(recipe, MixedPrecisionPolicy())
            if recipe in ("accelerate", "autocast"):
                self.autocast = torch.bfloat16
            raf = spec["reshard_after_forward"]
            for layer in model.model.layers:
                fully_shard(layer, mesh=mesh, mp_policy=mp, reshard_after_forward=raf)
            fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=raf)
            self.module = model
            self.optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
        else:
            import deepspeed

            cfg = _ds_config(spec)
            self.module, self.optimizer, _, _ = deepspeed.initialize(
                model=model, model_parameters=[p for p in model.parameters()], config=cfg)
            basic = getattr(self.module, "basic_optimizer", None)
            self.info = {
                "optimizer_class": type(self.module.optimizer).__name__,
                "basic_optimizer_class": type(basic).__name__ if basic is not None else None,
                "zero_config": json.loads(self.module._config.zero_config.model_dump_json()),
                "ds_config": cfg,
            }
        if "optimizer_class" not in self.info:
            self.info["optimizer_class"] = type(self.optimizer).__name__
            self.info["basic_optimizer_class"] = None
            self.info["zero_config"] = None

    def params(self):
        return list(self.model.parameters())

    def step(self, batch, mark=None) -> float:
        import contextlib

        import torch

        mark = mark or (lambda phase: None)
        mark("forward")
        if self.spec["strategy"].startswith("zero"):
            loss = self.module(**batch).loss
            mark("backward")
            self.module.backward(loss)
            mark("optimizer")
            self.module.step()
            mark(None)
            return float(loss.detach().float())
        ctx = (torch.autocast("cpu", dtype=self.autocast) if self.autocast
               else contextlib.nullcontext())
        with ctx:
            outputs = self.module(**batch)
        if self.autocast:
            outputs = mc._half_to_fp32(outputs)  # the Trainer's convert_outputs_to_fp32
        loss = outputs["loss"]
        del outputs
        mark("backward")
        loss.backward()
        mark("optimizer")
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        mark(None)
        return float(loss.detach().float())

    def close(self) -> None:
        if self.spec["strategy"].startswith("zero"):
            self.module.destroy()
        self.module = self.optimizer = self.model = None


def measure_steps(step, baseline: int) -> dict[str, Any]:
    """Steps 6-7 of the protocol around ``step(mark=None)`` (one training step; ``mark`` the
    phase hook): one step, reset the high-water mark, two steps (phases of the last).
    Every number is bytes above ``baseline`` (an RSS)."""
    mc._reset_hwm()
    step()  # optimizer state appears
    first_step_peak = mc._hwm_bytes() - baseline
    mc._reset_hwm()
    t0 = time.perf_counter()
    step()
    marks = mc._PhaseMarks(baseline)
    loss = step(mark=marks)
    step_time_s = (time.perf_counter() - t0) / 2
    # VmHWM is a running max: the peak over both steps is the mark read before the last
    # step's first reset, or one of its phases' peaks.
    return {
        "peak_bytes": max(marks.before, *marks.peaks.values()),
        "phase_peaks": marks.peaks,
        "first_step_peak_bytes": first_step_peak,
        "steady_rss_after_step_bytes": mc._rss_bytes() - baseline,
        "loss": loss,
        "step_time_s": step_time_s,
    }


def _child(spec: dict[str, Any]) -> dict[str, Any]:
    t_start = time.perf_counter()
    import torch

    torch.set_num_threads(1)
    import torch.distributed as dist
    import transformers

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    ds_version = None
    if spec["strategy"].startswith("zero"):
        import deepspeed

        ds_version = deepspeed.__version__
        deepspeed.init_distributed(dist_backend="gloo")
    else:
        dist.init_process_group("gloo")
    assert dist.get_world_size() == world == spec["nproc"], "world size mismatch"

    # Warm-up: a tiny model of the same class and strategy, one step, then freed.
    rss_before_warmup = mc._rss_bytes()
    t_warm = time.perf_counter()
    tiny, tiny_cfg = _build(spec, WARMUP_CONFIG)
    run = _Run(spec, tiny)
    run.step(mc._make_batch(spec, tiny_cfg, mc.WARMUP_BATCH, mc.WARMUP_SEQ))
    run.close()
    del run, tiny
    gc.collect()
    warmup_s = time.perf_counter() - t_warm
    dist.barrier()

    baseline = mc._rss_bytes()  # bytes: imports, process group, warm-up residue; no model
    model, config = _build(spec, spec["config"])
    param_count = sum(p.numel() for p in model.parameters())
    run = _Run(spec, model)
    gc.collect()
    model_resident = mc._rss_bytes() - baseline
    local_params = _storage_bytes(run.params())
    batch = mc._make_batch(spec, config, spec["batch"], spec["seq"])
    dist.barrier()

    steps = measure_steps(lambda mark=None: run.step(batch, mark=mark), baseline)
    info = run.info
    dist.barrier()
    result = {
        "rank": rank,
        **steps,
        "model_resident_bytes": model_resident,
        "local_param_bytes": local_params,
        "baseline_rss_bytes": baseline,
        "warmup_residue_bytes": baseline - rss_before_warmup,
        "warmup_s": warmup_s,
        "wall_s": time.perf_counter() - t_start,
        "param_count": param_count,
        **{k: info[k] for k in ("optimizer_class", "basic_optimizer_class", "zero_config")},
        "torch_version": torch.__version__,
        "transformers_version": transformers.__version__,
        "deepspeed_version": ds_version,
        "spec": spec,
    }
    dist.destroy_process_group()
    return result


# --------------------------------------------------------------------------- CLI


def load_configs() -> list[dict[str, Any]]:
    """CONFIGS from benchmarks/distributed_configs.py (loaded by path)."""
    path = HERE / "distributed_configs.py"
    mod_spec = importlib.util.spec_from_file_location("_autofit_bench_dist_configs", path)
    module = importlib.util.module_from_spec(mod_spec)
    mod_spec.loader.exec_module(module)
    return module.CONFIGS


def _mib(n: float) -> str:
    return f"{n / 2**20:7.1f}"


def _row(r: dict[str, Any]) -> str:
    per_rank = " ".join(f"r{x['rank']} {_mib(x['peak_bytes'])}" for x in r["ranks"])
    ph = r["ranks"][r["peak_rank"]]["phase_peaks"]
    opt = r["optimizer_class"] + (f"/{r['basic_optimizer_class']}"
                                  if r.get("basic_optimizer_class") else "")
    return (f"{r['name']:<30} peak {_mib(r['peak_bytes'])} MiB (rank {r['peak_rank']}; "
            f"{per_rank}) | fwd {_mib(ph['forward'])} bwd {_mib(ph['backward'])} "
            f"opt {_mib(ph['optimizer'])} | {opt} | {r['wall_s']:5.1f} s")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--names", help="comma-separated spec names from distributed_configs.py")
    parser.add_argument("--all", action="store_true", help="every spec in distributed_configs.py")
    parser.add_argument("--spec", help="one spec as a JSON object")
    parser.add_argument("--repeat", type=int, default=1, help="measure each spec N times")
    parser.add_argument("--out", help="write the list of results here (JSON)")
    parser.add_argument("--timeout", type=float, default=900.0,
                        help="seconds one configuration's processes may run")
    parser.add_argument("--merge", action="store_true",
                        help="with --out: keep that file's other results, replace those "
                             "measured again (by name)")
    args = parser.parse_args(argv)

    if args.child:
        result = _child(json.loads(args.child))
        print(RESULT_MARK + json.dumps(result), flush=True)
        return 0

    if args.spec:
        specs = [json.loads(args.spec)]
    else:
        configs = load_configs()
        if args.all:
            specs = configs
        elif args.names:
            by_name = {c["name"]: c for c in configs}
            wanted = [n.strip() for n in args.names.split(",") if n.strip()]
            unknown = [n for n in wanted if n not in by_name]
            if unknown:
                parser.error(f"unknown names {unknown}; known: {', '.join(by_name)}")
            specs = [by_name[n] for n in wanted]
        else:
            parser.error("give --names, --all or --spec")

    results, failed = [], []
    for i, spec in enumerate(specs, 1):
        peaks = []
        for rep in range(args.repeat):
            print(f"[{i}/{len(specs)}] {spec['name']} (run {rep + 1})...", flush=True)
            try:
                r = measure(spec, timeout_s=args.timeout)
            except (RuntimeError, ValueError) as e:
                print(f"FAILED\n{e}", flush=True)
                failed.append(spec["name"])
                break
            peaks.append([x["peak_bytes"] for x in r["ranks"]])
            print(_row(r), flush=True)
            if rep == 0:
                results.append(r)
            else:
                results[-1].setdefault("repeat_peaks", [peaks[0]]).append(peaks[-1])
        if len(peaks) > 1:
            per_rank = list(zip(*peaks, strict=True))
            spread = max((max(p) - min(p)) / max(p) for p in per_rank)
            results[-1]["repeat_spread"] = spread
            print(f"    spread over {len(peaks)} runs (worst rank): {spread:.3%}", flush=True)

    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        if args.merge and out.exists():  # replaced in place, new names appended
            new = {r["name"]: r for r in results}
            old = json.loads(out.read_text())
            kept = {r["name"] for r in old}
            results = ([new.get(r["name"], r) for r in old]
                       + [r for r in results if r["name"] not in kept])
        out.write_text(json.dumps(results, indent=1) + "\n")
        print(f"wrote {len(results)} results to {out}")
    if failed:
        print(f"{len(failed)} failed: {', '.join(failed)}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
