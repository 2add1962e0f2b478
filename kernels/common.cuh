// Shared pieces of the flat-buffer optimizer kernels (sgd.cu, adam.cu, lamb.cu, clip.cu).
//
// _kernels.py pastes this file in place of `#include "common.cuh"` before handing a kernel
// file to NVRTC, so CuPy's on-disk cache key (a hash of the source text) changes whenever this
// header does. Nothing here may include a system header: NVRTC has none.
//
// Contract with _kernels.py (struct layouts are mirrored there as NumPy dtypes: keep in sync):
//   - every buffer is a contiguous fp32 array of n elements in the flat layout (DESIGN.md);
//   - OrtGroup[ngroups]: the param groups, in order, non-empty, covering [0, n) contiguously;
//   - OrtChunk[nchunks]: pieces of at most ORT_CHUNK elements that never cross a segment
//     (tensor) boundary; interior piece boundaries fall on multiples of ORT_CHUNK;
//   - scalars that depend on the step (bias corrections, lr * r) are derived in double on the
//     device, once per thread and group, from double hyperparameters;
//   - the gradient divisor S is read from device memory when divisor_ptr is not null (the
//     output of clip), otherwise divisor_value is used: no host sync anywhere in a step;
//   - S = NaN marks an update skipped for non-finite gradients (clip.cu writes it under loss
//     scaling): every optimizer kernel then returns without writing anything;
//   - under loss scaling the update counters live on the device (OrtCounters below): the
//     kernels read t from them, and the lr from a table of the schedule indexed by t.
#ifndef ORT_TRAINER_COMMON_CUH
#define ORT_TRAINER_COMMON_CUH

typedef long long ort_i64;

#define ORT_BLOCK 256          // threads per block of every kernel launched by _kernels.py
#define ORT_CHUNK 16384        // elements per chunk (Lamb), a multiple of 4
#define ORT_MAX_PARTIALS 1024  // most blocks of the clip reduction (its partial sums)

// One param group: its element range and its hyperparameters (meaning per family, see the
// ORT_<FAMILY>_* indices in each .cu). 112 bytes, naturally aligned, no padding.
struct OrtGroup {
    ort_i64 start;   // first element of the group
    ort_i64 stop;    // one past its last element
    double d[4];     // double hyperparameters (bases of bias corrections, ratio bounds)
    float f[12];     // fp32 hyperparameters, derived ones (1 - alpha, ...) rounded from double
    int flags[4];    // integer / boolean hyperparameters
};
static_assert(sizeof(OrtGroup) == 112, "OrtGroup must match _kernels.GROUP_DTYPE");

// One chunk of a segment (Lamb): [start, stop), its segment and group.
struct OrtChunk {
    ort_i64 start;
    ort_i64 stop;
    int seg;
    int group;
};
static_assert(sizeof(OrtChunk) == 24, "OrtChunk must match _kernels.CHUNK_DTYPE");

// The gradient divisor S (clip divisor or loss scale) as a float reciprocal.
__device__ __forceinline__ float ort_inv_divisor(const double* divisor_ptr, double divisor_value) {
    const double s = divisor_ptr != nullptr ? *divisor_ptr : divisor_value;
    return (float)(1.0 / s);
}

// True when S marks a skipped update (NaN; without loss scaling S is never NaN).
__device__ __forceinline__ bool ort_skipped(const double* divisor_ptr) {
    return divisor_ptr != nullptr && !(*divisor_ptr == *divisor_ptr);
}

// The device counters of loss-scaled training (amp.cu writes them after each update), doubles:
#define ORT_UPDATES_APPLIED 0  // updates applied so far (skipped ones not counted)
#define ORT_STABLE_STEPS 1     // consecutive finite updates since the scale last moved
#define ORT_LAST_FINITE 2      // 1 when the last update was applied, 0 when it was skipped
#define ORT_LOSS_SCALE 3       // the loss scale, in double (the graph reads an fp32 copy)
#define ORT_COUNTERS 4

// t (1-based) of this update: from the device counters when given, else the host's `step`.
__device__ __forceinline__ ort_i64 ort_update_index(ort_i64 step, const double* counters) {
    return counters != nullptr ? (ort_i64)counters[ORT_UPDATES_APPLIED] + 1 : step;
}

// The lr of update t: lr_table[t - 1] when given (the schedule, filled ahead by the host), else lr.
__device__ __forceinline__ double ort_update_lr(double lr, const double* lr_table, ort_i64 t) {
    return lr_table != nullptr ? lr_table[t - 1] : lr;
}

// True when every pointer is 16-byte aligned, so float4 accesses at indices that are
// multiples of 4 are aligned. Same answer in every thread: the branch is uniform.
__device__ __forceinline__ bool ort_aligned16(const void* a, const void* b = nullptr,
                                              const void* c = nullptr, const void* d = nullptr) {
    const unsigned long long bits = (unsigned long long)a | (unsigned long long)b |
                                    (unsigned long long)c | (unsigned long long)d;
    return (bits & 15ull) == 0ull;
}

// The group that owns element i, remembered per thread: groups are few and contiguous, and a
// grid-stride loop crosses a group boundary only a handful of times per thread.
struct OrtGroupCursor {
    const OrtGroup* groups;
    int ngroups;
    int g;
    ort_i64 start;
    ort_i64 stop;

    __device__ __forceinline__ OrtGroupCursor(const OrtGroup* groups_, int ngroups_)
        : groups(groups_), ngroups(ngroups_), g(-1), start(0), stop(0) {}

    // Moves to the group of element i (0 <= i < n). Returns true when the group changed.
    __device__ __forceinline__ bool seek(ort_i64 i) {
        if (i >= start && i < stop) return false;
        int lo = 0, hi = ngroups - 1;  // the last group whose start is <= i
        while (lo < hi) {
            const int mid = (lo + hi + 1) >> 1;
            if (groups[mid].start <= i) lo = mid; else hi = mid - 1;
        }
        g = lo;
        start = groups[lo].start;
        stop = groups[lo].stop;
        return true;
    }
};

// Elementwise driver for SGD / Adam: a grid-stride loop over the whole flat buffer,
// float4 when `vec` (all buffers 16-byte aligned), scalar otherwise. Op provides
//   set_group(const OrtGroup&), apply4(i) (elements i..i+3, one group), apply1(i).
template <class Op>
__device__ __forceinline__ void ort_grid_foreach(Op& op, const OrtGroup* groups, int ngroups,
                                                 ort_i64 n, bool vec) {
    const ort_i64 tid = (ort_i64)blockIdx.x * blockDim.x + threadIdx.x;
    const ort_i64 stride = (ort_i64)gridDim.x * blockDim.x;
    OrtGroupCursor cur(groups, ngroups);
    ort_i64 scalar_from = 0;
    if (vec) {
        const ort_i64 nvec = n >> 2;
        for (ort_i64 q = tid; q < nvec; q += stride) {
            const ort_i64 i = q << 2;
            if (cur.seek(i)) op.set_group(groups[cur.g]);
            if (i + 4 <= cur.stop) {
                op.apply4(i);
            } else {  // the 4 elements straddle a group boundary
                for (int k = 0; k < 4; ++k) {
                    if (cur.seek(i + k)) op.set_group(groups[cur.g]);
                    op.apply1(i + k);
                }
            }
        }
        scalar_from = nvec << 2;
    }
    for (ort_i64 i = scalar_from + tid; i < n; i += stride) {
        if (cur.seek(i)) op.set_group(groups[cur.g]);
        op.apply1(i);
    }
}

// Block-level driver for one chunk [a, b) (Lamb): the threads of a block share the chunk;
// scalar head up to the first multiple of 4, float4 body, scalar tail.
template <class Op>
__device__ __forceinline__ void ort_chunk_foreach(Op& op, ort_i64 a, ort_i64 b, bool vec) {
    if (vec) {
        ort_i64 va = (a + 3) & ~3ll;
        if (va > b) va = b;
        ort_i64 vb = b & ~3ll;
        if (vb < va) vb = va;
        for (ort_i64 i = a + threadIdx.x; i < va; i += blockDim.x) op.apply1(i);
        for (ort_i64 q = (va >> 2) + threadIdx.x; q < (vb >> 2); q += blockDim.x) op.apply4(q << 2);
        for (ort_i64 i = vb + threadIdx.x; i < b; i += blockDim.x) op.apply1(i);
    } else {
        for (ort_i64 i = a + threadIdx.x; i < b; i += blockDim.x) op.apply1(i);
    }
}

__device__ __forceinline__ double ort_warp_sum(double x) {
    for (int off = 16; off > 0; off >>= 1) x += __shfl_down_sync(0xffffffffu, x, off);
    return x;
}

// Sum of x (and y) over the block; the result is valid in thread 0. Every thread of the block
// must call it (blockDim.x a multiple of 32, at most 1024). Deterministic for a given
// blockDim. Ends with a barrier, so `shm` (2 * 32 doubles) may be reused right after.
__device__ __forceinline__ void ort_block_sum2(double& x, double& y, double* shm) {
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int nwarps = blockDim.x >> 5;
    x = ort_warp_sum(x);
    y = ort_warp_sum(y);
    if (lane == 0) {
        shm[warp] = x;
        shm[32 + warp] = y;
    }
    __syncthreads();
    if (warp == 0) {
        x = lane < nwarps ? shm[lane] : 0.0;
        y = lane < nwarps ? shm[32 + lane] : 0.0;
        x = ort_warp_sum(x);
        y = ort_warp_sum(y);
    }
    __syncthreads();
}

__device__ __forceinline__ double ort_sq(float x) {
    const double d = (double)x;
    return d * d;
}

__device__ __forceinline__ double ort_sq4(float4 v) {
    return ort_sq(v.x) + ort_sq(v.y) + ort_sq(v.z) + ort_sq(v.w);
}

// Bias correction 1 - base^t, in double (1 - 0.999f^1 in float would be off by 1e-5).
__device__ __forceinline__ double ort_bias_correction(double base, ort_i64 t) {
    return 1.0 - pow(base, (double)t);
}

// isfinite without headers; NaN compares false, so it is not finite.
__device__ __forceinline__ bool ort_isfinite(float x) { return fabsf(x) <= 3.402823466e+38f; }
__device__ __forceinline__ bool ort_isfinite(double x) { return fabs(x) <= 1.7976931348623157e+308; }

#endif  // ORT_TRAINER_COMMON_CUH
