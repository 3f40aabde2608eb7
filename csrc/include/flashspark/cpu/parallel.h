// A torch-free parallel_for for the standalone kernel library and its
// microbenchmarks. The torch binding passes at::parallel_for instead, so the
// extension shares torch's thread pool. Signature of both:
//   parallel_for(begin, end, grain, f(begin, end))
#pragma once

#include <algorithm>
#include <cstdint>

#if defined(_OPENMP)
#include <omp.h>
#endif

namespace flashspark::cpu {

struct OpenMPParallelFor {
  template <class F>
  void operator()(int64_t begin, int64_t end, int64_t grain, const F& f) const {
    if (end <= begin) return;
    grain = std::max<int64_t>(grain, 1);
#if defined(_OPENMP)
    if (end - begin > grain && !omp_in_parallel()) {
#pragma omp parallel for schedule(static)
      for (int64_t c = begin; c < end; c += grain) f(c, std::min(end, c + grain));
      return;
    }
#endif
    f(begin, end);
  }
};

}  // namespace flashspark::cpu
