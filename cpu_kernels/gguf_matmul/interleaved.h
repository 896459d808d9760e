// Q4_0, Q4_1, Q5_0, Q8_0, Q4_K and Q6_K rows interleaved 16 at a time (the loader's Q4_0_X16
// ... Q6_K_X16; reference.INTERLEAVE has the layouts), for the int8-activation mode on AVX-512
// VNNI. Part of kernel.cc, which includes it after the types it uses (Rows,
// QuantizedX, the file formats' paths).
//
// Why: Q4_K as the file stores it keeps a row's 256 values of a superblock together, so one
// vector holds one output's values and every output's integer sum must be reduced across the
// vector's lanes. Interleaved, one 64-byte vector holds 8 values of each of 16 outputs (4 in
// the low nibbles, the next 4 in the high), so vpdpbusd multiplies it by 4 bytes of x
// broadcast and accumulates each output's sum in its own lane: no reduction, one instruction
// per 64 products, x's bytes taken from memory by the instruction itself. The group scales and
// minimums are vectors over the 16 outputs too (as bytes: 6-bit values unpacked at load).
//
// A tile (16 rows) is its K / 256 superblocks one after another, each kX16Bytes:
//   d[16], dmin[16]      float16, one per row
//   sc[8][16]            group g's scale, per row
//   m[4][16][2]          the minimums of groups 2p and 2p + 1, per row (a vpdpwssd pair)
//   qs[8][4][16][4]      group g, quarter t, row c, byte b: low nibble value 8 t + b of the
//                        group, high nibble value 8 t + 4 + b
// A Q6_K tile's superblock (kX16Bytes6, 16 rows of the file's 210 bytes) is d[16] (float16),
// sc[8][16][2] (the int8 scales of 16-value groups 2p and 2p + 1, per row), then per group j
// of 16 values three vectors of [16 rows][4 bytes]: A (low nibble: the low 4 bits of value
// 16 j + b; high nibble: of 16 j + 4 + b), B (16 j + 8 + b, 16 j + 12 + b) and H (bits 2 s,
// 2 s + 1 of byte b: the top 2 bits of value 16 j + 4 s + b).
// The 32-value formats keep the file's bytes per row too. A Q8_0 tile's block (kX16Bytes32)
// is d[16] (float16), then qs[8][16][4]: group g of 4 values, row c, byte b: value 4 g + b
// plus 128 (unsigned, for vpdpbusd; the 128 is taken back through x's sum). A Q4_0, Q4_1 or
// Q5_0 tile's block is d[16] (Q4_1: and m[16]), Q5_0's h[8] (64-bit masks: bit 4 c + b of mask
// s is the fifth bit of value 4 s + b of row c, set in the vector by a masked add), then
// qs[4][16][4] (quarter t, row c, byte b: the low 4 bits of value 8 t + b in the low nibble,
// of 8 t + 4 + b in the high).
// Other modes read a tile by rebuilding each row's file blocks (UnpackQ4K, UnpackQ6K) and
// taking the file format's paths; so does the rows (embedding) path.

constexpr int64_t kX16Rows = 16;
constexpr int64_t kX16Bytes = 32 + 32 + 128 + 128 + 2048;  // a Q4_K superblock of 16 rows
constexpr int64_t kX16Bytes6 = 16 * 210;  // a Q6_K superblock of 16 rows
constexpr int64_t kX16RowTile = 6;  // rows of x per pass over a tile (4 and 8 measured slower)
template <int F>
constexpr int64_t kX16Bytes32 = F == kQ8_0X16   ? 16 * 34  // a block of 16 rows
                                : F == kQ5_0X16 ? 16 * 22
                                : F == kQ4_1X16 ? 16 * 20
                                                : 16 * 18;
// A nibble format's header bytes per row in the file (d, Q4_1's m) and where its tile's
// nibbles start.
template <int F>
constexpr int kNibbleHeader = F == kQ4_1X16 ? 4 : 2;
template <int F>
constexpr int64_t kNibblesAt = F == kQ5_0X16 ? 96 : 16 * kNibbleHeader<F>;

// Row c of a tile as the file's Q4_K blocks (nsb superblocks of 144 bytes into out).
inline void UnpackQ4K(const uint8_t* tile, int c, int64_t nsb, uint8_t* out) {
  for (int64_t sb = 0; sb < nsb; ++sb) {
    const uint8_t* b = tile + sb * kX16Bytes;
    uint8_t* o = out + sb * 144;
    std::memcpy(o, b + 2 * c, 2);
    std::memcpy(o + 2, b + 32 + 2 * c, 2);
    uint8_t sc[8], mn[8];
    for (int g = 0; g < 8; ++g) {
      sc[g] = b[64 + 16 * g + c];
      mn[g] = b[192 + 32 * (g >> 1) + 2 * c + (g & 1)];
    }
    // llama.cpp's get_scale_min_k4, inverted.
    for (int j = 0; j < 4; ++j) {
      o[4 + j] = static_cast<uint8_t>(sc[j] | ((sc[j + 4] >> 4) << 6));
      o[8 + j] = static_cast<uint8_t>(mn[j] | ((mn[j + 4] >> 4) << 6));
      o[12 + j] = static_cast<uint8_t>((sc[j + 4] & 0xF) | ((mn[j + 4] & 0xF) << 4));
    }
    // qs[32 j + i]: value i of group 2 j (low nibble) and of group 2 j + 1 (high).
    for (int g = 0; g < 8; ++g) {
      for (int i = 0; i < 32; ++i) {
        const int t = i >> 3, within = i & 7;
        const uint8_t byte = b[320 + 256 * g + 64 * t + 4 * c + (within & 3)];
        const uint8_t value = within < 4 ? (byte & 0xF) : (byte >> 4);
        uint8_t& packed = o[16 + 32 * (g >> 1) + i];
        packed = (g & 1) ? static_cast<uint8_t>(packed | (value << 4)) : value;
      }
    }
  }
}

// Row c of a Q6_K tile as the file's blocks (nsb superblocks of 210 bytes into out).
inline void UnpackQ6K(const uint8_t* tile, int c, int64_t nsb, uint8_t* out) {
  for (int64_t sb = 0; sb < nsb; ++sb) {
    const uint8_t* b = tile + sb * kX16Bytes6;
    uint8_t* o = out + sb * 210;
    std::memcpy(o + 208, b + 2 * c, 2);
    for (int j = 0; j < 16; ++j) o[192 + j] = b[32 + 32 * (j >> 1) + 2 * c + (j & 1)];
    uint8_t v[256];  // the unsigned 6-bit values, in order
    for (int l = 0; l < 256; ++l) {
      const int j = l >> 4, q = (l >> 2) & 3, byte = l & 3;
      const uint8_t* group = b + 288 + 192 * j + 4 * c + byte;
      const uint8_t packed = group[q < 2 ? 0 : 64];
      const uint8_t low = (q & 1) ? (packed >> 4) : (packed & 0xF);
      v[l] = static_cast<uint8_t>(low | (((group[128] >> (2 * q)) & 3) << 4));
    }
    // llama.cpp's Q6_K: ql[64 n + l], ql[64 n + 32 + l] and qh[32 n + l] hold values
    // 128 n + l, + 32, + 64, + 96.
    for (int n = 0; n < 2; ++n) {
      for (int l = 0; l < 32; ++l) {
        const uint8_t* w = v + 128 * n + l;
        o[64 * n + l] = static_cast<uint8_t>((w[0] & 0xF) | ((w[64] & 0xF) << 4));
        o[64 * n + 32 + l] = static_cast<uint8_t>((w[32] & 0xF) | ((w[96] & 0xF) << 4));
        o[128 + 32 * n + l] = static_cast<uint8_t>((w[0] >> 4) | ((w[32] >> 4) << 2) |
                                                   ((w[64] >> 4) << 4) | ((w[96] >> 4) << 6));
      }
    }
  }
}

// Row c of a Q8_0 tile as the file's blocks (nb blocks of 34 bytes into out).
inline void UnpackQ8_0(const uint8_t* tile, int c, int64_t nb, uint8_t* out) {
  for (int64_t blk = 0; blk < nb; ++blk) {
    const uint8_t* b = tile + blk * kX16Bytes32<kQ8_0X16>;
    uint8_t* o = out + blk * 34;
    std::memcpy(o, b + 2 * c, 2);
    for (int v = 0; v < 32; ++v) o[2 + v] = b[32 + 64 * (v >> 2) + 4 * c + (v & 3)] ^ 0x80;
  }
}

// Row c of a Q4_0, Q4_1 or Q5_0 tile as the file's blocks (nb blocks into out).
template <int F>
void UnpackNibbles(const uint8_t* tile, int c, int64_t nb, uint8_t* out) {
  constexpr int kHeader = kNibbleHeader<F>, kQs = F == kQ5_0X16 ? 6 : kHeader;
  for (int64_t blk = 0; blk < nb; ++blk) {
    const uint8_t* b = tile + blk * kX16Bytes32<F>;
    uint8_t* o = out + blk * (kX16Bytes32<F> / 16);
    for (int h = 0; h < kHeader; h += 2) std::memcpy(o + h, b + 16 * h + 2 * c, 2);
    uint32_t qh = 0;
    for (int v = 0; v < 32; ++v) {
      if constexpr (F == kQ5_0X16) {
        const int bit = 4 * c + (v & 3);
        qh |= static_cast<uint32_t>((b[32 + 8 * (v >> 2) + (bit >> 3)] >> (bit & 7)) & 1) << v;
      }
      const uint8_t byte = b[kNibblesAt<F> + 64 * (v >> 3) + 4 * c + (v & 3)];
      const uint8_t low = (v & 4) ? (byte >> 4) : (byte & 0xF);
      uint8_t& packed = o[kQs + (v & 15)];
      packed = v < 16 ? low : static_cast<uint8_t>(packed | (low << 4));
    }
    if constexpr (F == kQ5_0X16) std::memcpy(o + 2, &qh, 4);
  }
}

// x's sums per group of 32 values as int16 pairs (groups 2p and 2p + 1), [row][sb][4]: what
// the minimums multiply.
inline void GroupSumPairs(int64_t m, int64_t k, QuantizedX& qx) {
  const int64_t nsb = k / 256;
  std::vector<int32_t>& out = qx.pairs32;
  out.resize(m * nsb * 4);
  for (int64_t row = 0; row < m; ++row) {
    for (int64_t sb = 0; sb < nsb; ++sb) {
      const int16_t* s = qx.sums16.data() + (row * k) / 16 + 16 * sb;
      for (int p = 0; p < 4; ++p) {
        const uint16_t lo = static_cast<uint16_t>(s[4 * p] + s[4 * p + 1]);
        const uint16_t hi = static_cast<uint16_t>(s[4 * p + 2] + s[4 * p + 3]);
        out[(row * nsb + sb) * 4 + p] = static_cast<int32_t>(lo | (static_cast<uint32_t>(hi) << 16));
      }
    }
  }
}

// The next tile's superblock into L2 while this one's first rows of x run: the rows after
// them read this tile again, so the stream the prefetchers follow is broken.
inline void Prefetch(const uint8_t* p, int64_t bytes) {
  for (int64_t at = 0; at < bytes; at += 64) _mm_prefetch(reinterpret_cast<const char*>(p + at), _MM_HINT_T1);
}

JAXINFER_VNNI512_INLINE __m512i Broadcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

// Rows [m0, m0 + MR) of x against one tile's 16 outputs, y[row, col0 .. col0 + 16).
template <int MR>
JAXINFER_VNNI512 void X16Tile(const Rows& r, const uint8_t* tile, int64_t col0, int64_t m0,
                              const uint8_t* next) {
  const int64_t nsb = r.k / 256;
  const __m512i low = _mm512_set1_epi8(0x0F);
  __m512 y[MR];
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i) y[i] = _mm512_setzero_ps();
  for (int64_t sb = 0; sb < nsb; ++sb) {
    const uint8_t* b = tile + sb * kX16Bytes;
    if (next != nullptr) Prefetch(next + sb * kX16Bytes, kX16Bytes);
    const int8_t* xq[MR];
    __m512i isum[MR], msum[MR];
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) {
      xq[i] = r.qx->q256.data() + (m0 + i) * r.k + 256 * sb;
      isum[i] = _mm512_setzero_si512();
      msum[i] = _mm512_setzero_si512();
    }
#pragma GCC unroll 2
    for (int g = 0; g < 8; ++g) {
      __m512i acc[MR];
#pragma GCC unroll 8
      for (int i = 0; i < MR; ++i) acc[i] = _mm512_setzero_si512();
#pragma GCC unroll 4
      for (int t = 0; t < 4; ++t) {
        const __m512i w = _mm512_loadu_si512(b + 320 + 256 * g + 64 * t);
        const __m512i lo = _mm512_and_si512(w, low);
        const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(w, 4), low);
#pragma GCC unroll 8
        for (int i = 0; i < MR; ++i) {
          acc[i] = _mm512_dpbusd_epi32(acc[i], lo, Broadcast4(xq[i] + 32 * g + 8 * t));
          acc[i] = _mm512_dpbusd_epi32(acc[i], hi, Broadcast4(xq[i] + 32 * g + 8 * t + 4));
        }
      }
      const __m512i sc = _mm512_cvtepu8_epi32(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 64 + 16 * g)));
#pragma GCC unroll 8
      for (int i = 0; i < MR; ++i) isum[i] = _mm512_add_epi32(isum[i], _mm512_mullo_epi32(acc[i], sc));
    }
#pragma GCC unroll 4
    for (int p = 0; p < 4; ++p) {
      const __m512i mins = _mm512_cvtepu8_epi16(
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 192 + 32 * p)));
#pragma GCC unroll 8
      for (int i = 0; i < MR; ++i) {
        const __m512i x_sums = _mm512_set1_epi32(r.qx->pairs32[((m0 + i) * nsb + sb) * 4 + p]);
        msum[i] = _mm512_dpwssd_epi32(msum[i], mins, x_sums);
      }
    }
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b)));
    const __m512 dmin =
        _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 32)));
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) {
      const __m512 dx = _mm512_set1_ps(r.qx->d256[(m0 + i) * nsb + sb]);
      y[i] = _mm512_fmadd_ps(_mm512_mul_ps(d, dx), _mm512_cvtepi32_ps(isum[i]), y[i]);
      y[i] = _mm512_fnmadd_ps(_mm512_mul_ps(dmin, dx), _mm512_cvtepi32_ps(msum[i]), y[i]);
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i) _mm512_storeu_ps(r.y + (m0 + i) * r.n + col0, y[i]);
}

// The same for a Q6_K tile: weight = d sc(j) (v - 32), v the unsigned 6-bit value; the 32 is
// taken back through x's sums per 16 (vpdpwssd against the scale pairs).
template <int MR>
JAXINFER_VNNI512 void X16Tile6(const Rows& r, const uint8_t* tile, int64_t col0, int64_t m0,
                               const uint8_t* next) {
  const int64_t nsb = r.k / 256;
  const __m512i low = _mm512_set1_epi8(0x0F), top = _mm512_set1_epi8(0x30);
  __m512 y[MR];
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i) y[i] = _mm512_setzero_ps();
  for (int64_t sb = 0; sb < nsb; ++sb) {
    const uint8_t* b = tile + sb * kX16Bytes6;
    if (next != nullptr) Prefetch(next + sb * kX16Bytes6, kX16Bytes6);
    const int8_t* xq[MR];
    const int16_t* xs[MR];
    __m512 fsum[MR];
    __m512i bias[MR];
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) {
      xq[i] = r.qx->q256.data() + (m0 + i) * r.k + 256 * sb;
      xs[i] = r.qx->sums16.data() + ((m0 + i) * r.k) / 16 + 16 * sb;
      fsum[i] = _mm512_setzero_ps();
      bias[i] = _mm512_setzero_si512();
    }
#pragma GCC unroll 1
    for (int p = 0; p < 8; ++p) {
      const __m512i pairs = _mm512_cvtepi8_epi16(
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 32 + 32 * p)));
#pragma GCC unroll 8
      for (int i = 0; i < MR; ++i) {
        int32_t x_sums;
        std::memcpy(&x_sums, xs[i] + 2 * p, 4);
        bias[i] = _mm512_dpwssd_epi32(bias[i], pairs, _mm512_set1_epi32(x_sums));
      }
#pragma GCC unroll 2
      for (int h = 0; h < 2; ++h) {
        const int j = 2 * p + h;
        const uint8_t* g = b + 288 + 192 * j;
        const __m512i a = _mm512_loadu_si512(g), bb = _mm512_loadu_si512(g + 64);
        const __m512i hi = _mm512_loadu_si512(g + 128);
        const __m512i v[4] = {
            _mm512_or_si512(_mm512_and_si512(a, low), _mm512_and_si512(_mm512_slli_epi16(hi, 4), top)),
            _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(a, 4), low),
                            _mm512_and_si512(_mm512_slli_epi16(hi, 2), top)),
            _mm512_or_si512(_mm512_and_si512(bb, low), _mm512_and_si512(hi, top)),
            _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(bb, 4), low),
                            _mm512_and_si512(_mm512_srli_epi16(hi, 2), top)),
        };
        // Scale j per row: the pair's low (h = 0) or high (h = 1) int16, as a float (the
        // integer sums times it exactly: both well inside float's 24 bits).
        const __m512 sc = _mm512_cvtepi32_ps(h == 0 ? _mm512_srai_epi32(_mm512_slli_epi32(pairs, 16), 16)
                                                    : _mm512_srai_epi32(pairs, 16));
#pragma GCC unroll 8
        for (int i = 0; i < MR; ++i) {
          __m512i acc = _mm512_dpbusd_epi32(_mm512_setzero_si512(), v[0], Broadcast4(xq[i] + 16 * j));
          acc = _mm512_dpbusd_epi32(acc, v[1], Broadcast4(xq[i] + 16 * j + 4));
          acc = _mm512_dpbusd_epi32(acc, v[2], Broadcast4(xq[i] + 16 * j + 8));
          acc = _mm512_dpbusd_epi32(acc, v[3], Broadcast4(xq[i] + 16 * j + 12));
          fsum[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc), sc, fsum[i]);
        }
      }
    }
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b)));
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) {
      const __m512 dx = _mm512_set1_ps(r.qx->d256[(m0 + i) * nsb + sb]);
      const __m512 total = _mm512_sub_ps(fsum[i], _mm512_cvtepi32_ps(_mm512_slli_epi32(bias[i], 5)));
      y[i] = _mm512_fmadd_ps(_mm512_mul_ps(d, dx), total, y[i]);
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i) _mm512_storeu_ps(r.y + (m0 + i) * r.n + col0, y[i]);
}

// The same for a tile of a 32-value format, block by block: weight = d (v - bias), v unsigned
// (Q8_0: bias 128; Q5_0: 16; Q4_0: 8), the bias taken back through x's integer sum per block;
// Q4_1's weight = d v + m, m times x's sum.
template <int F, int MR>
JAXINFER_VNNI512 void X16Tile32(const Rows& r, const uint8_t* tile, int64_t col0, int64_t m0,
                                const uint8_t* next) {
  constexpr int64_t kTile = kX16Bytes32<F>;
  constexpr int32_t kBias = F == kQ8_0X16 ? 128 : F == kQ5_0X16 ? 16 : F == kQ4_0X16 ? 8 : 0;
  const int64_t nb = r.k / 32;
  const __m512i low = _mm512_set1_epi8(0x0F), fifth = _mm512_set1_epi8(0x10);
  __m512 y[MR];
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i) y[i] = _mm512_setzero_ps();
  for (int64_t blk = 0; blk < nb; ++blk) {
    const uint8_t* b = tile + blk * kTile;
    if (next != nullptr) Prefetch(next + blk * kTile, kTile);
    const int8_t* xq[MR];
    __m512i acc[MR];
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) {
      xq[i] = r.qx->q32.data() + (m0 + i) * r.k + 32 * blk;
      acc[i] = _mm512_setzero_si512();
    }
    if constexpr (F == kQ8_0X16) {
#pragma GCC unroll 8
      for (int g = 0; g < 8; ++g) {
        const __m512i w = _mm512_loadu_si512(b + 32 + 64 * g);
#pragma GCC unroll 8
        for (int i = 0; i < MR; ++i) acc[i] = _mm512_dpbusd_epi32(acc[i], w, Broadcast4(xq[i] + 4 * g));
      }
    } else {
#pragma GCC unroll 4
      for (int t = 0; t < 4; ++t) {
        const __m512i w = _mm512_loadu_si512(b + kNibblesAt<F> + 64 * t);
        __m512i lo = _mm512_and_si512(w, low);
        __m512i hi = _mm512_and_si512(_mm512_srli_epi16(w, 4), low);
        if constexpr (F == kQ5_0X16) {
          uint64_t bits[2];
          std::memcpy(bits, b + 32 + 16 * t, 16);
          lo = _mm512_mask_add_epi8(lo, _cvtu64_mask64(bits[0]), lo, fifth);
          hi = _mm512_mask_add_epi8(hi, _cvtu64_mask64(bits[1]), hi, fifth);
        }
#pragma GCC unroll 8
        for (int i = 0; i < MR; ++i) {
          acc[i] = _mm512_dpbusd_epi32(acc[i], lo, Broadcast4(xq[i] + 8 * t));
          acc[i] = _mm512_dpbusd_epi32(acc[i], hi, Broadcast4(xq[i] + 8 * t + 4));
        }
      }
    }
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b)));
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) {
      const int64_t at = (m0 + i) * nb + blk;
      __m512i dot = acc[i];
      if constexpr (kBias != 0) dot = _mm512_sub_epi32(dot, _mm512_set1_epi32(kBias * r.qx->i32[at]));
      y[i] = _mm512_fmadd_ps(_mm512_mul_ps(d, _mm512_set1_ps(r.qx->d32[at])),
                             _mm512_cvtepi32_ps(dot), y[i]);
      if constexpr (F == kQ4_1X16) {  // + m dx sum(q)
        const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 32)));
        y[i] = _mm512_fmadd_ps(m, _mm512_set1_ps(r.qx->s32[at]), y[i]);
      }
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i) _mm512_storeu_ps(r.y + (m0 + i) * r.n + col0, y[i]);
}

template <int F, int MR>
JAXINFER_VNNI512_INLINE void X16Run(const Rows& r, const uint8_t* tile, int64_t col0, int64_t m0,
                                    const uint8_t* next) {
  if constexpr (F == kQ4_KX16) {
    X16Tile<MR>(r, tile, col0, m0, next);
  } else if constexpr (F == kQ6_KX16) {
    X16Tile6<MR>(r, tile, col0, m0, next);
  } else {
    X16Tile32<F, MR>(r, tile, col0, m0, next);
  }
}

// Every row of x against one tile; `next`: the tile after it (nullptr: none to prefetch).
template <int F>
JAXINFER_VNNI512 void X16Tiles(const Rows& r, const uint8_t* tile, int64_t col0,
                               const uint8_t* next) {
  if (r.m <= kX16RowTile) next = nullptr;  // one pass: the prefetchers follow the stream
  int64_t m0 = 0;
  for (; m0 + kX16RowTile <= r.m; m0 += kX16RowTile) {
    X16Run<F, kX16RowTile>(r, tile, col0, m0, m0 == 0 ? next : nullptr);
  }
  switch (r.m - m0) {
    case 5: return X16Run<F, 5>(r, tile, col0, m0, nullptr);
    case 4: return X16Run<F, 4>(r, tile, col0, m0, nullptr);
    case 3: return X16Run<F, 3>(r, tile, col0, m0, nullptr);
    case 2: return X16Run<F, 2>(r, tile, col0, m0, nullptr);
    case 1: return X16Run<F, 1>(r, tile, col0, m0, nullptr);
  }
}

// The file's format an interleaved one holds, and its rows rebuilt.
template <int F>
constexpr int kFileFormat = F == kQ4_KX16   ? kQ4_K
                            : F == kQ6_KX16 ? kQ6_K
                            : F == kQ4_0X16 ? kQ4_0
                            : F == kQ4_1X16 ? kQ4_1
                            : F == kQ5_0X16 ? kQ5_0
                                            : kQ8_0;

// nb: the row's blocks (superblocks for the k-quants).
template <int F>
void Unpack(const uint8_t* tile, int c, int64_t nb, uint8_t* out) {
  if constexpr (F == kQ4_KX16) {
    UnpackQ4K(tile, c, nb, out);
  } else if constexpr (F == kQ6_KX16) {
    UnpackQ6K(tile, c, nb, out);
  } else if constexpr (F == kQ8_0X16) {
    UnpackQ8_0(tile, c, nb, out);
  } else {
    UnpackNibbles<F>(tile, c, nb, out);
  }
}

// Output rows [first, stop) (multiples of 16) of an interleaved segment.
template <int F>
void X16SegmentRows(const Rows& r, const uint8_t* data, int64_t row_bytes, int64_t first,
                    int64_t stop, int64_t out_first, bool integer, bool vnni512) {
  constexpr int kFile = kFileFormat<F>;
  const int64_t nb = r.k / kValues<kFile>;
  std::vector<uint8_t> row;
  for (int64_t t = first; t < stop; t += kX16Rows) {
    const uint8_t* tile = data + t * row_bytes;
    if (integer && vnni512) {
      X16Tiles<F>(r, tile, out_first + t, t + kX16Rows < stop ? tile + kX16Rows * row_bytes : nullptr);
      continue;
    }
    row.resize(nb * kBytes<kFile>);
    for (int c = 0; c < kX16Rows; ++c) {
      Unpack<F>(tile, c, nb, row.data());
      SegmentRows<kFile>(r, row.data(), nb * kBytes<kFile>, 0, 1, out_first + t + c, integer,
                         vnni512);
    }
  }
}

// Row `row` of an interleaved segment, exact (the rows path).
template <int F>
void X16DequantizeRow(const uint8_t* data, int64_t row_bytes, int64_t row, int64_t k, float* out) {
  constexpr int kFile = kFileFormat<F>;
  std::vector<uint8_t> blocks(k / kValues<kFile> * kBytes<kFile>);
  Unpack<F>(data + (row / kX16Rows) * kX16Rows * row_bytes, static_cast<int>(row % kX16Rows),
            k / kValues<kFile>, blocks.data());
  DequantizeRow<kFile>(blocks.data(), k, out);
}
