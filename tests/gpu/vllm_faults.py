"""On the GPU machine, with vLLM: whatever dies, nothing is left. Each case runs a one-rank
trainer (the small Qwen3-MoE of tests/gpu/vllm_e2e.py, FSDP2, its session in its own process
through wsync.Host) that publishes into vLLM TP1 in a loop, generating between publications,
in a process of its own, and then does one thing to it:

- kill_engine@load_chunk#2: vLLM's EngineCore is killed before the second chunk's load
  (named ENGINE_DIED at once, not a timeout: vLLM's own client would wait forever);
- bad_receipt@finish_update: TP rank 0's receipt names another manifest;
- SIGKILL trainer / SIGTERM trainer: the process holding the session dies after its third
  publication (wsync's guard ends the runtime, EngineCore included, within 10 s);
- SIGKILL runtime: the `python3 -m wsync.vllm` process dies between the third and fourth
  publications (the next publish raises RUNTIME_BROKEN naming the process);
- SIGSTOP EngineCore: stopped between the third and fourth publications (the next publish
  times out naming the command, and the stopped tree is destroyed);
- SIGKILL EngineCore during generation (the generation raises ENGINE_DIED).

Each must end with the error expected named where the trainer lives on, nothing committed
after a failure, and then nothing left within 10 s: no process of the run (found by the mark
in their environment, and by the vllm runtime's session for vLLM's processes, whose title
overwrites the mark), no compute app on the device (nvidia-smi), and the device's memory in
use back to what it was before the case (within 256 MiB).

    python3 tests/gpu/vllm_faults.py [CASE ...]
Prints one line per case and "vllm_faults: ok"; exits non-zero on any failure.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "python"))
from marks import children, in_sessions, marked_pids  # noqa: E402

RECIPE = "tests/fixtures/recipes/vllm_tiny_cuda_faults.lua"

#: What wsync promises once the holder of a session is gone (README, "Fail-stop").
WITHIN_SECONDS = 10
#: How far the device's memory in use may stay above where it was before a case.
MEMORY_SLACK_MIB = 256

TRAINER = textwrap.dedent("""
    import os, sys, torch, torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    import wsync
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1)
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig.from_pretrained("tests/fixtures/models/gpu_tiny")).to("cuda", torch.bfloat16)
    fully_shard(model)
    STEPS, LONG_GENERATION_AT = int(sys.argv[2]), int(sys.argv[3])
    with wsync.Host(sys.argv[1]) as host:
        agent = host.agent(rank=0, world=1, backend="cuda", device=0)
        agent.register_module(model)
        agent.register_callback("offload_optimizer", lambda: None)
        agent.register_callback("onload_optimizer", lambda: None)
        agent.ready()
        for step in range(1, STEPS + 1):
            try:
                agent.publish(step)
            except wsync.WsyncError as error:
                print("trainer: publish raised:", error, flush=True)
                break
            print(f"trainer: published {step}", flush=True)
            prompts, tokens = [[1, 2, 3]] * 8, 16
            if step == LONG_GENERATION_AT:  # (about ten seconds of it)
                prompts, tokens = [[1 + i % 2000, 2, 3] for i in range(1024)], 500
                print("trainer: generating", flush=True)
            try:
                host.generate(prompts, max_tokens=tokens, ignore_eos=True, temperature=1.0)
            except wsync.WsyncError as error:
                print("trainer: generate raised:", error, flush=True)
                break
            print(f"trainer: generated {step}", flush=True)
""")


def gpu_pids() -> set[int]:
    out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid", "--format=csv,noheader"], capture_output=True,
                         text=True).stdout
    return {int(line) for line in out.split() if line.strip().isdigit()}


def memory_used_mib() -> int:
    out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", "0"],
                         capture_output=True, text=True).stdout
    return int(out.split()[0])


def cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as file:
            return file.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


@dataclass
class Run:
    """One case's trainer process, the processes of the run seen while it ran and its output.

    A process of the run carries the mark in its environment, or belongs to the session of
    the vllm runtime (which starts in a session of its own): vLLM's EngineCore writes its
    title over its environment's memory (setproctitle), so /proc no longer shows its mark."""

    mark: bytes
    process: subprocess.Popen
    lines: list[str] = field(default_factory=list)
    seen: set[int] = field(default_factory=set)
    sessions: set[int] = field(default_factory=set)

    def output(self) -> str:
        return "".join(self.lines)

    def processes(self) -> set[int]:
        """The live processes of the run now (the trainer's own included while it lives)."""
        marked = marked_pids(self.mark)
        self.sessions |= {pid for pid in marked if " -m wsync.vllm " in f" {cmdline(pid)} "}
        return marked | in_sessions(self.sessions)

    def runtime(self) -> int:
        """The vllm runtime's main process."""
        return next(pid for pid in sorted(marked_pids(self.mark)) if " -m wsync.vllm " in f" {cmdline(pid)} ")

    def engine_core(self) -> int:
        """vLLM's EngineCore: the runtime's child that says so in its title."""
        runtime = self.runtime()
        named = [pid for pid in children(runtime) if "EngineCore" in cmdline(pid)]
        if not named:
            raise RuntimeError(f"no EngineCore among the children of the runtime {runtime}: "
                               + ", ".join(f"{pid} ({cmdline(pid)[:60]})" for pid in children(runtime)))
        return named[0]


@dataclass
class Case:
    name: str
    env: dict[str, str]
    says: tuple[str, ...]              # what the trainer's error names (any of them), () for none
    cue: Optional[str] = None          # the trainer's line after which `act` runs
    act: Optional[Callable[[Run], str]] = None  # returns what it did
    long_generation_at: int = 0
    holder_dies: bool = False          # the process holding the session is killed


def signal_trainer(number: int) -> Callable[[Run], str]:
    def act(run: Run) -> str:
        run.process.send_signal(number)
        return f"{signal.Signals(number).name} to the trainer (pid {run.process.pid})"
    return act


def signal_runtime(run: Run) -> str:
    pid = run.runtime()
    os.kill(pid, signal.SIGKILL)
    return f"SIGKILL to the vllm runtime (pid {pid})"


def signal_engine(number: int, delay: float = 0.0) -> Callable[[Run], str]:
    def act(run: Run) -> str:
        time.sleep(delay)
        pid = run.engine_core()
        os.kill(pid, number)
        return f"{signal.Signals(number).name} to EngineCore (pid {pid}: {cmdline(pid)[:60]})"
    return act


CASES = [
    Case("kill_engine@load_chunk#2", {"WSYNC_VLLM_FAULT": "kill_engine@load_chunk#2"}, ("ENGINE_DIED",)),
    Case("bad_receipt@finish_update", {"WSYNC_VLLM_FAULT": "bad_receipt@finish_update"}, ("RECEIPT_INVALID",)),
    Case("sigkill_trainer", {}, (), "trainer: published 3", signal_trainer(signal.SIGKILL), holder_dies=True),
    Case("sigterm_trainer", {}, (), "trainer: published 3", signal_trainer(signal.SIGTERM), holder_dies=True),
    Case("sigkill_runtime", {}, ("RUNTIME_BROKEN", "vllm runtime broken"), "trainer: generated 3", signal_runtime),
    # (The host's timeout, or the runtime's own on its socket to the TP worker, which names
    # the hop: "TIMEOUT: TP workers [0] did not answer ...".)
    Case("sigstop_engine", {}, ("timeout", "TIMEOUT"), "trainer: generated 3", signal_engine(signal.SIGSTOP)),
    Case("sigkill_engine_generating", {}, ("ENGINE_DIED",), "trainer: generating",
         signal_engine(signal.SIGKILL, delay=0.5), long_generation_at=3),
]


def run_case(case: Case) -> list[str]:
    """Runs one case; returns its failures."""
    failures = []
    before = memory_used_mib()
    mark = f"WSYNC_FAULT_MARK={uuid.uuid4().hex}"
    env = dict(os.environ, WSYNC_FAULT_MARK=mark.split("=", 1)[1], **case.env)
    process = subprocess.Popen([sys.executable, "-c", TRAINER, RECIPE, "6", str(case.long_generation_at)], cwd=ROOT,
                               env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    run = Run(mark.encode(), process)
    reader = threading.Thread(target=lambda: run.lines.extend(iter(process.stdout.readline, "")), daemon=True)
    reader.start()
    did, acted_at = "nothing", None
    started = time.monotonic()
    while process.poll() is None:  # the run's processes, while it runs (short-lived ones too)
        run.seen |= run.processes()
        if case.act and acted_at is None and case.cue in run.output():
            try:
                did, acted_at = case.act(run), time.monotonic()
            except (RuntimeError, StopIteration) as error:
                failures.append(f"{case.name}: cannot act: {error}")
                did, acted_at = "nothing (cannot act)", time.monotonic()
                process.kill()
        if time.monotonic() - started > 300:
            failures.append(f"{case.name}: the trainer ran for 300 s")
            process.kill()
        time.sleep(0.05)
    reader.join(timeout=10)
    ended = time.monotonic()
    # Nothing left within 10 s of the trainer's end (of the signal, where it was the holder).
    since = acted_at if case.holder_dies and acted_at is not None else ended
    alive = sorted(run.processes())
    while alive and time.monotonic() - since < WITHIN_SECONDS:
        time.sleep(0.05)
        alive = sorted(run.processes())
    gone_after = time.monotonic() - since
    # (Nothing else uses the device meanwhile: any compute app is one too many.)
    holding = gpu_pids()
    after = memory_used_mib()
    while (holding or after > before + MEMORY_SLACK_MIB) and time.monotonic() - since < WITHIN_SECONDS:
        time.sleep(0.2)
        holding = gpu_pids()
        after = memory_used_mib()
    freed_after = time.monotonic() - since
    output = run.output()
    raised = [line for line in output.splitlines() if " raised:" in line and line.startswith("trainer:")]
    published = [line for line in output.splitlines() if line.startswith("trainer: published")]
    print(f"vllm_faults: {case.name}: {did}; exit {process.returncode}, {len(run.seen)} processes seen in "
          f"{len(run.sessions)} runtime sessions, {len(published)} published; "
          f"{'none left' if not alive else f'{len(alive)} left'} after {gone_after:.2f} s, device memory used "
          f"{before} -> {after} MiB after {freed_after:.2f} s, compute apps {sorted(holding)}; "
          f"{raised[0] if raised else 'nothing raised'}", flush=True)
    if case.act and acted_at is None:
        failures.append(f"{case.name}: never saw {case.cue!r}:\n{output[-3000:]}")
    if case.says and not (raised and any(word in raised[0] for word in case.says)):
        failures.append(f"{case.name}: no error naming {' or '.join(case.says)}:\n{output[-3000:]}")
    if case.says and len(published) > (3 if case.cue else 0):
        failures.append(f"{case.name}: published after the failure:\n{output[-3000:]}")
    if case.holder_dies and process.returncode not in (-signal.SIGKILL, -signal.SIGTERM):
        failures.append(f"{case.name}: the trainer exited {process.returncode}, not by its signal")
    if alive:
        failures.append(f"{case.name}: processes left {WITHIN_SECONDS} s after: "
                        + ", ".join(f"{pid} ({cmdline(pid)[:80]})" for pid in alive))
    if holding:
        failures.append(f"{case.name}: compute apps left on the device: {sorted(holding)}")
    if after > before + MEMORY_SLACK_MIB:
        failures.append(f"{case.name}: device memory used {after} MiB, {before} MiB before the case")
    guard_lines = [line for line in output.splitlines() if line.startswith("wsync guard:")]
    for line in guard_lines:
        print(f"vllm_faults: {case.name}: {line}", flush=True)
    if alive or holding or after > before + MEMORY_SLACK_MIB:
        listing = subprocess.run(["ps", "-eo", "pid,ppid,pgid,sid,stat,args"], capture_output=True, text=True).stdout
        print(f"vllm_faults: {case.name}: processes now:\n{listing}\nthe trainer's output's end:\n{output[-4000:]}",
              flush=True)
    for pid in alive:  # (the next case starts clean)
        os.kill(pid, signal.SIGKILL)
    if not run.sessions:
        failures.append(f"{case.name}: the vllm runtime was never seen")
    return failures


def main(names: list[str]) -> int:
    unknown = set(names) - {case.name for case in CASES}
    if unknown:
        print(f"vllm_faults: no case {', '.join(sorted(unknown))}; cases: {', '.join(c.name for c in CASES)}",
              file=sys.stderr)
        return 2
    failures = []
    for case in CASES:
        if not names or case.name in names:
            failures += run_case(case)
    for failure in failures:
        print(f"vllm_faults: FAILED: {failure}", file=sys.stderr)
    if failures:
        return 1
    print("vllm_faults: ok", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
