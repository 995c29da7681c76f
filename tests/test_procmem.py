"""A measuring child's environment (``procmem.CHILD_MALLOC_ENV``): its address space
does not grow with the run's variable lengths, so a capped CPU's ``RLIMIT_AS`` bounds
the tensors, not oneDNN's per-shape JIT kernels (which a GPU does not have)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from autofit.trial import runner

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="reads VmSize from /proc")

MiB = 1 << 20
# a tiny BERT (GELU runs through oneDNN) trained on 40 lengths it has not seen
NEW_LENGTHS = """
import torch, transformers
from autofit.trial.procmem import vm_size_bytes
torch.manual_seed(0)
cfg = transformers.AutoConfig.for_model("bert", vocab_size=1000, hidden_size=32,
    num_hidden_layers=1, num_attention_heads=2, intermediate_size=64)
m = transformers.BertForSequenceClassification(cfg)
def step(t):
    m(input_ids=torch.randint(0, 1000, (2, t)), labels=torch.zeros(2, dtype=torch.long)).loss.backward()
for t in (8, 9, 10):
    step(t)
before = vm_size_bytes()
for t in range(11, 51):
    step(t)
print(vm_size_bytes() - before)
"""


def _growth(env: dict[str, str]) -> int:
    out = subprocess.run([sys.executable, "-c", NEW_LENGTHS], env=env, capture_output=True,
                         text=True, timeout=300, check=True)
    return int(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow  # the evidence behind CHILD_MALLOC_ENV's oneDNN setting (two fresh processes)
def test_a_measuring_childs_address_space_does_not_grow_with_new_lengths():
    env = runner._child_env()  # what a trial child (and the trial server) is started with
    grown = _growth(env)
    # the same steps with oneDNN's primitive cache at its default: the growth this prevents
    cached = dict(env)
    cached.pop("ONEDNN_PRIMITIVE_CACHE_CAPACITY")
    grown_cached = _growth(cached)
    assert grown < 4 * MiB, f"{grown / MiB:.1f} MiB mapped over 40 new lengths"
    assert grown_cached > 3 * grown + 8 * MiB, (grown / MiB, grown_cached / MiB)


def test_a_trial_s_leak_check_counts_anonymous_memory_not_code_pages(tmp_path):
    """What a trial leaves behind is anonymous memory; pages of a file read through
    a mapping (as a kernel's code pages are, the first time it runs) are not."""
    import gc
    import mmap

    from autofit.trial.procmem import anon_rss_bytes, malloc_trim, rss_bytes

    path = tmp_path / "pages.bin"
    path.write_bytes(b"\1" * (64 * MiB))
    gc.collect()
    malloc_trim()
    gc.disable()  # (a collection in between would free other tests' garbage: a worker's
    try:          # memory would shrink under the measurement)
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as pages:
            anon0, rss0 = anon_rss_bytes(), rss_bytes()
            total = sum(pages[i] for i in range(0, len(pages), 4096))  # touch every page
            assert total == 64 * MiB // 4096
            assert rss_bytes() - rss0 > 48 * MiB  # resident...
            assert anon_rss_bytes() - anon0 < 8 * MiB  # ...but not anonymous
        anon1 = anon_rss_bytes()
        held = bytearray(64 * MiB)
        held[::4096] = b"\2" * len(held[::4096])
        assert anon_rss_bytes() - anon1 > 48 * MiB  # what a leak looks like
        del held
    finally:
        gc.enable()
