// Attention of one new token per row (a batched decode step) over a bf16 KV cache with grouped-query heads.
//
// A decode step is memory-bound here: every row reads its whole cache once and does ~3 multiply-adds per element
// read. torch's bf16 batched matmuls over (batch x kv heads) tiny products ran at ~7 GB/s (1.7 ms a layer at batch
// 128 and 256 slots on the AMX Xeon); this reads each key and value row once for all the query heads that share it,
// widens it to float32 in registers, and skips the slots the mask hides (the unwritten end of a preallocated buffer,
// left padding) without reading them. Scores, softmax and the weighted sum are float32; the output is rounded to
// bf16 once. Written with GCC vector types, so -march=native picks AVX-512 or AVX2 lanes.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

typedef float v16 __attribute__((vector_size(64)));
typedef uint16_t h16 __attribute__((vector_size(32)));
typedef uint32_t w16 __attribute__((vector_size(64)));
typedef int32_t i16v __attribute__((vector_size(64)));
constexpr int64_t LANES = 16;

static inline v16 widen(const uint16_t* p) {  // 16 bf16 -> 16 float32: the bf16 bits are a float's top half
  h16 h;
  std::memcpy(&h, p, sizeof(h));
  w16 w = __builtin_convertvector(h, w16) << 16;
  v16 f;
  std::memcpy(&f, &w, sizeof(f));
  return f;
}

// Sixteen 16-lane partial sums -> one vector of their sixteen totals (lane i = the sum of x[i]'s lanes): four levels
// of shuffles and adds, each halving the count of vectors, 15 shuffle pairs and adds for 16 keys instead of a
// horizontal sum for each.
static inline v16 transpose_sum(v16 x[16]) {
  v16 a[8], b[4], c[2];
  for (int i = 0; i < 8; ++i)  // lanes 0-7: x[2i]'s halves summed, 8-15: x[2i+1]'s
    a[i] = __builtin_shufflevector(x[2 * i], x[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
           __builtin_shufflevector(x[2 * i], x[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  for (int i = 0; i < 4; ++i)  // groups of 4 lanes: x[4i], x[4i+2], x[4i+1], x[4i+3]
    b[i] = __builtin_shufflevector(a[2 * i], a[2 * i + 1], 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27) +
           __builtin_shufflevector(a[2 * i], a[2 * i + 1], 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31);
  for (int i = 0; i < 2; ++i)  // pairs of lanes
    c[i] = __builtin_shufflevector(b[2 * i], b[2 * i + 1], 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29) +
           __builtin_shufflevector(b[2 * i], b[2 * i + 1], 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31);
  const v16 d = __builtin_shufflevector(c[0], c[1], 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30) +
                __builtin_shufflevector(c[0], c[1], 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31);
  // the levels above interleave the keys' totals: put key i's in lane i
  return __builtin_shufflevector(d, d, 0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15);
}

static inline v16 exp_nonpositive(v16 x) {  // e^x for x <= 0 (Cephes' expf polynomial); 0 below -87
  const v16 big = x < -87.0f ? (v16){} + 1.0f : (v16){};
  x = x < -87.0f ? (v16){} - 87.0f : x;
  const i16v n = __builtin_convertvector(x * 1.44269504088896341f - 0.5f, i16v);  // round to nearest, x <= 0
  const v16 nf = __builtin_convertvector(n, v16);
  const v16 r = x - nf * 0.693359375f + nf * 2.12194440e-4f;
  v16 p = r * 1.9875691500e-4f + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const i16v bits = (n + 127) << 23;
  v16 scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return big > 0.5f ? (v16){} : p * scale;
}

// One (row, kv head) task: the G query heads that share the kv head, D = 16 * C. `scores` holds G rows of T16
// floats (T rounded up to 16), `keys16` 16 widened key rows.
template <int G, int C>
static void attend(const uint16_t* query, const uint16_t* keys, const uint16_t* values, const bool* seen, int64_t T,
                   int64_t kt, int64_t vt, float scale, float* scores, v16* keys16, at::BFloat16* out) {
  const int64_t T16 = (T + LANES - 1) / LANES * LANES;
  const v16 minus_inf = (v16){} - std::numeric_limits<float>::infinity();
  v16 q[G][C];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < C; ++c) q[g][c] = widen(query + (g * C + c) * LANES) * scale;
  v16 top[G];
  for (int g = 0; g < G; ++g) top[g] = minus_inf;
  for (int64_t t0 = 0; t0 < T16; t0 += LANES) {
    v16 hidden = (v16){};  // 1 in the lanes of keys the row may not see (or past T)
    bool any = false;
    for (int i = 0; i < LANES; ++i) {
      const int64_t t = t0 + i;
      const bool visible = t < T && seen[t];
      any |= visible;
      hidden[i] = visible ? 0.f : 1.f;
      for (int c = 0; c < C; ++c) keys16[i * C + c] = visible ? widen(keys + t * kt + c * LANES) : (v16){};
    }
    if (!any) {  // the unwritten end of a preallocated buffer: no arithmetic
      for (int g = 0; g < G; ++g) std::memcpy(scores + g * T16 + t0, &minus_inf, sizeof(minus_inf));
      continue;
    }
    for (int g = 0; g < G; ++g) {
      v16 partial[16];
      for (int i = 0; i < LANES; ++i) {
        v16 dot = q[g][0] * keys16[i * C];
        for (int c = 1; c < C; ++c) dot += q[g][c] * keys16[i * C + c];
        partial[i] = dot;
      }
      const v16 score = hidden > 0.5f ? minus_inf : transpose_sum(partial);
      std::memcpy(scores + g * T16 + t0, &score, sizeof(score));
      top[g] = top[g] > score ? top[g] : score;
    }
  }
  float total[G];
  for (int g = 0; g < G; ++g) {
    float m = top[g][0];
    for (int i = 1; i < LANES; ++i) m = std::max(m, top[g][i]);
    v16 sum = (v16){};
    for (int64_t t0 = 0; t0 < T16; t0 += LANES) {
      v16 x;
      std::memcpy(&x, scores + g * T16 + t0, sizeof(x));
      x = std::isinf(m) ? (v16){} : exp_nonpositive(x - m);  // -inf - m -> 0
      std::memcpy(scores + g * T16 + t0, &x, sizeof(x));
      sum += x;
    }
    total[g] = 0.f;
    for (int i = 0; i < LANES; ++i) total[g] += sum[i];
  }
  v16 acc[G][C] = {};
  for (int64_t t = 0; t < T; ++t) {
    if (!seen[t]) continue;
    for (int c = 0; c < C; ++c) {
      const v16 x = widen(values + t * vt + c * LANES);
      for (int g = 0; g < G; ++g) acc[g][c] += scores[g * T16 + t] * x;
    }
  }
  for (int g = 0; g < G; ++g) {  // a row that sees nothing gets zeros
    const float inv = total[g] > 0.f ? 1.f / total[g] : 0.f;
    for (int c = 0; c < C; ++c)
      for (int i = 0; i < LANES; ++i) out[(g * C + c) * LANES + i] = at::BFloat16(acc[g][c][i] * inv);
  }
}

template <int G>
static auto pick(int64_t C) {
  return C == 4 ? attend<G, 4> : attend<G, 8>;
}

// q (B, H, D) bf16 contiguous; k, v (B, KV, T, D) bf16 with unit stride along D (views of a larger buffer are fine);
// D 64 or 128, H / KV at most 4; mask (B, T) bool, true where a row may look. Returns (B, H, D) bf16.
torch::Tensor decode_attention(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor mask, double scale) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 4 && v.dim() == 4 && mask.dim() == 2, "decode_attention: bad ranks");
  TORCH_CHECK(q.scalar_type() == torch::kBFloat16 && k.scalar_type() == torch::kBFloat16 &&
              v.scalar_type() == torch::kBFloat16 && mask.scalar_type() == torch::kBool,
              "decode_attention: bf16 queries, keys and values and a bool mask");
  TORCH_CHECK(k.size(0) == q.size(0) && v.sizes() == k.sizes() && k.size(3) == q.size(2), "decode_attention: shapes");
  TORCH_CHECK(q.size(2) == 64 || q.size(2) == 128, "decode_attention: head dim 64 or 128");
  TORCH_CHECK(q.size(1) % k.size(1) == 0 && q.size(1) / k.size(1) <= 4, "decode_attention: at most 4 heads per kv head");
  TORCH_CHECK(mask.size(0) == q.size(0) && mask.size(1) == k.size(2), "decode_attention: the mask does not match");
  TORCH_CHECK(k.stride(3) == 1 && v.stride(3) == 1, "decode_attention: keys and values contiguous along D");
  auto qc = q.contiguous();
  auto mc = mask.contiguous();
  auto out = torch::empty_like(qc);
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2), KV = k.size(1), T = k.size(2), G = H / KV;
  const auto* qp = reinterpret_cast<const uint16_t*>(qc.data_ptr<at::BFloat16>());
  const auto* kp = reinterpret_cast<const uint16_t*>(k.data_ptr<at::BFloat16>());
  const auto* vp = reinterpret_cast<const uint16_t*>(v.data_ptr<at::BFloat16>());
  const bool* mp = mc.data_ptr<bool>();
  at::BFloat16* op = out.data_ptr<at::BFloat16>();
  const auto run = G == 1 ? pick<1>(D / LANES) : G == 2 ? pick<2>(D / LANES) : G == 3 ? pick<3>(D / LANES)
                                                                                      : pick<4>(D / LANES);
  at::parallel_for(0, B * KV, 1, [&](int64_t first, int64_t last) {
    std::vector<float> scores(G * ((T + LANES - 1) / LANES * LANES));
    std::vector<v16> keys16(D);  // 16 key rows of D / 16 vectors
    for (int64_t task = first; task < last; ++task) {
      const int64_t b = task / KV, h = task % KV;
      const int64_t head = (b * H + h * G) * D;  // the first of the task's G query heads
      run(qp + head, kp + b * k.stride(0) + h * k.stride(1), vp + b * v.stride(0) + h * v.stride(1), mp + b * T, T,
          k.stride(2), v.stride(2), static_cast<float>(scale), scores.data(), keys16.data(), op + head);
    }
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decode_attention", &decode_attention, "one bf16 query token per row over a GQA KV cache: (B, H, D)");
}
