"""npukern_torch.parallel on real processes: 2 and 3 ranks talking gloo over
127.0.0.1 (a free port each run), bounded by a timeout so a stuck rank fails
the test instead of hanging CI. The ranks run dist_worker.py."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import record
from tiny_llama import VOCAB

HERE = Path(__file__).resolve().parent
TIMEOUT_S = 240


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(world, mode, tmp_path):
    """Starts `world` ranks of dist_worker.py; returns their JSON results."""
    port = free_port()
    procs, outs = [], []
    for rank in range(world):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1",
                   PYTHONPATH=str(HERE) + os.pathsep + os.environ.get("PYTHONPATH", ""))
        out = tmp_path / f"{mode}-{world}-{rank}.json"
        log = open(tmp_path / f"{mode}-{world}-{rank}.log", "w")
        procs.append((subprocess.Popen([sys.executable, str(HERE / "dist_worker.py"), mode, str(out)],
                                       env=env, cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT), log))
        outs.append(out)
    try:
        for p, _ in procs:
            p.wait(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"a rank did not finish within {TIMEOUT_S} s")
    finally:
        for p, log in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
            log.close()
    for rank, (p, _) in enumerate(procs):
        text = (tmp_path / f"{mode}-{world}-{rank}.log").read_text()
        assert p.returncode == 0, f"rank {rank} exited {p.returncode}:\n{text[-3000:]}"
    return [json.loads(o.read_text()) for o in outs]


@pytest.fixture(scope="module", params=[2, 3], ids=lambda w: f"{w}ranks")
def ranks(request, tmp_path_factory):
    """One launch of `world` ranks per world size; the tests read its results."""
    return request.param, run_ranks(request.param, "all", tmp_path_factory.mktemp(f"ranks{request.param}"))


def test_training_equals_one_process(ranks):
    world, results = ranks
    assert VOCAB % 3 != 0  # the 3-rank split is uneven
    for r in results:
        off, on = r["inactive"], r["active"]
        # Clipping inactive: every gradient, loss and weight bit for bit.
        assert off["clip_active_steps"] == 0
        assert off["losses_bit_identical"] and off["grads_bit_identical"] and off["weights_bit_identical"], off
        # Clipping active: the weights to 1e-6 and the norms to 1e-12: npukern's
        # grad_stats adds exact f64 squares (src/ops/grad_stats), so where the
        # shards cut the table moves the sum only in its last f64 bits.
        assert on["clip_active_steps"] > 0
        record(f"parallel ({world} ranks) clip active: norm rel diff", on["max_norm_rel"])
        record(f"parallel ({world} ranks) clip active: max weight diff", on["max_weight_diff"])
        record(f"parallel ({world} ranks) clip inactive: norm rel diff", off["max_norm_rel"])
        record(f"parallel ({world} ranks) clip active: weights bit-identical (1 = yes)",
               float(on["weights_bit_identical"]))
        assert on["max_norm_rel"] <= 1e-12 and off["max_norm_rel"] <= 1e-12
        assert on["max_weight_diff"] <= 1e-6


def test_shard_semantics(ranks):
    for r in ranks[1]:
        assert r["shard_grads_bit_identical"]
        assert "position 2, value 23" in r["index_error_23"], r
        assert "position 2, value -1" in r["index_error_-1"], r
        assert r["nan_seen"] and r["nonfinite_raised"] and r["replicated_once"], r


def test_rank_local_failures_raise_on_every_rank(ranks):
    """Review defect 6: one rank's failure raises the same type on every rank
    (nobody waits for the timeout), and the next step is not mixed up."""
    world, results = ranks
    for r in results:
        f = r["failures"]
        assert f["bad_id_one_rank"][0] == "IndexError", f
        assert f["different_indices"][0] == "ValueError" and "same indices" in f["different_indices"][1], f
        assert f["bad_max_norm_one_rank"][0] == "ValueError", f
        assert f["complex_grad_one_rank"][0] == "TypeError", f
        assert f["next_step_ok"] and f["next_clip_ok"] and f["untouched_after_failure"], f
    assert "value 23" in results[-1]["failures"]["bad_id_one_rank"][1]
    assert "rank(s) of the process group failed" in results[0]["failures"]["bad_id_one_rank"][1]


def test_float64_in_both_layers(ranks):
    """Review defect 4: VocabParallelEmbedding and parallel.clip_grad_norm_
    take float64 as the single-process layer does (torch's arithmetic)."""
    for r in ranks[1]:
        f = r["failures"]
        for pad in ("None", "4"):
            assert f[f"f64_lookup_equal_{pad}"], f
            assert f[f"f64_grad_diff_{pad}"] <= 1e-12, f
            assert f[f"f64_clip_rel_{pad}"] <= 1e-12, f


def test_vocab_range_partition():
    from npukern_torch.parallel import vocab_range

    for n in (0, 1, 2, 7, 50, 32000):
        for world in (1, 2, 3, 4, 7):
            ranges = [vocab_range(n, r, world) for r in range(world)]
            assert ranges[0][0] == 0 and ranges[-1][1] == n
            assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
            sizes = [e - s for s, e in ranges]
            assert max(sizes) - min(sizes) <= 1
    with pytest.raises(ValueError):
        vocab_range(5, 2, 2)


def test_single_rank_group(tmp_path):
    """world size 1: the layer is the whole table and needs no collective."""
    results = run_ranks(1, "semantics", tmp_path)
    assert results[0]["shard_grads_bit_identical"]
    assert torch.__version__  # torch imported in this process too


def test_readme_example_runs(tmp_path):
    """examples/vocab_parallel.py as the README runs it (2 ranks it spawns itself)."""
    example = HERE.parent / "examples" / "vocab_parallel.py"
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo")
    out = subprocess.run([sys.executable, str(example), "--steps", "2"], capture_output=True, text=True,
                         timeout=TIMEOUT_S, cwd=tmp_path, env=env)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert "bit-identical to one process: True" in out.stdout
