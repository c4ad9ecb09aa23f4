// y = x W^T for a few input rows, streaming W once: a target's decode and verify forwards are memory-bound, so
// 1-8 rows should cost about what one row costs. W is stored as blocks of 16 output columns, [K][16] each, four
// blocks (64 columns) to a group that one thread reads. The register tile follows the row count: 1-4 rows x 64
// columns (four streams at once), 5-8 rows x 32, 9-24 rows x 16 (at most 24 sums in the 32 vector registers), so
// up to 24 rows do all their arithmetic in one pass over the weights; rows 25+ make further passes over the group
// while it is still in the cache. Above ~8 rows the arithmetic, not memory, binds (docs/measurements-log.md).
//
// Every output is one FMA chain over k in order, whatever the row count, tile and thread split, so a row's result
// does not depend on how many rows share the call: a verify forward computes each position as a one-token decode.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <array>
#include <utility>

typedef float v16 __attribute__((vector_size(64)));
constexpr int64_t WIDTH = 16;            // output columns per block: one vector
constexpr int64_t GROUP = 4;             // blocks per group: 64 columns, a thread's unit of work
constexpr int64_t MAX_ROWS = 24;         // rows per pass
constexpr int64_t PREFETCH = 4096;       // bytes ahead in each stream: keeps memory busy while rows compute

torch::Tensor pack_weight(torch::Tensor weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == torch::kFloat32, "pack_weight: a 2-D float32 weight");
  const int64_t N = weight.size(0), K = weight.size(1), cols = GROUP * WIDTH;
  const int64_t padded_n = (N + cols - 1) / cols * cols;
  auto padded = torch::zeros({padded_n, K}, weight.options());
  padded.narrow(0, 0, N).copy_(weight);
  return padded.view({padded_n / WIDTH, WIDTH, K}).transpose(1, 2).contiguous();
}

// R rows x B blocks of 16 columns; block b's weights start at w + b * K * 16; the rows' k-th inputs at x + k * m
// (x is transposed, so the R scalars a step reads sit together instead of R rows apart).
template <int R, int B>
static void tile(const float* x, int64_t m, const float* w, const float* bias, float* y, int64_t K, int64_t N,
                 int64_t n0) {
  v16 acc[R][B];
#pragma GCC unroll 32
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int b = 0; b < B; ++b) acc[r][b] = (v16){};
  for (int64_t k = 0; k < K; ++k) {
    v16 wk[B];
    for (int b = 0; b < B; ++b) {
      const float* at = w + (b * K + k) * WIDTH;  // torch allocations are 64-byte aligned
      __builtin_prefetch(reinterpret_cast<const char*>(at) + PREFETCH, 0, 3);
      wk[b] = *reinterpret_cast<const v16*>(at);
    }
#pragma GCC unroll 32  // fully: the sums must stay in registers (GCC stops at 16 on its own)
    for (int r = 0; r < R; ++r) {
      const float s = x[k * m + r];
#pragma GCC unroll 4
      for (int b = 0; b < B; ++b) acc[r][b] += s * wk[b];
    }
  }
  for (int b = 0; b < B; ++b) {
    const int64_t c0 = n0 + b * WIDTH, cols = std::min(WIDTH, N - c0);
    for (int r = 0; r < R; ++r) {
      const float* sums = reinterpret_cast<const float*>(&acc[r][b]);
      float* out = y + r * N + c0;
      for (int64_t c = 0; c < cols; ++c) out[c] = bias ? sums[c] + bias[c0 + c] : sums[c];
    }
  }
}

// R rows over a whole group: the widest tile whose sums fit in registers.
template <int R>
static void group_rows(const float* x, int64_t m, const float* g, const float* bias, float* y, int64_t K, int64_t N,
                       int64_t n0) {
  constexpr int B = R <= 4 ? 4 : R <= 8 ? 2 : 1;
  for (int b = 0; b < GROUP; b += B) tile<R, B>(x, m, g + b * K * WIDTH, bias, y, K, N, n0 + b * WIDTH);
}

using GroupFn = void (*)(const float*, int64_t, const float*, const float*, float*, int64_t, int64_t, int64_t);

template <std::size_t... I>
static constexpr std::array<GroupFn, sizeof...(I)> group_table(std::index_sequence<I...>) {
  return {&group_rows<I + 1>...};
}
static constexpr auto GROUP_FNS = group_table(std::make_index_sequence<MAX_ROWS>{});

torch::Tensor linear_rows(torch::Tensor x, torch::Tensor packed, int64_t N, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && packed.scalar_type() == torch::kFloat32, "linear_rows: float32");
  const int64_t K = packed.size(1), groups = packed.size(0) / GROUP;
  TORCH_CHECK(x.size(-1) == K && packed.size(2) == WIDTH && packed.size(0) % GROUP == 0 &&
                  groups * GROUP * WIDTH >= N,
              "linear_rows: shapes do not match");
  auto rows = x.reshape({-1, K}).t().contiguous();  // [K, m]
  const int64_t m = rows.size(1);
  auto y = torch::empty({m, N}, x.options());
  auto b = bias.has_value() ? bias->contiguous() : torch::Tensor();
  const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
  const float* xp = rows.data_ptr<float>();
  const float* wp = packed.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, groups, 1, [&](int64_t first, int64_t last) {
    for (int64_t g = first; g < last; ++g) {
      const float* group = wp + g * GROUP * K * WIDTH;
      for (int64_t r = 0; r < m; r += MAX_ROWS) {
        const int64_t n = std::min(MAX_ROWS, m - r);
        GROUP_FNS[n - 1](xp + r, m, group, bp, yp + r * N, K, N, g * GROUP * WIDTH);
      }
    }
  });
  auto shape = x.sizes().vec();
  shape.back() = N;
  return y.view(shape);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("pack_weight", &pack_weight, "a [N, K] weight as blocks of 16 output columns, [blocks, K, 16]");
  m.def("linear_rows", &linear_rows, "x [..., K] times the packed weight: [..., N]");
}
