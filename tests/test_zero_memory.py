"""ZeRO-1 saves the memory it promises (issue 51), measured for real: the bench's memory job
(an MLP of 16.8 M parameters with Adam, ``hvdkit.bench.memory``) at 1, 2 and 4 ranks, plain
and sharded, each variant in processes of its own on the exact heap the bench measures
memory with (blocks over 1 MiB mapped on their own and returned when freed). (The bench's
quick run, tests/test_bench.py, leaves its memory section to this test.)

- The peak (of the rank that peaked highest: each receives its slice at another point of
  the backward pass) with ``shard_optimizer`` is below plain's by at least 80% of what
  sharding takes off the state ((N-1)/N of Adam's 134 MB), at np=2 and np=4 (4 ranks on 2
  cores is fine for memory); with ``shard_optimizer="gradients"`` (stage 2) by 80% of what
  it takes off the state and the gradients.
- The cost model (:func:`hvdkit.bench.costmodel.rank_memory`: weights, gradients, state/N,
  the reduced slice, the buffers the implementation bounds, and what one rank measured
  beyond its tensors) holds the measured peak within 10%, both stages at np=2 and np=4. Plain's
  peak is held within 10% of the model without Horovod's fusion buffer and at most the model
  with it: Horovod touches that buffer as far as its largest fused response, which depends on
  how the gradients' readiness fell into its cycles (18 to 36 MB of the 67 MB in short runs).

The model's buffers are bounds ZeRO keeps whatever the timing, so the figures hold with both
cores busy (measured with two spinning processes beside it: within 1 MB of quiet). Before
ZeRO bounded its inputs in flight, stage 2's np=4 peak rose 12% over the model under load.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from conftest import ROOT

from hvdkit.bench import report
from hvdkit.bench.worker import EXACT_HEAP, parse_results
from hvdkit.launch.horovodrun import launcher_argv


def measure(variant: str, np: int) -> dict:
    argv = launcher_argv(["horovodrun", "-np", str(np), sys.executable, "-m",
                          "hvdkit.bench.memory", "--variant", variant, "--steps", "2",
                          "--rounds", "1"])  # fmt: skip
    out = subprocess.run(argv, capture_output=True, text=True, timeout=240, cwd=ROOT,
                         stdin=subprocess.DEVNULL, env={**os.environ, **EXACT_HEAP})  # fmt: skip
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    (result,) = parse_results(out.stdout)
    return {"section": "memory", "label": f"memory {variant} np={np}", "np": np,
            "controller": "gloo", "variant": variant, "result": result}  # fmt: skip


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(900)
def test_sharding_saves_the_promised_memory_at_peak_and_the_model_holds_it(capsys):
    records = [measure(v, n) for n in (1, 2, 4) for v in ("plain", "sharded", "gradients")
               if n > 1 or v != "gradients"]  # fmt: skip
    summary = report.summarize(records)
    by_np = summary["memory"]["by_np"]
    with capsys.disabled():  # the figures go into the CI log
        print("\n" + report.table({"memory": summary["memory"]}))
    for n in ("2", "4"):
        assert by_np[n]["state_vs_plain"] == pytest.approx(1.0, abs=0.01)  # Adam's state: 1/N
        assert by_np[n]["peak_saving"] >= 0.8, by_np[n]
        assert by_np[n]["stage2_peak_saving"] >= 0.8, by_np[n]
        for variant in ("sharded", "gradients"):
            peak, model = by_np[n][variant]["peak_growth_bytes"], by_np[n][variant]["model"]
            assert abs(peak / model["total"] - 1) <= 0.1, (n, variant, peak, model)
        plain, model = by_np[n]["plain"]["peak_growth_bytes"], by_np[n]["plain"]["model"]
        assert 0.9 * (model["total"] - model["buffers"]) <= plain <= 1.1 * model["total"], (
            n, plain, model)  # fmt: skip
