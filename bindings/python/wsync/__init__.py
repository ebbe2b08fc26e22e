"""wsync for PyTorch and numpy trainers: publish a trainer's weights into a colocated
rollout runtime after every optimizer step, fail-stop.

    import wsync
    agent = wsync.Agent(endpoint, rank, world, backend="cuda")
    agent.register_module(model)
    wsync.OptimizerOffload(optimizer).register(agent)   # its state to the host and back
    wsync.ActorOffload(model).register(agent)           # the parameters and gradients too
    agent.ready()
    for step in range(steps):
        train_one_step()
        agent.publish(step)

The package is a ctypes binding of libwsync (bindings/wsync.h); see wsync._native for
where it looks for the library.
"""
from ._native import LibraryNotFound, library_path
from .agent import Agent, Publication
from .errors import InvalidArgument, StateError, WsyncError
from .host import Host, TrainerTensor, trainer_tensors, version
from .offload import ActorOffload, OptimizerOffload

__all__ = [
    "ActorOffload", "Agent", "Host", "InvalidArgument", "LibraryNotFound", "OptimizerOffload", "Publication", "StateError",
    "WsyncError", "TrainerTensor", "library_path", "trainer_tensors", "version",
]
