"""What wsync needs to know of a trainer's tensor: numpy arrays, torch tensors and FSDP2
``DTensor`` parameters described as wsync registers them (name, dtype, global shape, this
rank's rows of dim 0) with a way to find their memory again at every publication."""
from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, Callable, Optional

from .errors import InvalidArgument

# wsync's dtype names (host/dtype.h).
DTYPES = frozenset({
    "bfloat16", "float16", "float32", "float64", "float8_e4m3fn", "float8_e5m2",
    "int8", "uint8", "int16", "int32", "int64", "bool",
})


@dataclass(frozen=True)
class Memory:
    """Where a tensor's rows are now."""

    pointer: int
    nbytes: int


@dataclass
class Entry:
    """One registered tensor."""

    name: str
    dtype: str
    shape: tuple[int, ...]   # global
    first_row: int
    row_count: int
    device: str              # "cpu" or "cuda"
    resolve: Callable[[], Memory]
    keep: Any                # what must stay referenced while the agent lives
    # The torch tensor as it is now (a DTensor's local shard), for the agent's check of all
    # its tensors at once (wsync.agent's _refresh); None for numpy arrays. `fixed`: the
    # tensor itself when it was registered as one (not a callable, not a DTensor), read
    # without the two calls through `current` (the object stays, its memory may move).
    current: Optional[Callable[[], Any]] = None
    fixed: Any = None


def layout(tensors: list[Any]) -> tuple[list[int], list[Any], list[Any], list[Any]]:
    """What says where torch tensors' bytes are, as four lists: pointers, shapes, strides,
    dtypes. Two tensors with the same four are the same bytes read the same way (the device
    is not read: under CUDA's unified addressing no host and device pointer are equal).
    Reading them list by list costs half what a tuple per tensor does: a 30B-A3B trainer's 531
    tensors at every publication."""
    return ([tensor.data_ptr() for tensor in tensors], [tensor.shape for tensor in tensors],
            [tensor.stride() for tensor in tensors], [tensor.dtype for tensor in tensors])


def _torch() -> Any:
    return sys.modules.get("torch")


def is_torch_tensor(value: Any) -> bool:
    torch = _torch()
    return torch is not None and isinstance(value, torch.Tensor)


def _is_dtensor(value: Any) -> bool:
    module = sys.modules.get("torch.distributed.tensor")
    dtensor = getattr(module, "DTensor", None) if module is not None else None
    return dtensor is not None and isinstance(value, dtensor)


def _numpy_dtype(name: str, array: Any, dtype: Optional[str]) -> str:
    own = array.dtype.name  # "float32"; "bfloat16" for ml_dtypes' type
    if dtype is None:
        if own not in DTYPES:
            raise InvalidArgument(f"register_tensor {name}: numpy dtype {own} is not one wsync moves; pass dtype= "
                                  f"(one of {', '.join(sorted(DTYPES))}) for raw bytes of the same size",
                                  "EINVAL")
        return own
    return dtype


def _itemsize(dtype: str) -> int:
    return {"bfloat16": 2, "float16": 2, "float32": 4, "float64": 8, "float8_e4m3fn": 1, "float8_e5m2": 1,
            "int8": 1, "uint8": 1, "int16": 2, "int32": 4, "int64": 8, "bool": 1}[dtype]


def _placement(name: str, global_shape: tuple[int, ...], local_shape: tuple[int, ...],
               first_row: Optional[int]) -> tuple[int, int]:
    """Checks that a local array holds rows of dim 0 of the global shape; returns (first, count)."""
    if len(local_shape) != len(global_shape) or len(global_shape) == 0:
        raise InvalidArgument(f"register_tensor {name}: the local shape {list(local_shape)} does not have the "
                              f"{len(global_shape)} dims of the global shape {list(global_shape)} (wsync takes "
                              "shards of dim 0, at least one dim)", "EINVAL")
    if tuple(local_shape[1:]) != tuple(global_shape[1:]):
        raise InvalidArgument(f"register_tensor {name}: the local shape {list(local_shape)} differs from the global "
                              f"shape {list(global_shape)} past dim 0 (wsync takes shards of dim 0 only)", "EINVAL")
    first = 0 if first_row is None else int(first_row)
    count = int(local_shape[0])
    if first < 0 or first + count > global_shape[0]:
        raise InvalidArgument(f"register_tensor {name}: rows [{first}, {first + count}) lie outside dim 0 of "
                              f"{global_shape[0]}", "EINVAL")
    return first, count


def describe_numpy(name: str, get: Callable[[], Any], shape: Optional[tuple[int, ...]],
                   first_row: Optional[int], dtype: Optional[str]) -> Entry:
    array = get()
    if not array.flags["C_CONTIGUOUS"]:
        raise InvalidArgument(f"register_tensor {name}: the array is not C-contiguous (use numpy.ascontiguousarray "
                              "and register that)", "EINVAL")
    wsync_dtype = _numpy_dtype(name, array, dtype)
    if wsync_dtype not in DTYPES:
        raise InvalidArgument(f"register_tensor {name}: dtype {wsync_dtype!r} is not one of "
                              f"{', '.join(sorted(DTYPES))}", "EINVAL")
    if _itemsize(wsync_dtype) != array.dtype.itemsize:
        raise InvalidArgument(f"register_tensor {name}: dtype {wsync_dtype} has {_itemsize(wsync_dtype)}-byte "
                              f"elements; the array's {array.dtype.name} has {array.dtype.itemsize}", "EINVAL")
    local = tuple(int(size) for size in array.shape)
    global_shape = local if shape is None else tuple(int(size) for size in shape)
    first, count = _placement(name, global_shape, local, first_row)
    own_dtype = array.dtype

    def resolve() -> Memory:
        now = get()
        numpy = sys.modules["numpy"]
        if not isinstance(now, numpy.ndarray) or tuple(int(size) for size in now.shape) != local \
                or now.dtype != own_dtype or not now.flags["C_CONTIGUOUS"]:
            described = (f"{now.dtype.name} {list(now.shape)}" if isinstance(now, numpy.ndarray)
                         else type(now).__name__)
            raise InvalidArgument(f"tensor {name}: it is now {described}, registered as a C-contiguous "
                                  f"{own_dtype.name} array {list(local)} (this rank's rows); a registered tensor "
                                  "keeps its dtype and shape", "EINVAL")
        return Memory(int(now.ctypes.data), int(now.nbytes))

    return Entry(name, wsync_dtype, global_shape, first, count, "cpu", resolve, get)


def _torch_dtype(name: str, tensor: Any) -> str:
    dtype = str(tensor.dtype).rsplit(".", 1)[-1]
    if dtype not in DTYPES:
        raise InvalidArgument(f"register_tensor {name}: torch dtype {tensor.dtype} is not one wsync moves "
                              f"({', '.join(sorted(DTYPES))})", "EINVAL")
    return dtype


def _dtensor_rows(name: str, value: Any) -> tuple[tuple[int, ...], int]:
    """A DTensor's global shape and the first global row of this rank's shard."""
    from torch.distributed.tensor import Shard  # noqa: PLC0415 (torch is optional)
    placements = tuple(value.placements)
    if len(placements) != 1 or not isinstance(placements[0], Shard) or placements[0].dim != 0:
        raise InvalidArgument(f"register_tensor {name}: DTensor placements {placements} are not supported; wsync "
                              "takes parameters sharded on dim 0 over one mesh dimension (FSDP2's (Shard(0),))",
                              "EINVAL")
    global_shape = tuple(int(size) for size in value.shape)
    try:
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset  # noqa: PLC0415
        _, offset = compute_local_shape_and_global_offset(value.shape, value.device_mesh, value.placements)
        first = int(offset[0])
    except (ImportError, TypeError):
        # torch.chunk's split, as Shard(0) makes it: chunks of ceil(rows / world).
        world = value.device_mesh.size(0)
        index = value.device_mesh.get_local_rank(0)
        chunk = -(-global_shape[0] // world)
        first = min(index * chunk, global_shape[0])
    return global_shape, first


def describe_torch(name: str, get: Callable[[], Any], shape: Optional[tuple[int, ...]],
                   first_row: Optional[int], dtype: Optional[str], constant: bool = False) -> Entry:
    """`get()` returns the tensor (or DTensor) as it is now; it is called again at every
    publication, so storage that an offload and a reload moved is found where it is."""
    value = get()
    dtensor = _is_dtensor(value)
    if dtensor:
        if shape is not None or first_row is not None:
            raise InvalidArgument(f"register_tensor {name}: a DTensor knows its global shape and rows; pass "
                                  "neither shape= nor first_row=", "EINVAL")
        shape, first_row = _dtensor_rows(name, value)
    local = value.to_local() if dtensor else value
    wsync_dtype = _torch_dtype(name, local)
    if dtype is not None and dtype != wsync_dtype:
        raise InvalidArgument(f"register_tensor {name}: dtype={dtype} given for a {wsync_dtype} tensor", "EINVAL")
    local_shape = tuple(int(size) for size in local.shape)
    global_shape = local_shape if shape is None else tuple(int(size) for size in shape)
    first, count = _placement(name, global_shape, local_shape, first_row)
    device = local.device.type
    if device not in ("cpu", "cuda"):
        raise InvalidArgument(f"register_tensor {name}: the tensor is on {local.device}; wsync moves tensors on "
                              "the CPU (host backend) or on CUDA devices (cuda backend)", "EINVAL")

    # (The tensor last found good, by what the checks below read: a tensor whose pointer,
    # shape, strides, dtype and device are the same is the same memory, and passes them
    # again. At every publication, a model's hundreds of tensors take milliseconds to check.)
    checked: list[Any] = [None, None]

    def current() -> Any:
        now = get()
        return now.to_local() if dtensor else now

    def resolve() -> Memory:
        tensor = current()
        key = (tensor.data_ptr(), tensor.shape, tensor.stride(), tensor.dtype, tensor.device)
        if key == checked[0]:
            return checked[1]
        if tensor.data_ptr() == 0 and tensor.numel() > 0:
            # (Its storage is freed: an offload resized it to nothing. Not in memory now: a
            # publication that starts so fails, naming it.)
            return Memory(0, 0)
        if tuple(int(size) for size in tensor.shape) != local_shape or _torch_dtype(name, tensor) != wsync_dtype:
            raise InvalidArgument(f"tensor {name}: it is now {str(tensor.dtype).rsplit('.', 1)[-1]} "
                                  f"{list(tensor.shape)}, registered as {wsync_dtype} {list(local_shape)} (this "
                                  "rank's rows); a registered tensor keeps its dtype and shape", "EINVAL")
        if not tensor.is_contiguous():
            raise InvalidArgument(f"tensor {name}: it is not contiguous now; wsync reads a shard's rows as one "
                                  "block", "EINVAL")
        if tensor.device.type != device:
            raise InvalidArgument(f"tensor {name}: it is on {tensor.device} at publication time, registered on "
                                  f"{device} (bring it back before publish, e.g. in an onload callback that runs "
                                  "before \"publish\" in the schedule)", "EINVAL")
        memory = Memory(int(tensor.data_ptr()), int(tensor.numel()) * int(tensor.element_size()))
        checked[0], checked[1] = key, memory
        return memory

    if not local.is_contiguous():
        raise InvalidArgument(f"register_tensor {name}: the tensor is not contiguous; wsync reads a shard's rows as "
                              "one block", "EINVAL")
    fixed = value if constant and not dtensor else None
    return Entry(name, wsync_dtype, global_shape, first, count, device, resolve, get, current, fixed)


def describe(name: str, value: Any, shape: Optional[tuple[int, ...]] = None, first_row: Optional[int] = None,
             dtype: Optional[str] = None) -> Entry:
    """The registration of `value`: a numpy array, a torch tensor or parameter, an FSDP2
    DTensor, or a zero-argument callable that returns one of these as it is now (called
    again at every publication: storage an offload and a reload moved is found)."""
    if not isinstance(name, str) or not name:
        raise InvalidArgument("register_tensor: the name must be a non-empty string", "EINVAL")
    numpy = sys.modules.get("numpy")

    def is_array(candidate: Any) -> bool:
        return numpy is not None and isinstance(candidate, numpy.ndarray)

    if is_array(value) or is_torch_tensor(value):
        get: Callable[[], Any] = lambda: value  # noqa: E731
    elif callable(value):
        get = value
    else:
        get = None  # type: ignore[assignment]
    current = get() if get is not None else value
    if is_array(current):
        return describe_numpy(name, get, shape, first_row, dtype)
    if is_torch_tensor(current):
        return describe_torch(name, get, shape, first_row, dtype, constant=current is value)
    raise InvalidArgument(f"register_tensor {name}: a {type(current).__name__} is not a tensor wsync knows (numpy "
                          "arrays, torch tensors, FSDP2 DTensors, or a callable returning one)", "EINVAL")
