// y = x W^T for a few input rows, streaming W once: a target's decode and verify forwards are memory-bound, so a
// verify over up to 12 tokens should cost about what a one-token decode costs. W is stored as blocks of 32 output
// columns, [K][32] each, so a block is one sequential stream. A tile keeps R <= 12 rows x 2 vectors of 16 columns of
// sums in registers (24 of AVX-512's 32), so up to 12 rows share one read of each weight from memory and their FMAs
// run in the shadow of that stream; each further group of up to 12 rows re-reads the block while it is in L2. With
// blocks of 64 columns only 4-6 rows fitted the registers, and every further group's FMAs came after the stream
// instead of beside it: whole SmolLM2-135M forwards over 8 / 12 / 16 tokens cost 1.13 / 1.23 / 1.16x what these
// cost (docs/measurements-log.md). Built for AVX2 (16 registers of 8 floats) a tile holds 3 rows x 4 vectors: the
// 64-byte vectors of before, emulated there, spilled, and one row took 1.6x and 16 rows 12x as long.
//
// Every output is one FMA chain over k in order, whatever the row count and thread split, so a row's result does not
// depend on how many rows share the call: a verify forward computes each position exactly as a one-token decode does.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <array>
#include <utility>

#ifdef __AVX512F__
constexpr int64_t LANES = 16;                // floats per vector register
constexpr int64_t TILE_ROWS = 12;            // rows whose sums stay in registers: 12 x 2 of AVX-512's 32
#else
constexpr int64_t LANES = 8;                 // AVX2: 16 registers of 8 floats
constexpr int64_t TILE_ROWS = 3;             // 3 x 4 sums + 4 weight vectors
#endif
typedef float vec __attribute__((vector_size(LANES * 4)));
constexpr int64_t COLS = 32;                 // output columns per block
constexpr int64_t VECTORS = COLS / LANES;    // vectors per block row
constexpr int64_t PREFETCH = 4096;           // bytes ahead of the block being read: keeps memory busy while rows compute

torch::Tensor pack_weight(torch::Tensor weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == torch::kFloat32, "pack_weight: a 2-D float32 weight");
  const int64_t N = weight.size(0), K = weight.size(1), blocks = (N + COLS - 1) / COLS;
  auto padded = torch::zeros({blocks * COLS, K}, weight.options());
  padded.narrow(0, 0, N).copy_(weight);
  return padded.view({blocks, COLS, K}).transpose(1, 2).contiguous();
}

template <int R>
static void block_rows(const float* x, const float* block, const float* bias, float* y, int64_t K, int64_t N,
                       int64_t n0, int64_t cols) {
  vec acc[R][VECTORS];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < VECTORS; ++j) acc[r][j] = (vec){};
  const char* ahead = reinterpret_cast<const char*>(block) + PREFETCH;
  for (int64_t k = 0; k < K; ++k) {
    const vec* w = reinterpret_cast<const vec*>(block + k * COLS);  // torch allocations are 64-byte aligned
    const char* fetch = ahead + k * COLS * sizeof(float);
    for (int line = 0; line < COLS * 4 / 64; ++line) __builtin_prefetch(fetch + 64 * line, 0, 3);
    for (int r = 0; r < R; ++r) {
      const float s = x[r * K + k];
      for (int j = 0; j < VECTORS; ++j) acc[r][j] += s * w[j];
    }
  }
  for (int r = 0; r < R; ++r) {
    const float* sums = reinterpret_cast<const float*>(acc[r]);
    float* out = y + r * N + n0;
    for (int64_t c = 0; c < cols; ++c) out[c] = bias ? sums[c] + bias[n0 + c] : sums[c];
  }
}

using BlockRows = void (*)(const float*, const float*, const float*, float*, int64_t, int64_t, int64_t, int64_t);

template <int... Rs>
constexpr std::array<BlockRows, sizeof...(Rs)> by_rows(std::integer_sequence<int, Rs...>) {
  return {block_rows<Rs + 1>...};
}

static const auto BLOCK_ROWS = by_rows(std::make_integer_sequence<int, TILE_ROWS>{});  // [R - 1]: R rows

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
      const int64_t n0 = nb * COLS, cols = std::min(COLS, N - n0);
      for (int64_t r = 0; r < m; r += TILE_ROWS) {
        const int64_t tile = std::min(TILE_ROWS, m - r);
        BLOCK_ROWS[tile - 1](xp + r * K, wp + nb * K * COLS, bp, yp + r * N, K, N, n0, cols);
      }
    }
  });
  auto shape = x.sizes().vec();
  shape.back() = N;
  return y.view(shape);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("pack_weight", &pack_weight, "a [N, K] weight as blocks of 32 output columns, [blocks, K, 32]");
  m.def("linear_rows", &linear_rows, "x [..., K] times the packed weight: [..., N]");
}
