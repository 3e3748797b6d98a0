// Block-sparse attention on CPU, forward and backward, fused per (sequence, head, query block).
//
// q [b, s, h, d], k/v [b, s, hk, d] (fp32, contiguous; h a multiple of hk: GQA), a layout cols [LB, LH, n, m]
// / counts [LB, LH, n] (LB in {1, b}, LH in {1, hk}: shared or per sequence / kv head): query block r attends
// key blocks cols[.., r, :counts[.., r]], ascending. Inside the attended blocks only the causal mask applies
// (to the row's last block) and a ragged last block is cut at s.
//
// Per query block the scores [B, keys] live in a thread-local buffer: the GEMMs (MKL sgemm) run on it while it
// is in cache, and the softmax passes are fused loops over it. A row whose key blocks are consecutive reads K/V
// in place (leading dimension hk * d) and, in backward, accumulates dK/dV in place; other rows gather their
// blocks into a buffer first. Backward recomputes the probabilities from the saved log-sum-exp (flash style)
// and runs one task per (sequence, kv head), which owns that head's dK/dV, so no two threads write one row.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

extern "C" void sgemm_(const char* transa, const char* transb, const int* m, const int* n, const int* k,
                       const float* alpha, const float* a, const int* lda, const float* b, const int* ldb,
                       const float* beta, float* c, const int* ldc);

namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// Row-major C[M, N] = alpha * op(A)[M, K] op(B)[K, N] + beta * C, through column-major sgemm (C^T = B^T A^T).
void gemm(bool ta, bool tb, int M, int N, int K, float alpha, const float* A, int lda, const float* B, int ldb,
          float beta, float* C, int ldc) {
  const char a = ta ? 'T' : 'N', b = tb ? 'T' : 'N';
  sgemm_(&b, &a, &N, &M, &K, &alpha, B, &ldb, A, &lda, &beta, C, &ldc);
}

// exp for x <= ~88 (softmax arguments), vectorisable: Cody-Waite reduction and the Cephes polynomial
// (about 1 ulp); exactly 0 below -87.3, so -inf gives 0.
inline float fast_exp(float x) {
  const float xc = std::max(x, -87.3f);
  const float n = std::floor(xc * 1.44269504088896341f + 0.5f);
  float r = xc - n * 0.693359375f;
  r = r + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float two_n;
  std::memcpy(&two_n, &bits, sizeof(float));
  return x < -87.3f ? 0.0f : p * two_n;
}

struct Layout {
  const int64_t* cols;
  const int64_t* counts;
  int64_t LB, LH, n, m;
  const int64_t* row_cols(int64_t bb, int64_t kh, int64_t r) const {
    return cols + (((bb % LB) * LH + (kh % LH)) * n + r) * m;
  }
  int64_t count(int64_t bb, int64_t kh, int64_t r) const { return counts[((bb % LB) * LH + (kh % LH)) * n + r]; }
};

// The keys one query block attends: either in place (consecutive blocks) or gathered into `buf`.
struct Keys {
  int nk = 0;            // number of keys
  int last = 0;          // keys before the row's last block (which alone may need the causal mask)
  int64_t last_start = 0;  // position of that block's first key (its keys are consecutive)
  int64_t first = 0;     // position of key 0 (in place) ...
  bool in_place = false;
  std::vector<int64_t> pos;  // ... or the position of every key (gathered)
};

Keys find_keys(const Layout& L, int64_t bb, int64_t kh, int64_t r, int64_t B, int64_t s) {
  Keys keys;
  const int64_t c = L.count(bb, kh, r);
  if (c == 0) return keys;
  const int64_t* cols = L.row_cols(bb, kh, r);
  bool consecutive = true;
  for (int64_t j = 1; j < c; ++j) consecutive &= cols[j] == cols[j - 1] + 1;
  const int64_t last_start = cols[c - 1] * B;
  const int64_t end = std::min(s, last_start + B);
  keys.last_start = last_start;
  keys.in_place = consecutive;
  if (consecutive) {
    keys.first = cols[0] * B;
    keys.nk = static_cast<int>(end - keys.first);
    keys.last = static_cast<int>(last_start - keys.first);
    return keys;
  }
  for (int64_t j = 0; j < c; ++j) {
    const int64_t start = cols[j] * B, stop = std::min(s, start + B);
    if (j == c - 1) keys.last = static_cast<int>(keys.pos.size());
    for (int64_t t = start; t < stop; ++t) keys.pos.push_back(t);
  }
  keys.nk = static_cast<int>(keys.pos.size());
  return keys;
}

// Rows of x [b, s, hk, d] at `keys` for (bb, kh): a pointer and leading dimension, gathering into buf if needed.
const float* key_rows(const Keys& keys, const float* x, int64_t bb, int64_t kh, int64_t s, int64_t hk, int64_t d,
                      std::vector<float>& buf, int* ld) {
  if (keys.in_place) {
    *ld = static_cast<int>(hk * d);
    return x + ((bb * s + keys.first) * hk + kh) * d;
  }
  buf.resize(static_cast<size_t>(keys.nk) * d);
  for (int t = 0; t < keys.nk; ++t)
    std::memcpy(buf.data() + t * d, x + ((bb * s + keys.pos[t]) * hk + kh) * d, d * sizeof(float));
  *ld = static_cast<int>(d);
  return buf.data();
}

// -inf on the causal-masked scores of query rows at positions q0.. in S [rows, nk]: only the row's last block
// can hold keys after a query, and its keys are consecutive.
void causal_mask(float* S, int rows, int nk, const Keys& keys, int64_t q0) {
  for (int i = 0; i < rows; ++i) {
    const int64_t first_masked = keys.last + (q0 + i - keys.last_start) + 1;
    if (first_masked < nk) std::fill(S + static_cast<int64_t>(i) * nk + std::max<int64_t>(first_masked, 0),
                                     S + static_cast<int64_t>(i + 1) * nk, kNegInf);
  }
}

// The kernels index raw pointers: every shape they rely on is checked first.
void check(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cols,
           const at::Tensor& counts, int64_t B) {
  TORCH_CHECK(q.dtype() == at::kFloat && k.dtype() == at::kFloat && v.dtype() == at::kFloat,
              "block_sparse: q, k, v must be float32");
  TORCH_CHECK(q.is_contiguous() && k.is_contiguous() && v.is_contiguous(), "block_sparse: q, k, v must be contiguous");
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && k.sizes() == v.sizes() && q.size(0) == k.size(0) &&
              q.size(1) == k.size(1) && q.size(3) == k.size(3) && k.size(2) > 0 && q.size(2) % k.size(2) == 0,
              "block_sparse: q [b, s, h, d], k and v [b, s, hk, d] with h a multiple of hk, got q", q.sizes(),
              " k", k.sizes(), " v", v.sizes());
  TORCH_CHECK(cols.dim() == 4 && counts.dim() == 3 && cols.dtype() == at::kLong && counts.dtype() == at::kLong &&
              cols.is_contiguous() && counts.is_contiguous(), "block_sparse: cols [LB, LH, n, m], counts [LB, LH, n] int64");
  const int64_t n = B > 0 ? (q.size(1) + B - 1) / B : -1;
  TORCH_CHECK(B > 0 && cols.size(2) == n && counts.sizes() == cols.sizes().slice(0, 3) &&
              (cols.size(0) == 1 || cols.size(0) == q.size(0)) && (cols.size(1) == 1 || cols.size(1) == k.size(2)),
              "block_sparse: a layout of ", n, " blocks of ", B, " tokens for batch ", q.size(0), " and ", k.size(2),
              " kv heads expected, got cols", cols.sizes(), " counts", counts.sizes());
}

Layout make_layout(const at::Tensor& cols, const at::Tensor& counts) {
  return Layout{cols.data_ptr<int64_t>(), counts.data_ptr<int64_t>(), cols.size(0), cols.size(1), cols.size(2),
                cols.size(3)};
}

}  // namespace

std::vector<at::Tensor> forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cols,
                                const at::Tensor& counts, int64_t B, bool causal, double scale_) {
  check(q, k, v, cols, counts, B);
  const int64_t b = q.size(0), s = q.size(1), h = q.size(2), d = q.size(3), hk = k.size(2), g = h / hk;
  const Layout L = make_layout(cols, counts);
  const int64_t n = L.n;
  const float scale = static_cast<float>(scale_);
  auto out = at::empty_like(q);
  auto lse = at::empty({b, h, s}, q.options());
  const float *qp = q.data_ptr<float>(), *kp = k.data_ptr<float>(), *vp = v.data_ptr<float>();
  float *op = out.data_ptr<float>(), *lp = lse.data_ptr<float>();
  const int ldq = static_cast<int>(h * d), di = static_cast<int>(d);
  at::parallel_for(0, b * hk * n, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> kbuf, vbuf, S, inv;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t r = task % n, kh = (task / n) % hk, bb = task / (n * hk);
      const int64_t q0 = r * B;
      const int rows = static_cast<int>(std::min(B, s - q0));
      const Keys keys = find_keys(L, bb, kh, r, B, s);
      const int nk = keys.nk;
      int ldk = 0, ldv = 0;
      const float* K = nk ? key_rows(keys, kp, bb, kh, s, hk, d, kbuf, &ldk) : nullptr;
      const float* V = nk ? key_rows(keys, vp, bb, kh, s, hk, d, vbuf, &ldv) : nullptr;
      S.resize(static_cast<size_t>(rows) * nk);
      inv.resize(rows);
      for (int64_t j = 0; j < g; ++j) {  // the query heads of this kv head
        const int64_t head = kh * g + j;
        float* o = op + ((bb * s + q0) * h + head) * d;
        float* l = lp + (bb * h + head) * s + q0;
        if (nk == 0) {
          for (int i = 0; i < rows; ++i) {
            std::fill(o + i * ldq, o + i * ldq + d, 0.0f);
            l[i] = kNegInf;
          }
          continue;
        }
        gemm(false, true, rows, nk, di, scale, qp + ((bb * s + q0) * h + head) * d, ldq, K, ldk, 0.0f, S.data(), nk);
        if (causal) causal_mask(S.data(), rows, nk, keys, q0);
        for (int i = 0; i < rows; ++i) {
          float* row = S.data() + static_cast<int64_t>(i) * nk;
          float mx = kNegInf;
#pragma omp simd reduction(max : mx)
          for (int c = 0; c < nk; ++c) mx = std::max(mx, row[c]);
          if (mx == kNegInf) {  // no key at all: output 0
            std::fill(row, row + nk, 0.0f);
            inv[i] = 0.0f;
            l[i] = kNegInf;
            continue;
          }
          float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
          for (int c = 0; c < nk; ++c) {
            const float e = fast_exp(row[c] - mx);
            row[c] = e;
            sum += e;
          }
          inv[i] = 1.0f / sum;
          l[i] = mx + std::log(sum);
        }
        gemm(false, false, rows, di, nk, 1.0f, S.data(), nk, V, ldv, 0.0f, o, ldq);
        for (int i = 0; i < rows; ++i)
          for (int64_t c = 0; c < d; ++c) o[i * ldq + c] *= inv[i];
      }
    }
  });
  return {out, lse};
}

namespace {

// Backward into dq, dk, dv (contiguous float32 of q's and k's shapes): dK/dV always accumulate; dQ is written
// (accumulate false: every row, 0 for a row without keys) or added to (accumulate true).
void backward_impl(const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                   const at::Tensor& out, const at::Tensor& lse, const at::Tensor& cols, const at::Tensor& counts,
                   int64_t B, bool causal, double scale_, at::Tensor& dq, at::Tensor& dk, at::Tensor& dv,
                   bool accumulate) {
  check(q, k, v, cols, counts, B);
  TORCH_CHECK(grad_out.is_contiguous() && out.is_contiguous() && lse.is_contiguous() &&
              grad_out.dtype() == at::kFloat && out.dtype() == at::kFloat && lse.dtype() == at::kFloat &&
              grad_out.sizes() == q.sizes() && out.sizes() == q.sizes() && lse.dim() == 3 &&
              lse.size(0) == q.size(0) && lse.size(1) == q.size(2) && lse.size(2) == q.size(1),
              "block_sparse backward: grad_out and out [b, s, h, d], lse [b, h, s], contiguous float32");
  const int64_t b = q.size(0), s = q.size(1), h = q.size(2), d = q.size(3), hk = k.size(2), g = h / hk;
  const Layout L = make_layout(cols, counts);
  const int64_t n = L.n;
  const float scale = static_cast<float>(scale_);
  const float dq_beta = accumulate ? 1.0f : 0.0f;
  const float *qp = q.data_ptr<float>(), *kp = k.data_ptr<float>(), *vp = v.data_ptr<float>();
  const float *gp = grad_out.data_ptr<float>(), *op = out.data_ptr<float>(), *lp = lse.data_ptr<float>();
  float *dqp = dq.data_ptr<float>(), *dkp = dk.data_ptr<float>(), *dvp = dv.data_ptr<float>();
  const int ldq = static_cast<int>(h * d), di = static_cast<int>(d);
  at::parallel_for(0, b * hk, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> kbuf, vbuf, dkbuf, dvbuf, P, dP, delta;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t kh = task % hk, bb = task / hk;
      for (int64_t r = 0; r < n; ++r) {
        const int64_t q0 = r * B;
        const int rows = static_cast<int>(std::min(B, s - q0));
        const Keys keys = find_keys(L, bb, kh, r, B, s);
        const int nk = keys.nk;
        if (nk == 0) {
          if (accumulate) continue;
          for (int64_t j = 0; j < g; ++j) {
            float* dqo = dqp + ((bb * s + q0) * h + kh * g + j) * d;
            for (int i = 0; i < rows; ++i) std::fill(dqo + i * ldq, dqo + i * ldq + d, 0.0f);
          }
          continue;
        }
        int ldk, ldv, ldg;
        const float* K = key_rows(keys, kp, bb, kh, s, hk, d, kbuf, &ldk);
        const float* V = key_rows(keys, vp, bb, kh, s, hk, d, vbuf, &ldv);
        float *dK, *dV;  // where dK/dV of these keys accumulate: in place, or a buffer scattered below
        if (keys.in_place) {
          dK = dkp + ((bb * s + keys.first) * hk + kh) * d;
          dV = dvp + ((bb * s + keys.first) * hk + kh) * d;
          ldg = static_cast<int>(hk * d);
        } else {
          dkbuf.assign(static_cast<size_t>(nk) * d, 0.0f);
          dvbuf.assign(static_cast<size_t>(nk) * d, 0.0f);
          dK = dkbuf.data();
          dV = dvbuf.data();
          ldg = di;
        }
        P.resize(static_cast<size_t>(rows) * nk);
        dP.resize(static_cast<size_t>(rows) * nk);
        delta.resize(rows);
        for (int64_t j = 0; j < g; ++j) {
          const int64_t head = kh * g + j;
          const int64_t at_ = ((bb * s + q0) * h + head) * d;
          const float *Q = qp + at_, *dO = gp + at_, *O = op + at_, *l = lp + (bb * h + head) * s + q0;
          for (int i = 0; i < rows; ++i) {
            float acc = 0.0f;
            const float *x = dO + i * ldq, *y = O + i * ldq;
#pragma omp simd reduction(+ : acc)
            for (int64_t c = 0; c < d; ++c) acc += x[c] * y[c];
            delta[i] = acc;
          }
          gemm(false, true, rows, nk, di, scale, Q, ldq, K, ldk, 0.0f, P.data(), nk);
          if (causal) causal_mask(P.data(), rows, nk, keys, q0);
          for (int i = 0; i < rows; ++i) {
            float* row = P.data() + static_cast<int64_t>(i) * nk;
            const float li = l[i];
            if (li == kNegInf) {
              std::fill(row, row + nk, 0.0f);
              continue;
            }
#pragma omp simd
            for (int c = 0; c < nk; ++c) row[c] = fast_exp(row[c] - li);
          }
          gemm(true, false, nk, di, rows, 1.0f, P.data(), nk, dO, ldq, 1.0f, dV, ldg);       // dV += P^T dO
          gemm(false, true, rows, nk, di, 1.0f, dO, ldq, V, ldv, 0.0f, dP.data(), nk);       // dP = dO V^T
          for (int i = 0; i < rows; ++i) {
            float* ds = dP.data() + static_cast<int64_t>(i) * nk;
            const float* p = P.data() + static_cast<int64_t>(i) * nk;
            const float di_ = delta[i];
#pragma omp simd
            for (int c = 0; c < nk; ++c) ds[c] = p[c] * (ds[c] - di_);
          }
          gemm(false, false, rows, di, nk, scale, dP.data(), nk, K, ldk, dq_beta, dqp + at_, ldq);  // dQ (+)= dS K
          gemm(true, false, nk, di, rows, scale, dP.data(), nk, Q, ldq, 1.0f, dK, ldg);          // dK += dS^T Q
        }
        if (!keys.in_place) {
          for (int t = 0; t < nk; ++t) {
            float* rk = dkp + ((bb * s + keys.pos[t]) * hk + kh) * d;
            float* rv = dvp + ((bb * s + keys.pos[t]) * hk + kh) * d;
            const float *bk = dkbuf.data() + t * d, *bv = dvbuf.data() + t * d;
#pragma omp simd
            for (int64_t c = 0; c < d; ++c) {
              rk[c] += bk[c];
              rv[c] += bv[c];
            }
          }
        }
      }
    }
  });
}

}  // namespace

std::vector<at::Tensor> backward(const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k,
                                 const at::Tensor& v, const at::Tensor& out, const at::Tensor& lse,
                                 const at::Tensor& cols, const at::Tensor& counts, int64_t B, bool causal,
                                 double scale_) {
  auto dq = at::empty_like(q);
  auto dk = at::zeros_like(k);
  auto dv = at::zeros_like(v);
  backward_impl(grad_out, q, k, v, out, lse, cols, counts, B, causal, scale_, dq, dk, dv, false);
  return {dq, dk, dv};
}

// The backward added into existing gradients (dq += dQ, dk += dK, dv += dV): a caller summing several
// attentions' gradients (ring attention's pairs of chunks) holds no per-call gradient tensors.
void backward_into(const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                   const at::Tensor& out, const at::Tensor& lse, const at::Tensor& cols, const at::Tensor& counts,
                   int64_t B, bool causal, double scale_, at::Tensor dq, at::Tensor dk, at::Tensor dv) {
  TORCH_CHECK(dq.sizes() == q.sizes() && dk.sizes() == k.sizes() && dv.sizes() == k.sizes() &&
              dq.dtype() == at::kFloat && dk.dtype() == at::kFloat && dv.dtype() == at::kFloat &&
              dq.is_contiguous() && dk.is_contiguous() && dv.is_contiguous(),
              "block_sparse backward_into: dq of q's shape, dk and dv of k's, contiguous float32");
  backward_impl(grad_out, q, k, v, out, lse, cols, counts, B, causal, scale_, dq, dk, dv, true);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("forward", &forward, "block-sparse attention forward: (out, lse)");
  m.def("backward", &backward, "block-sparse attention backward: (dq, dk, dv)");
  m.def("backward_into", &backward_into, "block-sparse attention backward added into (dq, dk, dv)");
}
