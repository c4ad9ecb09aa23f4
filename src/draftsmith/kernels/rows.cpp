// y = x W^T for a few input rows, streaming W once: a target's decode and verify forwards are memory-bound, so
// 1-8 rows should cost about what one row costs. W is stored as blocks of 64 output columns, [K][64] each, so the
// kernel reads one sequential stream per block and keeps 4 rows x 64 columns of sums in registers; rows 5+ make a
// second pass over the block while it is still in the cache.
//
// Every output is one FMA chain over k in order, whatever the row count and thread split, so a row's result does not
// depend on how many rows share the call: a verify forward computes each position exactly as a one-token decode does.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>

typedef float v16 __attribute__((vector_size(64)));
constexpr int64_t COLS = 64;         // output columns per block: 4 vectors of 16
constexpr int64_t PREFETCH = 4096;   // bytes ahead of the block being read: keeps memory busy while rows compute

torch::Tensor pack_weight(torch::Tensor weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == torch::kFloat32, "pack_weight: a 2-D float32 weight");
  const int64_t N = weight.size(0), K = weight.size(1), blocks = (N + COLS - 1) / COLS;
  auto padded = torch::zeros({blocks * COLS, K}, weight.options());
  padded.narrow(0, 0, N).copy_(weight);
  return padded.view({blocks, COLS, K}).transpose(1, 2).contiguous();
}

template <int R>
static inline void block_rows(const float* x, const float* block, const float* bias, float* y, int64_t K, int64_t N,
                              int64_t n0, int64_t cols) {
  v16 acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j) acc[r][j] = (v16){};
  const char* ahead = reinterpret_cast<const char*>(block) + PREFETCH;
  for (int64_t k = 0; k < K; ++k) {
    const v16* w = reinterpret_cast<const v16*>(block + k * COLS);  // torch allocations are 64-byte aligned
    const char* fetch = ahead + k * COLS * sizeof(float);
    for (int line = 0; line < 4; ++line) __builtin_prefetch(fetch + 64 * line, 0, 3);
    for (int r = 0; r < R; ++r) {
      const float s = x[r * K + k];
      for (int j = 0; j < 4; ++j) acc[r][j] += s * w[j];
    }
  }
  for (int r = 0; r < R; ++r) {
    const float* sums = reinterpret_cast<const float*>(acc[r]);
    float* out = y + r * N + n0;
    for (int64_t c = 0; c < cols; ++c) out[c] = bias ? sums[c] + bias[n0 + c] : sums[c];
  }
}

torch::Tensor linear_rows(torch::Tensor x, torch::Tensor packed, int64_t N, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && packed.scalar_type() == torch::kFloat32, "linear_rows: float32");
  const int64_t K = packed.size(1), blocks = packed.size(0);
  TORCH_CHECK(x.size(-1) == K && packed.size(2) == COLS && blocks * COLS >= N, "linear_rows: shapes do not match");
  auto rows = x.reshape({-1, K}).contiguous();
  const int64_t m = rows.size(0);
  auto y = torch::empty({m, N}, x.options());
  auto b = bias.has_value() ? bias->contiguous() : torch::Tensor();
  const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
  const float* xp = rows.data_ptr<float>();
  const float* wp = packed.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, blocks, 1, [&](int64_t first, int64_t last) {
    for (int64_t nb = first; nb < last; ++nb) {
      const float* block = wp + nb * K * COLS;
      const int64_t n0 = nb * COLS, cols = std::min(COLS, N - n0);
      for (int64_t r = 0; r < m; r += 4) {
        const float* xr = xp + r * K;
        float* yr = yp + r * N;
        switch (std::min<int64_t>(4, m - r)) {
          case 4: block_rows<4>(xr, block, bp, yr, K, N, n0, cols); break;
          case 3: block_rows<3>(xr, block, bp, yr, K, N, n0, cols); break;
          case 2: block_rows<2>(xr, block, bp, yr, K, N, n0, cols); break;
          default: block_rows<1>(xr, block, bp, yr, K, N, n0, cols); break;
        }
      }
    }
  });
  auto shape = x.sizes().vec();
  shape.back() = N;
  return y.view(shape);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("pack_weight", &pack_weight, "a [N, K] weight as blocks of 64 output columns, [blocks, K, 64]");
  m.def("linear_rows", &linear_rows, "x [..., K] times the packed weight: [..., N]");
}
