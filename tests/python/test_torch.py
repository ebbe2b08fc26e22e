"""The PyTorch side of the package, on the CPU and the host backend (torch and transformers
come from tests/python/requirements.txt; the GPU machine has its own).
tests/python/torch_fsdp2.py --device cpu is the trainer of tests/gpu/run.sh on the CPU:
FSDP2 over gloo, AdamW, the optimizer offloaded and brought back by callbacks
(wsync.OptimizerOffload), three publications checked against the parameters."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from conftest import HERE, ROOT

import wsync


def test_an_fsdp2_trainer_publishes_and_is_checked_against_its_parameters(tmp_path):
    env = dict(os.environ, TMPDIR=str(tmp_path))
    result = subprocess.run([sys.executable, str(HERE / "torch_fsdp2.py"), "--device", "cpu"], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
    output = f"exit {result.returncode}\nstdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    assert result.returncode == 0, output
    assert "verify" not in result.stderr.lower(), output
    assert ("wsync: verdict: OK: 3 model versions published, every resident TP slice verified against the "
            "trainer's values") in result.stdout, output
    assert "torch_fsdp2: ok" in result.stdout, output


def test_the_transformers_model_has_the_recipes_trainer_tensors():
    from transformers import Qwen3MoeForCausalLM  # noqa: PLC0415
    sys.path.insert(0, str(HERE))
    from torch_fsdp2 import tiny_config  # noqa: PLC0415
    model = Qwen3MoeForCausalLM(tiny_config()).to(torch.bfloat16)
    expected = {t.name: (t.dtype, t.shape) for t in wsync.trainer_tensors("tests/fixtures/recipes/torch_tiny_host.lua")}
    got = {name: (str(p.dtype).rsplit(".", 1)[-1], tuple(p.shape)) for name, p in model.named_parameters()}
    assert got == expected


def test_import_wsync_does_not_import_torch():
    code = "import sys, wsync; print(wsync.OptimizerOffload.__name__, 'torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60,
                            stdin=subprocess.DEVNULL)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["OptimizerOffload", "False"]


def test_the_optimizer_offload_moves_the_state_out_and_back():
    parameter = torch.nn.Parameter(torch.ones(4, 3))
    optimizer = torch.optim.AdamW([parameter], lr=0.1)
    parameter.sum().backward()
    optimizer.step()
    state = optimizer.state[parameter]
    before = {key: value.clone() for key, value in state.items()}
    storage = {key: value.data_ptr() for key, value in state.items() if value.dim() > 0}
    assert sorted(storage) == ["exp_avg", "exp_avg_sq"]
    offload = wsync.OptimizerOffload(optimizer)
    offload.offload()
    assert offload.moved == 2
    assert all(state[key].data_ptr() != pointer for key, pointer in storage.items()), "no new storage"
    with pytest.raises(RuntimeError, match="offloaded already"):
        offload.offload()
    offload.onload()
    assert offload.offloaded == []
    for key, value in before.items():
        assert torch.equal(state[key], value), key
    offload.offload()
    offload.onload()
    assert offload.moved == 4


def test_the_optimizer_offload_moves_master_parameters_too_when_asked():
    # (Mixed precision: the optimizer steps float32 masters of bfloat16 model parameters.)
    model = torch.nn.Parameter(torch.ones(4, 3, dtype=torch.bfloat16))
    master = torch.nn.Parameter(model.detach().float())
    optimizer = torch.optim.AdamW([master], lr=0.1)
    master.grad = torch.ones(4, 3)
    optimizer.step()
    kept = master.detach().clone()
    pointer = master.data_ptr()
    offload = wsync.OptimizerOffload(optimizer, params=True)
    assert offload.offload() == 3 * 4 * 3 * 4  # (the master and both moments, float32)
    assert master.data_ptr() != pointer and model.data_ptr() != 0
    offload.onload()
    assert torch.equal(master.detach(), kept)
    assert wsync.OptimizerOffload(optimizer).offload() == 2 * 4 * 3 * 4  # (the moments alone)


class TestTensors:
    @pytest.fixture
    def agent(self, tmp_path):
        import socket  # noqa: PLC0415
        path = str(tmp_path / "control.sock")
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(path)
        listener.listen(4)
        with wsync.Agent(path, 0, 1) as opened:
            yield opened
        listener.close()

    def test_a_cpu_tensor_and_a_parameter(self, agent):
        agent.register_tensor("t", torch.zeros(4, 3, dtype=torch.bfloat16))
        agent.register_tensor("p", torch.nn.Parameter(torch.zeros(2, 3)), shape=(4, 3), first_row=2)

    def test_a_non_contiguous_tensor(self, agent):
        with pytest.raises(wsync.InvalidArgument, match="the tensor is not contiguous"):
            agent.register_tensor("t", torch.zeros(4, 4)[:, ::2])

    def test_a_dtype_wsync_does_not_move(self, agent):
        with pytest.raises(wsync.InvalidArgument, match="torch dtype torch.complex64 is not one wsync moves"):
            agent.register_tensor("t", torch.zeros(4, dtype=torch.complex64))

    def test_a_parameter_replaced_by_one_of_another_shape(self, agent):
        module = torch.nn.Linear(3, 4, bias=False)
        agent.register_module(module)
        module.weight = torch.nn.Parameter(torch.zeros(5, 3))
        with pytest.raises(wsync.InvalidArgument, match=r"tensor weight: it is now float32 \[5, 3\]"):
            agent._refresh()

    def test_every_change_is_seen_after_a_refresh_that_found_all_in_place(self, agent):
        # (The agent reads all tensors' pointers, shapes, strides and dtypes at once and
        # checks no entry again while they are those last found good.)
        module = torch.nn.Linear(4, 4, bias=False)
        other = torch.zeros(4, 4)
        agent.register_module(module)
        agent.register_tensor("other", other)
        agent._refresh()
        agent._refresh()
        module.weight.data = torch.ones(4, 4)  # moved: the agent is told the new memory
        agent._refresh()
        assert agent._pointers["weight"].pointer == module.weight.data_ptr()
        module.weight.data = module.weight.data.t()  # the same pointer and shape, transposed
        with pytest.raises(wsync.InvalidArgument, match="tensor weight: it is not contiguous now"):
            agent._refresh()
        module.weight.data = module.weight.data.t()
        agent._refresh()
        other.resize_(2, 8)  # the same pointer, another shape
        with pytest.raises(wsync.InvalidArgument, match=r"tensor other: it is now float32 \[2, 8\]"):
            agent._refresh()
        other.resize_(4, 4)
        agent._refresh()
        module.weight.data = module.weight.data.view(torch.float16)[:, ::2]  # the same pointer, another dtype
        with pytest.raises(wsync.InvalidArgument, match=r"tensor weight: it is now float16 \[4, 4\]"):
            agent._refresh()

    def test_a_tensor_not_found_after_a_callback_is_refused_at_the_next_publication(self, agent):
        tensors = {"t": torch.zeros(4, 3)}
        agent.register_tensor("t", lambda: tensors["t"])
        agent._refresh()
        tensors["t"] = torch.zeros(4, 3, dtype=torch.float64)  # (an offload that left it wrong)
        agent._refresh(strict=False)  # (after a step callback: marked not in memory)
        assert agent._pointers["t"].pointer == 0
        with pytest.raises(wsync.InvalidArgument, match="tensor t: it is now float64"):
            agent._refresh()

    def test_export_renames_and_leaves_out(self, agent):
        module = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
        names = agent.register_module(module, export={"0.bias": None, "1.bias": None}, prefix="m.")
        assert names == ["m.0.weight", "m.1.weight"]
        names = agent.register_module(module, export=lambda name: "x." + name if name.endswith("bias") else None)
        assert names == ["x.0.bias", "x.1.bias"]


def test_a_dtensor_placement_other_than_shard_0_is_refused_naming_the_parameter(tmp_path):
    code = """
import os, socket, torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
import wsync
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(29500 + os.getpid() % 1000))
dist.init_process_group("gloo", rank=0, world_size=1)
mesh = init_device_mesh("cpu", (1,))
path = os.path.join(os.environ["TMPDIR"], "control.sock")
listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM); listener.bind(path); listener.listen(4)
with wsync.Agent(path, 0, 1) as agent:
    agent.register_tensor("sharded", distribute_tensor(torch.zeros(4, 3), mesh, [Shard(0)]))
    for placement in (Replicate(), Shard(1)):
        try:
            agent.register_tensor("w", distribute_tensor(torch.zeros(4, 3), mesh, [placement]))
        except wsync.InvalidArgument as err:
            print("refused:", err)
dist.destroy_process_group()
"""
    env = dict(os.environ, TMPDIR=str(tmp_path))
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=120, stdin=subprocess.DEVNULL)
    assert result.returncode == 0, result.stderr
    refusals = [line for line in result.stdout.splitlines() if line.startswith("refused:")]
    assert len(refusals) == 2, result.stdout
    for line in refusals:
        assert "register_tensor w: DTensor placements" in line and "(FSDP2's (Shard(0),))" in line, line


def test_the_offloads_reuse_one_host_arena_and_keep_every_tensor_and_view():
    import copy  # noqa: PLC0415
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.ones(2, 8)).sum().backward()
    optimizer.step()
    view = model[0].weight.detach()[1:3]  # (a view: it lies in the weight's storage)
    parameters = list(model.parameters())
    before = [parameter.detach().clone() for parameter in parameters]
    grads = [parameter.grad.clone() for parameter in parameters]
    moments = {key: value.clone() for key, value in optimizer.state[parameters[0]].items()}
    actor, state = wsync.ActorOffload(model), wsync.OptimizerOffload(optimizer)
    arenas = []
    for _ in range(3):
        actor.offload()
        state.offload()
        assert all(parameter.untyped_storage().nbytes() == 0 for parameter in parameters)
        assert all(parameter.grad.untyped_storage().nbytes() == 0 for parameter in parameters)
        assert view.untyped_storage().nbytes() == 0
        # Parameters and gradients, each its own storage; AdamW's two moments per parameter.
        assert actor.device_bytes == 2 * sum(parameter.numel() * 4 for parameter in parameters)
        assert state.device_bytes == actor.device_bytes
        assert actor.last["step"] == "offload_actor" and actor.last["bytes"] == actor.device_bytes
        arenas.append((actor._arena.data_ptr(), state._arena.data_ptr()))
        state.onload()
        actor.onload()
        assert actor.last == dict(actor.last, step="onload_actor", bytes=actor.device_bytes, storages=8)
        for parameter, value, grad in zip(parameters, before, grads):
            assert torch.equal(parameter.detach(), value) and torch.equal(parameter.grad, grad)
        assert torch.equal(view, before[0][1:3])
        for key, value in moments.items():
            assert torch.equal(optimizer.state[parameters[0]][key], value), key
    assert arenas[0] == arenas[1] == arenas[2], "the host arenas were allocated again"
    assert state.moved == 3 * 8 and actor.moved == 3 * 8
    # Training goes on after them exactly as without.
    twin = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    twin.load_state_dict(model.state_dict())
    twin_optimizer = torch.optim.AdamW(twin.parameters(), lr=0.1)
    twin_optimizer.load_state_dict(copy.deepcopy(optimizer.state_dict()))  # (else they share the moments)
    for module, opt in ((model, optimizer), (twin, twin_optimizer)):
        opt.zero_grad()
        module(torch.ones(2, 8)).sum().backward()
        opt.step()
    for mine, theirs in zip(model.parameters(), twin.parameters()):
        assert torch.equal(mine, theirs)


def test_reserve_allocates_the_arena_that_the_first_offload_then_uses():
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    actor = wsync.ActorOffload(model)
    assert actor._arena is None
    reserved = actor.reserve()
    sizes = [parameter.numel() * 4 for parameter in model.parameters()]  # (no gradients yet)
    assert reserved == sum(-(-size // wsync.offload.ALIGNMENT) * wsync.offload.ALIGNMENT for size in sizes)
    arena = actor._arena.data_ptr()
    actor.offload()
    assert actor._arena.data_ptr() == arena and actor.device_bytes == sum(sizes)
    actor.onload()


def test_host_memory_is_a_writable_mapping_of_its_own_of_the_bytes_asked():
    from wsync.offload import host_memory  # noqa: PLC0415
    memory = host_memory(torch, 5 * 2 ** 20 + 3, node=0)  # (one node asked: on a host of one, nothing is bound)
    assert memory.dtype == torch.uint8 and memory.numel() == 5 * 2 ** 20 + 3
    assert memory.data_ptr() % 4096 == 0  # (a mapping: page-aligned, so mbind and madvise take it whole)
    memory.fill_(7)
    memory[-1] = 9
    assert int(memory.sum()) == 7 * (memory.numel() - 1) + 9
    assert host_memory(torch, 0).numel() == 1  # (an empty arena is one byte, as torch.empty(1))


@pytest.mark.parametrize("size,shift", [(4096, 0), (4098, 0), (4099, 0), (4100, 2), (4104, 4), (1, 1), (0, 0)])
def test_the_kernel_copy_moves_every_byte_in_the_widest_unit_the_sizes_and_addresses_allow(size, shift):
    from wsync.offload import kernel_copy  # noqa: PLC0415
    source = torch.randint(0, 256, (size + 16,), dtype=torch.uint8)[shift:shift + size]
    target = torch.zeros(size + 16, dtype=torch.uint8)
    kernel_copy(torch, target[shift:shift + size], source)
    assert torch.equal(target[shift:shift + size], source)
    assert not target[:shift].any() and not target[shift + size:].any(), "bytes outside the target written"


def test_an_offloader_looks_for_its_arenas_device_address_once(monkeypatch):
    import wsync.offload as offload  # noqa: PLC0415
    found = []
    alias = torch.zeros(8, dtype=torch.uint8)  # (a tensor of several values: no truth value)
    monkeypatch.setattr(offload, "device_alias", lambda _torch, _host, _device: found.append(1) or alias)
    actor = wsync.ActorOffload(torch.nn.Linear(2, 2), onload_copy="kernel")
    actor._arena = torch.zeros(8, dtype=torch.uint8)
    assert actor._arena_on_device(torch, "cuda") is alias and actor._arena_on_device(torch, "cuda") is alias
    assert found == [1]
    monkeypatch.setattr(offload, "device_alias", lambda _torch, _host, _device: found.append(2))
    state = wsync.OptimizerOffload(torch.optim.AdamW(torch.nn.Linear(2, 2).parameters()), onload_copy="kernel")
    state._arena = torch.zeros(8, dtype=torch.uint8)
    assert state._arena_on_device(torch, "cuda") is None and state._arena_on_device(torch, "cuda") is None
    assert found == [1, 2], "a missing address is looked for again"


def test_an_offloader_refuses_an_unknown_onload_copy_naming_it():
    with pytest.raises(ValueError, match="onload_copy 'dma' is neither 'kernel' nor 'engine'"):
        wsync.ActorOffload(torch.nn.Linear(2, 2), onload_copy="dma")
    assert wsync.ActorOffload(torch.nn.Linear(2, 2)).onload_copy == "engine"  # (the default)
    assert wsync.OptimizerOffload(torch.optim.AdamW(torch.nn.Linear(2, 2).parameters()),
                                  onload_copy="kernel").onload_copy == "kernel"


def test_an_offloader_registers_its_two_callbacks_under_the_schedules_names():
    registered = []

    class Agent:
        def register_callback(self, name, fn):
            registered.append((name, fn.__name__))

    model = torch.nn.Linear(2, 2)
    wsync.ActorOffload(model).register(Agent())
    wsync.OptimizerOffload(torch.optim.AdamW(model.parameters())).register(Agent())
    assert registered == [("offload_actor", "offload"), ("onload_actor", "onload"),
                          ("offload_optimizer", "offload"), ("onload_optimizer", "onload")]


def test_fsdp2_shards_and_their_optimizer_state_go_out_and_back(tmp_path):
    code = """
import os, torch, torch.distributed as dist
from torch.distributed.fsdp import fully_shard
import wsync
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(29500 + os.getpid() % 1000))
dist.init_process_group("gloo", rank=0, world_size=1)
def build():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    for layer in (model[0], model[2]):
        fully_shard(layer)
    fully_shard(model)
    return model, torch.optim.AdamW(model.parameters(), lr=0.1)
def step(model, optimizer):
    model(torch.ones(2, 8)).sum().backward()
    optimizer.step()
    optimizer.zero_grad()
(model, optimizer), (twin, twin_optimizer) = build(), build()
actor, state = wsync.ActorOffload(model), wsync.OptimizerOffload(optimizer)
for _ in range(3):
    step(model, optimizer)
    step(twin, twin_optimizer)
    actor.offload()
    state.offload()
    assert all(p.to_local().untyped_storage().nbytes() == 0 for p in model.parameters())
    state.onload()
    actor.onload()
for mine, theirs in zip(model.parameters(), twin.parameters()):
    assert torch.equal(mine.to_local(), theirs.to_local())
print("fsdp2 offload ok", actor.moved, state.moved, actor.device_bytes)
dist.destroy_process_group()
"""
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                            stdin=subprocess.DEVNULL)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split()[:3] == ["fsdp2", "offload", "ok"], result.stdout
    _, _, _, actor_moved, state_moved, device_bytes = result.stdout.split()
    # 4 parameters a round, no gradients left (zero_grad sets them to None); 8 moments.
    assert (int(actor_moved), int(state_moved)) == (3 * 4, 3 * 8)
    assert int(device_bytes) == (8 * 16 + 16 + 16 * 4 + 4) * 4
