// The C core's public surface as LuaJIT's ffi.cdef reads it.
//
// The build preprocesses this file with WS_FFI defined (system headers left
// out, X-macro tables expanded) and embeds the result as `wsync._core.cdef`.
#pragma once

#include "status.h"
#include "dtype.h"
#include "digest.h"
#include "manifest.h"
#include "shm.h"
#include "device.h"
#include "process.h"
#include "copy.h"
#include "synth.h"
#include "values.h"
#include "fp8.h"
#include "socket.h"
#include "cuda_memory.h"
#include "cuda_plan.h"
#include "nccl_comm.h"
