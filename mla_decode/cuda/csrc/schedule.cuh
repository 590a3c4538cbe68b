// The work-balanced schedule (mla_decode/schedule.py is its reference and docs/2026-12-06-schedule.md its design):
// the batch's work on one line of cost units, SEQUENCE_COST for each sequence's fixed work and one a KV tile, cut into
// `parts` equal shares. A piece is a sequence's run within one share: item k of the call's items, in line order, is
// {b, first tile, end tile, index << 16 | count} (piece `index` of sequence b's `count`), and {-1, 0, 0, 0} past the
// last piece (max_items = parts + batch bounds the pieces: each share boundary adds at most one); after them,
// part_first (parts + 1,): part p's pieces are items part_first[p] .. part_first[p + 1] - 1. Made by one CTA
// from seqs on the device, so no length is read on the host and a CUDA graph replays it with new lengths.
#pragma once

#include "common.cuh"

namespace mla {

constexpr int SEQUENCE_COST = 1;         // schedule.py's SEQUENCE_COST: a sequence's fixed work, in tiles
constexpr int PIECE_COST = SEQUENCE_COST;  // schedule.py's PIECE_COST: the fill cut's fixed cost of each piece
constexpr int FILL_ROUND = 4096;         // the fill cut: sequences whose tiles a round stages for the walk
constexpr int SCHEDULE_THREADS = 1024;   // one CTA: a sequence a thread, in rounds of this many

// Sequence b's tiles: 0 where its length or range is invalid (the split kernels make its rows NaN, reading nothing).
// A ragged range is judged without the cache's rows (a schedule is made from kv_indptr alone): one that ends past
// the cache costs its tiles here and still reads nothing there.
__device__ __forceinline__ int sequence_tiles(const DecodeCall& c, int b) {
  int len;
  if (c.page_size == 0) {
    const int start = c.seqs[b], end = c.seqs[b + 1];
    len = start >= 0 && end >= start ? end - start : 0;
  } else {
    len = c.seqs[b];
    len = len >= 0 && len <= c.max_pages * c.page_size ? len : 0;
  }
  return (len + BN - 1) / BN;
}

// The exclusive prefix sum of v over the CTA, and the total in *total (scratch: 32 values of shared memory).
template <typename T>
__device__ __forceinline__ T exclusive_scan(T v, T* scratch, T* total) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  T x = v;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const T y = __shfl_up_sync(0xffffffffu, x, o);
    if (lane >= o) x += y;
  }
  if (lane == 31) scratch[warp] = x;
  __syncthreads();
  if (warp == 0) {
    T w = lane < warps ? scratch[lane] : T(0);
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const T y = __shfl_up_sync(0xffffffffu, w, o);
      if (lane >= o) w += y;
    }
    scratch[lane] = w;  // inclusive over warps
  }
  __syncthreads();
  const T before = (warp > 0 ? scratch[warp - 1] : T(0)) + x - v;
  *total = scratch[warps - 1];
  __syncthreads();  // scratch is free for the next call
  return before;
}

// Both cuts' share: the line's length (every sequence's tiles and SEQUENCE_COST) over the parts, rounded up, and at
// least min_share. Every thread of the CTA calls it and gets it.
__device__ __forceinline__ long long cut_share(const DecodeCall& c, long long* scratch) {
  long long total = 0, round_total;
  for (int b0 = 0; b0 < c.batch; b0 += blockDim.x) {
    const int b = b0 + threadIdx.x;
    exclusive_scan<long long>(b < c.batch ? sequence_tiles(c, b) + SEQUENCE_COST : 0, scratch, &round_total);
    total += round_total;
  }
  return max((total + c.parts - 1) / c.parts, static_cast<long long>(c.min_share));
}

__global__ void __launch_bounds__(SCHEDULE_THREADS, 1) schedule_kernel(const DecodeCall c) {
  __shared__ long long scratch_cost[32];
  __shared__ int scratch_items[32];
  long long round_total;
  const long long share = cut_share(c, scratch_cost);
  int* const starts = const_cast<int*>(part_first(c));
  long long line = 0;  // where this round's first sequence starts
  int item = 0;        // its first piece
  for (int b0 = 0; b0 < c.batch; b0 += blockDim.x) {
    const int b = b0 + threadIdx.x;
    const int tiles = b < c.batch ? sequence_tiles(c, b) : 0;
    const long long cost = b < c.batch ? tiles + SEQUENCE_COST : 0;
    const long long start = line + exclusive_scan<long long>(cost, scratch_cost, &round_total);
    const long long first_part = start / share, last_part = (start + cost - 1) / share;
    const int count = b < c.batch ? static_cast<int>(last_part - first_part + 1) : 0;
    int round_items;
    const int first = item + exclusive_scan<int>(count, scratch_items, &round_items);
    for (int j = 0; j < count; ++j) {
      const long long part = first_part + j;
      const long long from = max(start, part * share), to = min(start + cost, (part + 1) * share);
      const int lo = static_cast<int>(max(from - start - SEQUENCE_COST, 0LL));
      const int hi = max(static_cast<int>(to - start - SEQUENCE_COST), lo);
      c.items[first + j] = make_int4(b, lo, hi, j << 16 | count);
      if (from == part * share) starts[part] = first + j;  // the part's first piece: every used part has one
    }
    line += round_total;
    item += round_items;
  }
  for (int k = item + threadIdx.x; k < c.max_items; k += blockDim.x) c.items[k] = make_int4(-1, 0, 0, 0);
  // the parts past the line's end (`line`, the total by now; share rounds up) take no piece, and part_first[parts]
  // closes the last
  for (int p = static_cast<int>((line + share - 1) / share) + threadIdx.x; p <= c.parts; p += blockDim.x)
    starts[p] = item;
}

// The fill and pack cuts' walk (schedule.py's _Walk): parts filled in turn with `payload` units each, the last taking
// the rest, items listed as the parts take them. Its state is uniform over the threads that walk; `writer` alone
// stores items and part_first.
struct FillWalk {
  const DecodeCall& c;
  int* starts;
  long long payload, room;  // room: what the part's payload has left (below 0 where slack let it overfill)
  int part, item;
  bool last, writer;        // last: the last part, which takes the rest

  // The most tiles that fit the part whole, with PIECE_COST, within payload + slack (all, in the last part).
  __device__ __forceinline__ long long most_tiles() const {
    return last ? 1ll << 62 : room + c.slack - PIECE_COST;
  }
  __device__ __forceinline__ bool fits(int tiles) const { return tiles <= most_tiles(); }

  __device__ __forceinline__ void next_part() {
    ++part;
    if (writer) starts[part] = item;
    room = payload;
    last = part == c.parts - 1;
  }

  // Sequence b's `left` tiles from this part on: whole where they fit, else what fits (where more than PIECE_COST of
  // the payload is left) and the rest from the next part; then its pieces' index and count.
  __device__ __forceinline__ void place(int b, int left) {
    const int first = item;
    int lo = 0;
    while (true) {
      if (fits(left)) {
        if (writer) c.items[item] = make_int4(b, lo, lo + left, 0);
        ++item;
        room -= left + PIECE_COST;
        break;
      }
      if (room > PIECE_COST) {
        const int take = static_cast<int>(room - PIECE_COST);
        if (writer) c.items[item] = make_int4(b, lo, lo + take, 0);
        ++item;
        lo += take;
        left -= take;
      }
      next_part();
    }
    const int count = item - first;
    if (writer)
      for (int j = 0; j < count; ++j) c.items[first + j].w = j << 16 | count;
  }
};

// After a walk: part_first's first entry and the parts past the walk's end (they take none), then the padding past
// the listed items. Every thread of the CTA calls it; `walk` is the writer's.
__device__ __forceinline__ void close_walk(const DecodeCall& c, const FillWalk* walk, int* listed) {
  if (walk) {
    walk->starts[0] = 0;
    for (int p = walk->part + 1; p <= c.parts; ++p) walk->starts[p] = walk->item;
    *listed = walk->item;
  }
  __syncthreads();
  for (int k = *listed + threadIdx.x; k < c.max_items; k += blockDim.x) c.items[k] = make_int4(-1, 0, 0, 0);
}

// The fill cut (schedule.py's fill_schedule, its reference): parts filled in turn with payload = max(ceil(total /
// parts), min_share) + PIECE_COST units, a sequence whole where it fits within payload + c.slack, else cut where more
// than PIECE_COST of the payload is left, every piece charged PIECE_COST; the last part takes what is left. The walk
// is serial (where a part ends depends on every part before it): one thread walks each round's FILL_ROUND
// sequences, whose tiles the CTA stages in shared memory. The same items and part_first as schedule_kernel's, so the
// decode and combine kernels read either.
__global__ void __launch_bounds__(SCHEDULE_THREADS, 1) fill_schedule_kernel(const DecodeCall c) {
  __shared__ long long scratch_cost[32];
  __shared__ int tiles[FILL_ROUND];
  __shared__ int listed;
  const long long payload = cut_share(c, scratch_cost) + PIECE_COST;
  FillWalk walk{c, const_cast<int*>(part_first(c)), payload, payload, 0, 0, c.parts == 1, threadIdx.x == 0};
  for (int b0 = 0; b0 < c.batch; b0 += FILL_ROUND) {
    __syncthreads();  // the last round's walk is done with `tiles`
    for (int i = threadIdx.x; i < FILL_ROUND && b0 + i < c.batch; i += blockDim.x) tiles[i] = sequence_tiles(c, b0 + i);
    __syncthreads();
    if (threadIdx.x != 0) continue;
    for (int b = b0; b < min(b0 + FILL_ROUND, c.batch); ++b) walk.place(b, tiles[b - b0]);
  }
  close_walk(c, threadIdx.x == 0 ? &walk : nullptr, &listed);
}

// The pack cut (schedule.py's pack_schedule, its reference): the fill cut's walk, each part taking the longest
// sequence not yet placed whose tiles fit whole (ties: the lower index), and cutting the longest left only where none
// fits and more than PIECE_COST of the payload is left. The CTA sorts the batch by tiles (at most PACK_MAX_BATCH
// sequences, a bitonic sort in shared memory); warp 0 walks it, its lanes searching the sequences not yet placed 32
// words of 32 at a time.
constexpr int PACK_MAX_BATCH = 4096;
constexpr int PACK_WORDS = PACK_MAX_BATCH / 32;

__global__ void __launch_bounds__(SCHEDULE_THREADS, 1) pack_schedule_kernel(const DecodeCall c) {
  __shared__ long long scratch_cost[32];
  __shared__ unsigned long long keys[PACK_MAX_BATCH];  // tiles << 32 | ~b: sorted descending, longest first
  __shared__ unsigned placed[PACK_WORDS];             // bit i: sorted sequence i is placed (or past the batch)
  __shared__ int listed;
  const long long payload = cut_share(c, scratch_cost) + PIECE_COST;
  const int n = c.batch > 1 ? 1 << (32 - __clz(c.batch - 1)) : 1;  // the sort's length: a power of two
  for (int i = threadIdx.x; i < n; i += blockDim.x)
    keys[i] = i < c.batch ? static_cast<unsigned long long>(sequence_tiles(c, i)) << 32 | ~static_cast<unsigned>(i)
                          : 0ull;  // below every sequence's key: sorted past the batch
  for (int w = threadIdx.x; w < PACK_WORDS; w += blockDim.x)
    placed[w] = w * 32 >= c.batch ? ~0u : w * 32 + 32 <= c.batch ? 0u : ~0u << (c.batch - w * 32);
  __syncthreads();
  for (int k = 2; k <= n; k <<= 1) {
    for (int j = k >> 1; j > 0; j >>= 1) {
      for (int i = threadIdx.x; i < n; i += blockDim.x) {
        const int partner = i ^ j;
        if (partner > i) {
          const unsigned long long a = keys[i], b = keys[partner];
          if (((i & k) == 0) == (a < b)) keys[i] = b, keys[partner] = a;  // descending where i & k == 0
        }
      }
      __syncthreads();
    }
  }
  const int lane = threadIdx.x & 31;
  FillWalk walk{c, const_cast<int*>(part_first(c)), payload, payload, 0, 0, c.parts == 1, threadIdx.x == 0};
  // The first sorted sequence from `from` on that is not placed, or c.batch: the warp's lanes look at 32 words at once.
  auto first_left = [&](int from) {
    for (int w0 = from >> 5; w0 < PACK_WORDS; w0 += 32) {
      const int w = w0 + lane;
      unsigned left = w < PACK_WORDS ? ~placed[w] : 0u;
      if (w == from >> 5) left &= ~0u << (from & 31);
      const unsigned words = __ballot_sync(0xffffffffu, left != 0u);
      if (words) {
        const int src = __ffs(words) - 1;
        return ((w0 + src) << 5) + __ffs(__shfl_sync(0xffffffffu, left, src)) - 1;
      }
    }
    return c.batch;
  };
  if (threadIdx.x < 32) {
    for (int remaining = c.batch; remaining > 0;) {
      // the first sorted sequence that fits whole: a binary search over the descending tiles
      const long long fit = walk.most_tiles();
      int lo = 0, hi = c.batch;
      while (lo < hi) {
        const int mid = (lo + hi) >> 1;
        if (static_cast<long long>(keys[mid] >> 32) <= fit) hi = mid;
        else lo = mid + 1;
      }
      int i = first_left(lo);
      if (i == c.batch && walk.room > PIECE_COST) i = first_left(0);  // none fits whole: cut the longest left
      if (i == c.batch) {
        walk.next_part();
        continue;
      }
      if (lane == 0) placed[i >> 5] |= 1u << (i & 31);
      __syncwarp();
      --remaining;
      walk.place(~static_cast<unsigned>(keys[i]), static_cast<int>(keys[i] >> 32));
    }
  }
  close_walk(c, threadIdx.x == 0 ? &walk : nullptr, &listed);
}

}  // namespace mla
