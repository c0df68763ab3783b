"""Start-up from launcher variables, the CPU compatibility layer, and failure without hangs."""

import contextlib
import os
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from mcore_rl.runtime import read_launch_env
from world import run_world

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_torchrun_variables_win_over_slurm():
    env = {"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "MASTER_ADDR": "n0",
           "MASTER_PORT": "1234", "SLURM_PROCID": "0", "SLURM_NTASKS": "2"}
    launch = read_launch_env(env)
    assert (launch.rank, launch.world_size, launch.local_rank, launch.launcher) == (3, 8, 1,
                                                                                     "torchrun")
    assert (launch.master_addr, launch.master_port) == ("n0", 1234)


def test_srun_variables_and_missing_master_addr():
    env = {"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1", "MASTER_ADDR": "n1"}
    launch = read_launch_env(env)
    assert (launch.rank, launch.world_size, launch.local_rank, launch.launcher) == (5, 8, 1, "slurm")
    with pytest.raises(ValueError, match="MASTER_ADDR"):
        read_launch_env({"SLURM_PROCID": "0", "SLURM_NTASKS": "2"})
    with pytest.raises(ValueError, match="RANK='x'"):
        read_launch_env({"RANK": "x", "WORLD_SIZE": "2"})
    assert read_launch_env({}).world_size == 1



def test_a_single_process_job_does_not_need_port_29500():
    """Without a launcher a job is a world of one: it must start while another job holds
    torch's default port (two conversions at once on one machine)."""
    import socket

    env = {key: value for key, value in os.environ.items()
           if key not in ("MASTER_PORT", "RANK", "WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS")}
    with socket.socket() as other_job:
        other_job.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        other_job.bind(("127.0.0.1", 29500))
        other_job.listen()
        done = subprocess.run([sys.executable, "-c", "from mcore_rl.runtime import "
                               "start_process_group, shutdown; start_process_group('gloo'); "
                               "shutdown()"], env=env, capture_output=True, text=True,
                              timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert read_launch_env({"MASTER_PORT": "1234"}).master_port == 1234


def test_two_single_node_jobs_launch_at_once_on_one_machine():
    """scripts/torchrun.sh on one node without MASTER_PORT: each job's rendezvous takes a port
    the system hands out, so two jobs started together both run, while another job holds
    torch's default port 29500 (issue 62: the second job died with EADDRINUSE)."""
    import socket

    env = {key: value for key, value in os.environ.items()
           if key not in ("MASTER_PORT", "MASTER_ADDR", "NNODES", "NODE_RANK")}
    env.update(PYTHON=sys.executable, NPROC_PER_NODE="1", OMP_NUM_THREADS="1")
    plan = ["plan", "--model", "configs/models/llama2-7b.yaml", "--train-tp", "1",
            "--rollout-tp", "1", "--gpus", "1"]
    with socket.socket() as other_job:
        other_job.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        with contextlib.suppress(OSError):  # held already: as good
            other_job.bind(("127.0.0.1", 29500))
            other_job.listen()
        jobs = [subprocess.Popen([os.path.join(REPO, "scripts", "torchrun.sh"), *plan], cwd=REPO,
                                 env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 text=True, start_new_session=True) for _ in range(2)]
        outputs = [job.communicate(timeout=180) for job in jobs]
    for job, (out, err) in zip(jobs, outputs):
        assert job.returncode == 0, err[-2000:]
        assert "| 1 | 1x1x1 | 1x1 |" in out, out[-2000:]


def test_torchrun_sh_keeps_the_given_port_and_the_multi_node_rendezvous(tmp_path):
    """The torchrun command scripts/torchrun.sh runs (read off a PYTHON that prints it): one
    node takes a free port unless MASTER_PORT is given; several nodes keep MASTER_ADDR,
    MASTER_PORT (default 29500) and NODE_RANK as before."""
    python = tmp_path / "python"
    python.write_text('#!/bin/sh\ncase "$2" in\n  mcore_rl.launch_check) while [ "$1" != '
                      '--torchrun ]; do shift; done; shift; echo "$@" ;;\nesac\n')
    python.chmod(0o755)

    def command(**variables):
        env = {key: value for key, value in os.environ.items()
               if key not in ("MASTER_PORT", "MASTER_ADDR", "NNODES", "NODE_RANK")}
        done = subprocess.run([os.path.join(REPO, "scripts", "torchrun.sh"), "train"],
                              env=dict(env, PYTHON=str(python), NPROC_PER_NODE="2", **variables),
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        return done.stdout.split(" -m mcore_rl ")[0].split()

    assert command() == ["--nnodes", "1", "--nproc_per_node", "2", "--rdzv-backend", "c10d",
                         "--rdzv-endpoint", "127.0.0.1:0", "--local-addr", "127.0.0.1",
                         "--log-dir", "/dev/null"]
    assert "--master_port 1234" in " ".join(command(MASTER_PORT="1234"))
    assert command(NNODES="2", NODE_RANK="1", MASTER_ADDR="node0") == [
        "--nnodes", "2", "--nproc_per_node", "2", "--node_rank", "1", "--master_addr", "node0",
        "--master_port", "29500", "--log-dir", "/dev/null"]


def test_gpu_is_chosen_from_the_visible_ones():
    """SLURM's --gpus-per-task=1 leaves each task one visible GPU, numbered 0 whatever its
    SLURM_LOCALID; torchrun's ranks on an 8-GPU node see all 8 and take their local rank's."""
    from mcore_rl.runtime.devices import cuda_device_index

    assert cuda_device_index(local_rank=3, visible_gpus=1) == 0
    assert cuda_device_index(local_rank=3, visible_gpus=8) == 3
    with pytest.raises(RuntimeError, match="local rank 4 has no GPU of its own: 4 are visible"):
        cuda_device_index(local_rank=4, visible_gpus=4)
    with pytest.raises(RuntimeError, match="no GPU is visible"):
        cuda_device_index(local_rank=0, visible_gpus=0)


def _cpu_compat_checks():
    from mcore_rl.runtime import cpu_compat

    assert not cpu_compat.is_applied()
    cpu_compat.apply()
    cpu_compat.apply()  # idempotent
    assert cpu_compat.is_applied()
    assert torch.zeros(2, device="cuda").device.type == "cpu"
    assert torch.ones(2).cuda().device.type == "cpu"
    assert torch.ones(2).to("cuda:0").device.type == "cpu"
    assert torch.ones(2).type() == "torch.cuda.FloatTensor"
    assert torch.ones(2, dtype=torch.bfloat16).type() == "torch.cuda.BFloat16Tensor"
    assert torch.ones(2).type(torch.float64).dtype == torch.float64  # conversions still work
    assert torch.cuda.current_device() == "cpu"

    from megatron.core.transformer.utils import get_default_causal_mask
    expected = torch.triu(torch.ones(5, 5), diagonal=1).bool()
    assert torch.equal(get_default_causal_mask(5), expected)

    # The RNG tracker forks the CPU generator: the forked stream is reproducible and the
    # default stream continues exactly as if the fork had not happened.
    from megatron.core import tensor_parallel
    import torch.distributed as dist
    dist.init_process_group("gloo", rank=0, world_size=1)
    from megatron.core import parallel_state
    parallel_state.initialize_model_parallel()
    draws = []
    for fork in (True, False):
        tensor_parallel.model_parallel_cuda_manual_seed(123)
        torch.manual_seed(7)
        first = torch.rand(3)
        if fork:
            with tensor_parallel.get_cuda_rng_tracker().fork():
                forked = torch.rand(3)
        draws.append((first, torch.rand(3)))
    assert torch.equal(draws[0][0], draws[1][0]) and torch.equal(draws[0][1], draws[1][1])
    tensor_parallel.model_parallel_cuda_manual_seed(123)
    with tensor_parallel.get_cuda_rng_tracker().fork():
        again = torch.rand(3)
    assert torch.equal(forked, again) and not torch.equal(forked, draws[0][1])


def test_cpu_compat_layer():
    run_world(1, _cpu_compat_checks)


FREED_MEMORY_PROGRAM = textwrap.dedent("""
    import resource, torch
    from mcore_rl.runtime import cpu_compat
    cpu_compat.apply()

    def step():  # activations of several sizes up to 29 MiB, freed out of order
        held = [torch.ones(mib << 18) for mib in (3, 17, 5, 29, 11, 2, 23)]
        del held[::2]
        held.clear()

    step()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(5):
        step()
    print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
""")


def test_cpu_runs_keep_freed_memory_instead_of_faulting_fresh_pages():
    """After cpu_compat.apply() a step's tensors reuse the last step's memory: with glibc's
    defaults (MCORE_RL_CPU_MALLOC=system) every step faults in the freed pages again."""
    faults = {}
    for setting in ("system", "kept"):
        done = subprocess.run([sys.executable, "-c", FREED_MEMORY_PROGRAM], cwd=REPO,
                              env=dict(os.environ, MCORE_RL_CPU_MALLOC=setting),
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr[-2000:]
        faults[setting] = int(done.stdout.split()[-1])
    assert faults["kept"] * 3 < faults["system"], faults


def _refuse_with_cuda():
    torch.cuda.is_available = lambda: True
    from mcore_rl.runtime import cpu_compat
    try:
        cpu_compat.apply()
    except RuntimeError as error:
        assert "CUDA available" in str(error)
        assert not cpu_compat.is_applied()
        return
    raise AssertionError("cpu_compat.apply() patched a process that has CUDA")


def test_cpu_compat_refuses_when_cuda_present():
    run_world(1, _refuse_with_cuda)


def _stuck_collective(result_path):
    import torch.distributed as dist
    from mcore_rl.config import load_config
    from mcore_rl.runtime import initialize

    initialize(load_config(None, ["runtime.collective_timeout_minutes=0.05"]))
    if dist.get_rank() == 1:  # alive but never joins the collective, until rank 0 is done
        deadline = time.monotonic() + 25
        while not os.path.exists(result_path) and time.monotonic() < deadline:
            time.sleep(0.1)
        return
    start = time.perf_counter()
    try:
        dist.all_reduce(torch.ones(1))
    except RuntimeError as error:
        with open(result_path, "w") as handle:
            handle.write(f"{time.perf_counter() - start:.1f} {type(error).__name__}")
        return
    raise AssertionError("all_reduce returned although rank 1 never joined")


def test_collective_timeout_turns_stuck_rank_into_error(tmp_path):
    result = tmp_path / "result.txt"
    run_world(2, _stuck_collective, str(result))
    seconds, _ = result.read_text().split()
    assert float(seconds) < 20, "timeout of 3 s took far longer"


def test_failing_rank_ends_torchrun_job_with_its_error(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent("""
        import torch, torch.distributed as dist
        from mcore_rl.config import load_config
        from mcore_rl.runtime import initialize
        if __name__ == "__main__":
            initialize(load_config(None, []))
            if dist.get_rank() == 1:
                raise ValueError("rank one broke on purpose")
            dist.barrier()
    """))
    env = dict(os.environ, NPROC_PER_NODE="2", PYTHON=sys.executable, MASTER_PORT="29533",
               PYTHONPATH=REPO)
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
         "--master_port", "29533", "--log-dir", "/dev/null", str(script)],
        env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert "rank one broke on purpose" in done.stdout + done.stderr
    assert time.perf_counter() - start < 100


def test_a_failed_atomic_write_keeps_the_old_file_and_leaves_no_temporary(tmp_path):
    from mcore_rl.runtime.files import write_text_atomically

    path = tmp_path / "config.yaml"
    write_text_atomically(path, "old: 1\n")
    with pytest.raises(UnicodeEncodeError):
        write_text_atomically(path, "new: \ud800\n")  # a lone surrogate: not encodable
    assert path.read_text() == "old: 1\n" and os.listdir(tmp_path) == ["config.yaml"]
    assert write_text_atomically(tmp_path / "new" / "a.txt", "x") == str(tmp_path / "new" / "a.txt")


class FakeAllocator:
    """A caching allocator's counters: the current level and the process-wide peak, which only
    `reset_peak_memory_stats` lowers."""

    def __init__(self, level: int):
        self.level = self.peak = level
        self.resets = 0

    def set(self, level: int) -> None:
        self.level, self.peak = level, max(self.peak, level)

    def reset(self, device=None) -> None:
        self.resets += 1
        self.peak = self.level


def test_peak_memory_measures_its_block_and_keeps_the_process_peak(monkeypatch):
    """Issue 63: PeakMemory used to reset the process-wide peak counter at every weight sync,
    so the step's memory/peak_allocated_mb (and any other reader) saw only the time since the
    last sync. The GPU path runs here on a fake allocator; the CPU path on real memory."""
    from mcore_rl.runtime.memory import PeakMemory

    fake = FakeAllocator(100)
    fake.set(10)  # an earlier peak of 100 (the step's forward), now 10 held
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: fake.level)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: fake.peak)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", fake.reset)
    with PeakMemory() as below:  # stays below the earlier peak: sampled
        fake.set(40)
        time.sleep(0.05)
        fake.set(10)
    assert (fake.resets, fake.peak) == (0, 100)
    assert below.extra_bytes == 30
    with PeakMemory() as above:  # raises the process's peak: exact, however short
        fake.set(250)
        fake.set(10)
    assert (fake.resets, fake.peak) == (0, 250)
    assert above.extra_bytes == 240
    monkeypatch.undo()
    with PeakMemory() as cpu:
        block = torch.ones(16 * 2 ** 20 // 4)  # 16 MiB, written
        time.sleep(0.02)
        del block
    assert 15 * 2 ** 20 <= cpu.extra_bytes < 64 * 2 ** 20, cpu.extra_bytes
