// The torch.ops namespace of a kernel library built for one instruction-set variant: PORTRL_OPS_NS(portrl_cpu_swiglu)
// is portrl_cpu_swiglu_avx2 when built with -DPORTRL_ISA=avx2 (backends/cpu/native_build.py), portrl_cpu_swiglu
// without a variant. PORTRL_LIBRARY / PORTRL_LIBRARY_IMPL expand it before TORCH_LIBRARY pastes its name.
#pragma once

#include <torch/library.h>

#define PORTRL_CAT_(a, b) a##_##b
#define PORTRL_CAT(a, b) PORTRL_CAT_(a, b)
#define PORTRL_LIBRARY(ns, m) TORCH_LIBRARY(ns, m)
#define PORTRL_LIBRARY_IMPL(ns, key, m) TORCH_LIBRARY_IMPL(ns, key, m)
#ifdef PORTRL_ISA
#define PORTRL_OPS_NS(base) PORTRL_CAT(base, PORTRL_ISA)
#else
#define PORTRL_OPS_NS(base) base
#endif
