"""Finding and loading libwsync, and the C prototypes of its API (bindings/wsync.h).

libwsync is looked for in this order; the first place that names a library is the one
used, and a failure says which places were tried and why each did not serve:

1. ``WSYNC_LIBRARY``: the path of the library file (only this, when set);
2. beside this package: ``libwsync.so`` in the package's directory (the wheel's);
3. the build tree: ``WSYNC_BUILD_DIR``, else the ``build/`` folder of the source checkout
   this package sits in (``bindings/python/wsync`` of a wsync checkout);
4. the system's loader search path (``libwsync.so.0``: LD_LIBRARY_PATH, ldconfig).
"""
from __future__ import annotations

import ctypes
import os
from pathlib import Path
from typing import Optional

PACKAGE_DIR = Path(__file__).resolve().parent

# Status codes of host/status_defs.h, by value.
STATUS_NAMES = {
    0: "OK", -1: "EINVAL", -2: "ENOMEM", -3: "ESYS", -4: "ECRYPTO", -5: "ECLOSED",
    -6: "EOVERFLOW", -7: "ENOTFOUND", -8: "EEXIST", -9: "ENODEV", -10: "ECUDA", -11: "ENCCL",
    -12: "ESTATE", -13: "ELUA", -14: "EFAILED",
}


class LibraryNotFound(ImportError):
    """libwsync could not be loaded from any of the places searched."""


class PublishResult(ctypes.Structure):
    """ws_publish_result."""

    _fields_ = [
        ("model_version", ctypes.c_int64),
        ("publication_id", ctypes.c_char * 33),
        ("manifest", ctypes.c_char * 65),
        ("receipts", ctypes.c_int),
    ]


CALLBACK = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p)
# A callback that confirms it ran to its end through *done (ws_agent_register_confirmed_callback).
CONFIRMED_CALLBACK = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.POINTER(ctypes.c_int))


def _source_build_dir() -> Optional[Path]:
    """The build/ folder of the checkout holding this package, when it is one."""
    root = PACKAGE_DIR.parent.parent.parent  # bindings/python/wsync -> the checkout
    if (root / "bindings" / "wsync.h").is_file() and (root / "CMakeLists.txt").is_file():
        return root / "build"
    return None


def candidates() -> list[tuple[str, str]]:
    """The places searched, in order, as (description, path or soname)."""
    explicit = os.environ.get("WSYNC_LIBRARY")
    if explicit:
        return [(f"WSYNC_LIBRARY={explicit}", explicit)]
    places = [("beside the package", str(PACKAGE_DIR / "libwsync.so"))]
    build_dir = os.environ.get("WSYNC_BUILD_DIR")
    if build_dir:
        places.append((f"the build tree WSYNC_BUILD_DIR={build_dir}", str(Path(build_dir) / "libwsync.so")))
    else:
        source = _source_build_dir()
        if source is not None:
            places.append(("the build tree of this checkout", str(source / "libwsync.so")))
    places.append(("the system's library search path", "libwsync.so.0"))
    return places


def load() -> tuple[ctypes.CDLL, str]:
    """Loads libwsync; returns the library and where it came from."""
    tried = []
    for description, path in candidates():
        is_file_path = "/" in path
        if is_file_path and not os.path.exists(path):
            tried.append(f"  {description}: {path} does not exist")
            continue
        try:
            library = ctypes.CDLL(path)
        except OSError as err:
            tried.append(f"  {description}: {err}")
            continue
        _declare(library)
        return library, f"{description} ({path})"
    raise LibraryNotFound(
        "wsync: cannot load libwsync; tried, in order:\n" + "\n".join(tried)
        + "\nInstall the wheel, which carries it (pip install PATH/TO/wsync, the repository's root), or build it "
        "(scripts/dev.sh build makes build/libwsync.so) and set WSYNC_LIBRARY to its path, or WSYNC_BUILD_DIR to "
        "the build folder.")


def _declare(lib: ctypes.CDLL) -> None:
    """The prototypes of wsync.h."""
    c_int, c_char_p, c_void_p = ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p
    pointer = ctypes.POINTER
    signatures = {
        "ws_host_open": (c_int, [pointer(c_void_p)]),
        "ws_host_run_string": (c_int, [c_void_p, c_char_p, c_char_p]),
        "ws_host_run_file": (c_int, [c_void_p, c_char_p, c_int, pointer(c_char_p)]),
        "ws_host_run_recipe": (c_int, [c_void_p, c_char_p, c_int, pointer(c_char_p)]),
        "ws_host_start_recipe": (c_int, [c_void_p, c_char_p, c_int, pointer(c_char_p), ctypes.c_char_p,
                                         ctypes.c_size_t]),
        "ws_host_finish_recipe": (c_int, [c_void_p]),
        "ws_host_eval": (c_int, [c_void_p, c_char_p, ctypes.c_char_p, ctypes.c_size_t]),
        "ws_host_call": (c_int, [c_void_p, c_char_p, c_char_p, ctypes.c_char_p, ctypes.c_size_t]),
        "ws_host_error": (c_char_p, [c_void_p]),
        "ws_last_error": (c_char_p, []),
        "ws_version": (c_char_p, []),
        "ws_host_close": (None, [c_void_p]),
        "ws_agent_open": (c_int, [c_void_p, c_char_p, c_int, c_int, c_char_p, c_int, pointer(c_void_p)]),
        "ws_agent_register_tensor": (c_int, [c_void_p, c_char_p, c_char_p, pointer(ctypes.c_int64), c_int,
                                             c_void_p, ctypes.c_uint64, ctypes.c_int64, ctypes.c_int64]),
        "ws_agent_set_tensor_data": (c_int, [c_void_p, c_char_p, c_void_p, ctypes.c_uint64]),
        "ws_agent_report_moved": (c_int, [c_void_p, ctypes.c_uint64]),
        "ws_agent_register_callback": (c_int, [c_void_p, c_char_p, CALLBACK, c_void_p]),
        "ws_agent_register_confirmed_callback": (c_int, [c_void_p, c_char_p, CONFIRMED_CALLBACK, c_void_p]),
        "ws_agent_set_interrupt_check": (c_int, [c_void_p, CONFIRMED_CALLBACK, c_void_p]),
        "ws_agent_ready": (c_int, [c_void_p]),
        "ws_agent_publish": (c_int, [c_void_p, ctypes.c_int64, pointer(PublishResult)]),
        "ws_agent_publish_generate": (c_int, [c_void_p, ctypes.c_int64, c_char_p, pointer(PublishResult)]),
        "ws_agent_report": (c_char_p, [c_void_p]),
        "ws_agent_generation": (c_char_p, [c_void_p]),
        "ws_agent_error": (c_char_p, [c_void_p]),
        "ws_agent_close": (None, [c_void_p]),
    }
    for name, (restype, argtypes) in signatures.items():
        function = getattr(lib, name)
        function.restype, function.argtypes = restype, argtypes


_loaded: Optional[tuple[ctypes.CDLL, str]] = None


def library() -> ctypes.CDLL:
    """libwsync, loaded at the first call."""
    global _loaded
    if _loaded is None:
        _loaded = load()
    return _loaded[0]


def library_path() -> str:
    """Where the loaded libwsync came from."""
    library()
    assert _loaded is not None
    return _loaded[1]


def text(value: Optional[bytes]) -> str:
    return value.decode("utf-8", "replace") if value else ""
