"""What the GPU machine's host gives a step: per-CPU speed, launch cost and wake-up latency.

    python tests/gpu/host_probe.py [--rounds 2]

Prints:
- the machine: cores, NUMA nodes, CPU idle states, frequency governor, `nvidia-smi topo -m`;
- per CPU (the thread moved there with sched_setaffinity, `--rounds` passes in different orders):
  a pure-Python loop's ns per iteration, and the host us of one tiny CUDA launch (torch.add on a
  one-element tensor, 500 back to back, synchronised after);
- wake-up latency: a one-byte ping-pong over two pipes between two processes on two CPUs, median
  us per round trip, once sleeping in read() and once spinning on a non-blocking read (the
  difference is what two wake-ups cost on this machine).
Why: the same decode step sometimes runs ~1.6x slower in one process than in the next (docs/perf.md,
"the slow mode"), and the transport's round trip is twice the dev machine's there.
"""

import argparse
import os
import subprocess
import time

import numpy as np
import torch


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError as e:
        return f"({e.strerror})"


def machine() -> str:
    lines = [f"cpus allowed: {sorted(os.sched_getaffinity(0))}", f"online: {_read('/sys/devices/system/cpu/online')}"]
    nodes = sorted(d for d in os.listdir("/sys/devices/system/node") if d.startswith("node")) \
        if os.path.isdir("/sys/devices/system/node") else []
    lines += [f"{n}: cpus {_read(f'/sys/devices/system/node/{n}/cpulist')}" for n in nodes] or ["no NUMA nodes listed"]
    idle = "/sys/devices/system/cpu/cpu0/cpuidle"
    if os.path.isdir(idle):
        for st in sorted(os.listdir(idle)):
            lines.append(f"cpu0 idle {st}: {_read(f'{idle}/{st}/name')} latency {_read(f'{idle}/{st}/latency')} us")
    lines.append(f"cpuidle driver: {_read('/sys/devices/system/cpu/cpuidle/current_driver')}")
    lines.append(f"cpu0 governor: {_read('/sys/devices/system/cpu/cpu0/cpufreq/scaling_governor')}")
    mhz = [ln.split(":")[1].strip() for ln in _read("/proc/cpuinfo").splitlines() if ln.startswith("cpu MHz")]
    lines.append(f"cpu MHz: {' '.join(mhz)}")
    try:
        topo = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.TimeoutExpired) as e:
        topo = f"nvidia-smi topo -m: {e}"
    return "\n".join(lines + [topo])


def py_loop_ns() -> float:
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        s = 0
        for i in range(20_000):
            s += i
        best = min(best, (time.perf_counter() - t) / 20_000 * 1e9)
    return best


def launch_us(x: torch.Tensor, y: torch.Tensor) -> float:
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(500):
        torch.add(x, 1, out=y)
    host = (time.perf_counter() - t) / 500 * 1e6
    torch.cuda.synchronize()
    return host


def per_cpu(rounds: int) -> str:
    cpus = sorted(os.sched_getaffinity(0))
    x = torch.zeros(1, device="cuda")
    y = torch.empty_like(x)
    launch_us(x, y)
    rows: dict = {c: [] for c in cpus}
    for r in range(rounds):
        order = cpus if r % 2 == 0 else cpus[::-1]
        for c in order:
            os.sched_setaffinity(0, {c})
            time.sleep(0.01)
            rows[c].append((py_loop_ns(), launch_us(x, y)))
    os.sched_setaffinity(0, cpus)
    lines = ["cpu  python ns/iter (per round)   CUDA launch host us (per round)"]
    for c in cpus:
        py, launch = " ".join(f"{p:6.1f}" for p, _ in rows[c]), " ".join(f"{u:6.2f}" for _, u in rows[c])
        lines.append(f"{c:3d}  {py:30s} {launch}")
    py = np.array([[p for p, _ in v] for v in rows.values()])
    la = np.array([[u for _, u in v] for v in rows.values()])
    lines.append(f"python ns/iter: min {py.min():.1f} median {np.median(py):.1f} max {py.max():.1f}; "
                 f"launch us: min {la.min():.2f} median {np.median(la):.2f} max {la.max():.2f}")
    return "\n".join(lines)


def _pong(rfd: int, wfd: int, cpu: int, spin: bool, n: int) -> None:
    os.sched_setaffinity(0, {cpu})
    if spin:
        os.set_blocking(rfd, False)
    for _ in range(n):
        while True:
            try:
                b = os.read(rfd, 1)
                if b:
                    break
            except BlockingIOError:
                pass
        os.write(wfd, b)
    os._exit(0)


def ping_pong_us(cpu_a: int, cpu_b: int, spin: bool, n: int = 3000) -> float:
    a_r, b_w = os.pipe()
    b_r, a_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(a_r)
        os.close(a_w)
        _pong(b_r, b_w, cpu_b, spin, n)
    os.close(b_r)
    os.close(b_w)
    prev = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {cpu_a})
    if spin:
        os.set_blocking(a_r, False)
    times = np.empty(n)
    for i in range(n):
        t = time.perf_counter()
        os.write(a_w, b"x")
        while True:
            try:
                if os.read(a_r, 1):
                    break
            except BlockingIOError:
                pass
        times[i] = time.perf_counter() - t
    os.waitpid(pid, 0)
    os.sched_setaffinity(0, prev)
    for fd in (a_r, a_w):
        os.close(fd)
    return float(np.median(times[n // 10:]) * 1e6)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args()
    print(machine(), flush=True)
    print(per_cpu(a.rounds), flush=True)
    cpus = sorted(os.sched_getaffinity(0))
    pairs = [(cpus[0], cpus[1]), (cpus[0], cpus[len(cpus) // 2]), (cpus[1], cpus[-1])]
    for ca, cb in pairs:
        sleep, spin = ping_pong_us(ca, cb, False), ping_pong_us(ca, cb, True)
        print(f"pipe ping-pong cpu {ca} <-> {cb}: sleeping {sleep:.1f} us, spinning {spin:.1f} us per round trip",
              flush=True)


if __name__ == "__main__":
    main()
