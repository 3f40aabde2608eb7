// cuda_on_cpu's stand-in for <cuda_runtime_api.h>: the CUDA vocabulary and runtime API, on the host.
#pragma once
#include "cuda_on_cpu/runtime.h"
