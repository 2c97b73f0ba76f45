"""``paged_attention_fast`` with its decode rows in a compiled C++ kernel (opt-in).

torch cannot gather bf16 blocks and convert them to fp32 in one pass, and its matmuls are
slow at a decode row's shapes (4 query rows per KV head), so the plain-torch fast reference
spends most of its time in those ops (``benchmarks/replay.py``). This module builds, on first
use, a small C++ flash-decoding kernel with ``torch.utils.cpp_extension.load_inline`` (a C++
compiler and ninja are needed; the build, ~30 s, is cached by torch) and runs the one-query
rows through it (sums in fp32 or fp64, the compute dtype); every other row, and every batch
it does not cover (a cache other than bf16, a bf16/fp16 compute dtype, soft-cap, ALiBi, a
head size not in ``HEAD_SIZES``), goes to :func:`reference_impl.fast.paged_attention_fast` unchanged.

The kernel, per sequence and partition of 256 keys: read each token's K for all heads (one
contiguous run), convert it from bf16, logits, softmax, ``p @ v``; the partitions of a
sequence merge by log-sum-exp, as :func:`reference_impl.kernel.combine_partitions` does.
Results equal the torch path to rounding (``tests/test_compiled.py``).

The plain-torch forms stay the reference; this one is for replaying long traces quickly
(``pagedtrace replay --kernel compiled``).
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import platform
import shutil
import threading
from types import ModuleType
from typing import Any

import torch

from reference_impl.common import add_sinks, cdiv, check_args
from reference_impl.fast import paged_attention_fast
from tracer.format import first_line

__all__ = ["HEAD_SIZES", "CompiledKernelError", "load", "paged_attention_compiled"]

#: Head sizes the kernel is compiled for; other sizes take the torch path.
HEAD_SIZES = (32, 64, 80, 96, 112, 128, 192, 256)

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

namespace {

constexpr int64_t kPart = 256;  // keys per work item (a partition of one row)
constexpr int64_t kTile = 16;   // tokens converted at a time

template <typename T>
inline T from_bf16(uint16_t x) {
  uint32_t u = uint32_t(x) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return static_cast<T>(f);
}

// Converts tokens t0 .. t0+tn of a row's partition (all heads) from a cache into x.
template <typename T>
inline void read_tile(const uint16_t* cache, const int64_t* table, int64_t bs, int64_t row,
                      int64_t first_pos, int64_t tn, T* x) {
  for (int64_t t = 0; t < tn; ++t) {
    const int64_t pos = first_pos + t;
    const uint16_t* src = cache + (table[pos / bs] * bs + pos % bs) * row;
    T* dst = x + t * row;
#pragma omp simd
    for (int64_t e = 0; e < row; ++e) dst[e] = from_bf16<T>(src[e]);
  }
}

// One work item: keys j0 .. j0+n of a row, for all H*G query heads. Writes the partition's
// max logit m, sum of exp(logit - m) l and unnormalized p @ v acc.
template <typename T, int64_t D>
void attend_part(const T* q, const uint16_t* kc, const uint16_t* vc, const int64_t* table,
                 int64_t bs, int64_t H, int64_t G, int64_t j0, int64_t n, T scale, T* s, T* x,
                 T* m_out, T* l_out, T* acc_out) {
  const int64_t HG = H * G, row = H * D;
  // Logits s[hg][j]: four query heads of a KV head at a time (four independent sums).
  for (int64_t t0 = 0; t0 < n; t0 += kTile) {
    const int64_t tn = std::min(kTile, n - t0);
    read_tile(kc, table, bs, row, j0 + t0, tn, x);
    for (int64_t h = 0; h < H; ++h) {
      for (int64_t t = 0; t < tn; ++t) {
        const T* k = x + t * row + h * D;
        int64_t g = 0;
        for (; g + 4 <= G; g += 4) {
          const T* q0 = q + (h * G + g) * D;
          const T *q1 = q0 + D, *q2 = q1 + D, *q3 = q2 + D;
          T a0 = 0, a1 = 0, a2 = 0, a3 = 0;
#pragma omp simd reduction(+ : a0, a1, a2, a3)
          for (int64_t d = 0; d < D; ++d) {
            const T kd = k[d];
            a0 += q0[d] * kd;
            a1 += q1[d] * kd;
            a2 += q2[d] * kd;
            a3 += q3[d] * kd;
          }
          T* sg = s + (h * G + g) * kPart + t0 + t;
          sg[0] = a0 * scale;
          sg[kPart] = a1 * scale;
          sg[2 * kPart] = a2 * scale;
          sg[3 * kPart] = a3 * scale;
        }
        for (; g < G; ++g) {
          const T* qg = q + (h * G + g) * D;
          T a = 0;
#pragma omp simd reduction(+ : a)
          for (int64_t d = 0; d < D; ++d) a += qg[d] * k[d];
          s[(h * G + g) * kPart + t0 + t] = a * scale;
        }
      }
    }
  }
  // Softmax statistics; s becomes exp(s - m).
  for (int64_t hg = 0; hg < HG; ++hg) {
    T* sg = s + hg * kPart;
    T m = -std::numeric_limits<T>::infinity(), l = 0;
    for (int64_t j = 0; j < n; ++j) m = std::max(m, sg[j]);
    for (int64_t j = 0; j < n; ++j) {
      sg[j] = std::exp(sg[j] - m);
      l += sg[j];
    }
    m_out[hg] = m;
    l_out[hg] = l;
  }
  // acc[hg] = sum_j p[hg][j] v[j]: a tile's sum in a local array the compiler keeps in registers.
  std::fill(acc_out, acc_out + HG * D, T(0));
  for (int64_t t0 = 0; t0 < n; t0 += kTile) {
    const int64_t tn = std::min(kTile, n - t0);
    read_tile(vc, table, bs, row, j0 + t0, tn, x);
    for (int64_t hg = 0; hg < HG; ++hg) {
      const int64_t h = hg / G;
      T a[D];
      T* ag = acc_out + hg * D;
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) a[d] = ag[d];
      const T* p = s + hg * kPart + t0;
      for (int64_t t = 0; t < tn; ++t) {
        const T pt = p[t];
        const T* v = x + t * row + h * D;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) a[d] += pt * v[d];
      }
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) ag[d] = a[d];
    }
  }
}

template <typename T>
std::vector<torch::Tensor> run(const torch::Tensor& q, const torch::Tensor& kc,
                               const torch::Tensor& vc, const torch::Tensor& table,
                               const torch::Tensor& lens, const torch::Tensor& firsts,
                               double scale) {
  const int64_t R = q.size(0), H = q.size(1), G = q.size(2), D = q.size(3);
  const int64_t bs = kc.size(1), mb = table.size(1), HG = H * G;
  const T* qp = q.data_ptr<T>();
  const auto* kp = reinterpret_cast<const uint16_t*>(kc.data_ptr<at::BFloat16>());
  const auto* vp = reinterpret_cast<const uint16_t*>(vc.data_ptr<at::BFloat16>());
  const int64_t* tp = table.data_ptr<int64_t>();
  const int64_t* lp = lens.data_ptr<int64_t>();
  const int64_t* fp = firsts.data_ptr<int64_t>();
  std::vector<int64_t> item_row, item_first;  // work items, in row order
  for (int64_t r = 0; r < R; ++r) {
    for (int64_t j = fp[r]; j < lp[r]; j += kPart) {
      item_row.push_back(r);
      item_first.push_back(j);
    }
  }
  const int64_t W = static_cast<int64_t>(item_row.size());
  std::vector<T> pm(W * HG), pl(W * HG), pacc(W * HG * D);
  at::parallel_for(0, W, 1, [&](int64_t w0, int64_t w1) {
    std::vector<T> s(HG * kPart), x(kTile * H * D);
    for (int64_t w = w0; w < w1; ++w) {
      const int64_t r = item_row[w], j0 = item_first[w], n = std::min(kPart, lp[r] - j0);
      const T* qr = qp + r * HG * D;
      const int64_t* rt = tp + r * mb;
      T* ms = pm.data() + w * HG;
      T* ls = pl.data() + w * HG;
      T* acc = pacc.data() + w * HG * D;
      switch (D) {
#define PAGEDTRACE_CASE(size)                                                               \
  case size:                                                                                \
    attend_part<T, size>(qr, kp, vp, rt, bs, H, G, j0, n, T(scale), s.data(), x.data(), ms, \
                         ls, acc);                                                          \
    break;
        PAGEDTRACE_CASE(32) PAGEDTRACE_CASE(64) PAGEDTRACE_CASE(80) PAGEDTRACE_CASE(96)
        PAGEDTRACE_CASE(112) PAGEDTRACE_CASE(128) PAGEDTRACE_CASE(192) PAGEDTRACE_CASE(256)
#undef PAGEDTRACE_CASE
        default: break;  // refused by decode() before
      }
    }
  });
  // Merge each row's partitions by log-sum-exp.
  auto out = torch::zeros({R, H, G, D}, q.options());
  auto lse = torch::empty({R, H, G}, q.options());
  T* op = out.data_ptr<T>();
  T* lsp = lse.data_ptr<T>();
  for (int64_t w0 = 0, w1; w0 < W; w0 = w1) {
    const int64_t r = item_row[w0];
    for (w1 = w0; w1 < W && item_row[w1] == r; ++w1) {
    }
    for (int64_t hg = 0; hg < HG; ++hg) {
      T m = -std::numeric_limits<T>::infinity(), l = 0;
      for (int64_t w = w0; w < w1; ++w) m = std::max(m, pm[w * HG + hg]);
      T* o = op + (r * HG + hg) * D;
      for (int64_t w = w0; w < w1; ++w) {
        const T c = std::exp(pm[w * HG + hg] - m);
        l += c * pl[w * HG + hg];
        for (int64_t d = 0; d < D; ++d) o[d] += c * pacc[(w * HG + hg) * D + d];
      }
      for (int64_t d = 0; d < D; ++d) o[d] /= l;
      lsp[r * HG + hg] = m + std::log(l);
    }
  }
  return {out, lse};
}

}  // namespace

// q [R, H_kv, G, D] float32 or float64; caches [num_blocks, block_size, H_kv, D] bfloat16;
// table [R, max_blocks], lens and firsts [R] int64: row r attends keys firsts[r] .. lens[r]-1.
// Returns (out [R, H_kv, G, D], lse [R, H_kv, G]) in q's dtype.
std::vector<torch::Tensor> decode(torch::Tensor q, torch::Tensor kc, torch::Tensor vc,
                                  torch::Tensor table, torch::Tensor lens, torch::Tensor firsts,
                                  double scale) {
  TORCH_CHECK(q.dim() == 4 && q.is_contiguous() &&
                  (q.scalar_type() == at::kFloat || q.scalar_type() == at::kDouble),
              "q: contiguous float32/float64 [R, H_kv, G, D]");
  TORCH_CHECK(kc.dim() == 4 && kc.scalar_type() == at::kBFloat16 && kc.is_contiguous() &&
                  vc.sizes() == kc.sizes() && vc.scalar_type() == at::kBFloat16 &&
                  vc.is_contiguous(),
              "caches: contiguous bfloat16 [num_blocks, block_size, H_kv, D], K and V alike");
  TORCH_CHECK(kc.size(2) == q.size(1) && kc.size(3) == q.size(3), "q and caches disagree");
  TORCH_CHECK(table.dim() == 2 && table.scalar_type() == at::kLong && table.is_contiguous() &&
                  table.size(0) == q.size(0),
              "table: contiguous int64 [R, max_blocks]");
  TORCH_CHECK(lens.scalar_type() == at::kLong && firsts.scalar_type() == at::kLong &&
                  lens.numel() == q.size(0) && firsts.numel() == q.size(0) &&
                  lens.is_contiguous() && firsts.is_contiguous(),
              "lens, firsts: contiguous int64 [R]");
  const int64_t D = q.size(3), bs = kc.size(1), mb = table.size(1), nb = kc.size(0);
  TORCH_CHECK(D == 32 || D == 64 || D == 80 || D == 96 || D == 112 || D == 128 || D == 192 ||
                  D == 256,
              "head size ", D, " is not compiled");
  const int64_t* tp = table.data_ptr<int64_t>();
  const int64_t* lp = lens.data_ptr<int64_t>();
  const int64_t* fp = firsts.data_ptr<int64_t>();
  for (int64_t r = 0; r < q.size(0); ++r) {
    TORCH_CHECK(0 <= fp[r] && fp[r] < lp[r] && (lp[r] + bs - 1) / bs <= mb, "row ", r,
                ": needs 0 <= first < len <= max_blocks * block_size");
    for (int64_t j = fp[r] / bs; j < (lp[r] + bs - 1) / bs; ++j) {
      TORCH_CHECK(0 <= tp[r * mb + j] && tp[r * mb + j] < nb, "row ", r, ": block_table[", j,
                  "] = ", tp[r * mb + j], " is not a block of the cache");
    }
  }
  if (q.scalar_type() == at::kDouble) return run<double>(q, kc, vc, table, lens, firsts, scale);
  return run<float>(q, kc, vc, table, lens, firsts, scale);
}
"""


class CompiledKernelError(RuntimeError):
    """The compiled decode kernel could not be built here."""


_lock = threading.Lock()
_module: ModuleType | None = None
_error: str | None = None


def _cpu_tag() -> str:
    """The build uses ``-march=native``: key the cached build by this CPU as well."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            info = "".join(line for line in f if line.startswith(("model name", "flags")))
    except OSError:
        info = platform.processor()
    return hashlib.sha256((_SOURCE + info + torch.__version__).encode()).hexdigest()[:16]


def _find_ninja() -> None:
    """torch runs ``ninja`` from PATH; a venv's ninja (the PyPI package) is not on it unless
    the venv is activated: put that one directory on PATH when no other ninja is."""
    if shutil.which("ninja") is not None:
        return
    try:
        import ninja  # the PyPI package: a ninja binary in its BIN_DIR
    except ImportError:
        return  # torch's own error says what is missing
    os.environ["PATH"] = os.pathsep.join([ninja.BIN_DIR, os.environ.get("PATH", "")])


def load() -> ModuleType:
    """Build (once per process; torch caches the binary on disk) and return the extension.

    Raises:
        CompiledKernelError: no compiler, no ninja, or the build failed; the message says
            which. A failure is remembered: later calls raise at once.
    """
    global _module, _error
    with _lock:
        if _module is not None:
            return _module
        if _error is not None:
            raise CompiledKernelError(_error)
        try:
            # Importing cpp_extension on a CUDA build without CUDA logs a warning about
            # CUDA_HOME that does not concern a CPU-only build: keep it quiet.
            logger = logging.getLogger("torch.utils.cpp_extension")
            level = logger.level
            logger.setLevel(logging.ERROR)
            try:
                from torch.utils.cpp_extension import load_inline
            finally:
                logger.setLevel(level)
            _find_ninja()

            _module = load_inline(
                f"pagedtrace_decode_{_cpu_tag()}",
                _SOURCE,
                functions=["decode"],
                extra_cflags=["-O3", "-march=native", "-fopenmp"],
                verbose=False,
            )
        except Exception as exc:  # the build's own error types vary (RuntimeError, OSError, ...)
            said = first_line(exc) or type(exc).__name__
            _error = f"cannot build the compiled decode kernel (it needs a C++ compiler and ninja): {said}"
            raise CompiledKernelError(_error) from exc
        return _module


def is_built() -> bool:
    """True when :func:`load` will not compile: built in this process, or in torch's build cache.

    (``pagedtrace replay --kernel compiled`` says "building …" before a first build, ~30 s.)
    """
    if _module is not None:
        return True
    logger = logging.getLogger("torch.utils.cpp_extension")
    level = logger.level
    logger.setLevel(logging.ERROR)  # as in load(): the CUDA_HOME warning does not concern this build
    try:
        from torch.utils.cpp_extension import _get_build_directory
    finally:
        logger.setLevel(level)
    name = f"pagedtrace_decode_{_cpu_tag()}"
    return os.path.isfile(os.path.join(_get_build_directory(name, verbose=False), f"{name}.so"))


def paged_attention_compiled(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    *,
    scale: float,
    causal: bool = True,
    window: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    compute_dtype: torch.dtype = torch.float32,
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """:func:`paged_attention_fast`, same arguments and results, decode rows compiled.

    Raises:
        CompiledKernelError: the kernel cannot be built here (see :func:`load`).
        ValueError: as :func:`paged_attention_fast`, and for a block id outside the cache
            in a decode row's used part of ``block_table``.
    """
    kwargs: dict[str, Any] = dict(
        scale=scale,
        causal=causal,
        window=window,
        softcap=softcap,
        alibi_slopes=alibi_slopes,
        k_scale=k_scale,
        v_scale=v_scale,
        compute_dtype=compute_dtype,
    )
    lens, starts = seq_lens.tolist(), query_start_loc.tolist()
    q_lens = [starts[b + 1] - starts[b] for b in range(len(lens))]
    decode = [b for b, s in enumerate(lens) if s > 0 and q_lens[b] == 1]
    covered = (
        key_cache.dtype == torch.bfloat16
        and value_cache.dtype == torch.bfloat16
        and compute_dtype in (torch.float32, torch.float64)
        and softcap <= 0
        and alibi_slopes is None
        and query.shape[-1] in HEAD_SIZES
    )
    if not decode or not covered:
        return paged_attention_fast(
            query,
            key_cache,
            value_cache,
            block_table,
            seq_lens,
            query_start_loc,
            sinks=sinks,
            return_lse=return_lse,
            **kwargs,
        )
    module = load()
    check_args(query, key_cache, value_cache, block_table, seq_lens, query_start_loc)
    num_blocks, block_size, num_kv_heads, head_size = key_cache.shape
    num_tokens, num_heads, _ = query.shape
    if len(decode) < sum(1 for b, s in enumerate(lens) if s > 0 and q_lens[b] > 0):
        # The other rows go to the torch path (sinks applied below); decode rows get 0 keys
        # there, which leaves them untouched.
        others = seq_lens.clone()
        others[decode] = 0
        out, lse = paged_attention_fast(
            query, key_cache, value_cache, block_table, others, query_start_loc, return_lse=True, **kwargs
        )
    else:
        out = torch.zeros(num_tokens, num_heads, head_size, dtype=compute_dtype)
        lse = torch.full((num_tokens, num_heads), -math.inf, dtype=compute_dtype)
    rows = torch.tensor([starts[b] for b in decode])
    decode_lens = torch.tensor([lens[b] for b in decode], dtype=torch.long)
    width = cdiv(max(lens[b] for b in decode), block_size)
    table = block_table[decode, :width].long().contiguous()
    # The kernel checks the blocks it reads too, but by its own row numbers: name the batch's.
    used = torch.arange(width)[None, :] < ((decode_lens + block_size - 1) // block_size)[:, None]
    bad = used & ((table < 0) | (table >= num_blocks))
    if bool(bad.any()):
        i, j = (int(x) for x in bad.nonzero()[0])
        raise ValueError(
            f"block_table[{decode[i]}, {j}] = {int(table[i, j])} is not a block of the cache (0..{num_blocks - 1})"
        )
    left = window[0]
    firsts = (decode_lens - 1 - left).clamp_min(0) if left >= 0 else torch.zeros_like(decode_lens)
    q = query[rows].to(compute_dtype).reshape(len(decode), num_kv_heads, -1, head_size).contiguous()
    o, part_lse = module.decode(
        q, key_cache.contiguous(), value_cache.contiguous(), table, decode_lens, firsts, float(scale)
    )
    o, part_lse = o.view(len(decode), num_heads, head_size), part_lse.view(len(decode), num_heads)
    out[rows], lse[rows] = o, part_lse
    if sinks is not None:
        out, lse = add_sinks(out, lse, sinks, starts[-1])
    if return_lse:
        return out, lse
    return out
