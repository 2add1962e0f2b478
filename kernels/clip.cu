// The global gradient norm and the clip divisor on the device, with no host sync:
//   sumsq:   per-block sums of grad^2 (squares and sums in double: a finite fp32 square cannot
//            overflow, so the total is finite exactly when every gradient is finite)
//   divisor: second stage, one block: N = sqrt(sum), S = loss_scale, S = N / max_norm when
//            N > S * max_norm; out = [sum, N, S] (out + 2 is what the optimizer kernels read).
//            Under loss scaling (skip_non_finite) the scale is read on the device and a
//            non-finite N gives S = NaN: the optimizer kernels skip the update.
// The reduction order depends only on n and the grid, so the norm is deterministic.
// Oracle: _optim_cpu.clip_divisor (the rule: _optim_reference.clip_divisor_from_norm).
#include "common.cuh"

// Stage 1: partials[blockIdx.x] = sum of g^2 over this block's share (grid-stride).
// gridDim.x <= ORT_MAX_PARTIALS.
extern "C" __global__ void __launch_bounds__(ORT_BLOCK)
ort_trainer_clip_sumsq_f32(const float* g, ort_i64 n, double* partials) {
    __shared__ double shm[64];
    const ort_i64 tid = (ort_i64)blockIdx.x * blockDim.x + threadIdx.x;
    const ort_i64 stride = (ort_i64)gridDim.x * blockDim.x;
    double s = 0.0;
    ort_i64 scalar_from = 0;
    if (ort_aligned16(g)) {
        const ort_i64 nvec = n >> 2;
        const float4* g4 = reinterpret_cast<const float4*>(g);
        for (ort_i64 q = tid; q < nvec; q += stride) s += ort_sq4(g4[q]);
        scalar_from = nvec << 2;
    }
    for (ort_i64 i = scalar_from + tid; i < n; i += stride) s += ort_sq(g[i]);
    double unused = 0.0;
    ort_block_sum2(s, unused, shm);
    if (threadIdx.x == 0) partials[blockIdx.x] = s;
}

// Stage 2, launched with one block: the sum, the norm and the divisor. out: 3 doubles
// [sum of squares, N, S]. max_norm = inf gives S = loss_scale (sum of squares only).
// scale_ptr (may be null, then loss_scale): the device loss scale; skip_non_finite: S = NaN
// when N is not finite.
extern "C" __global__ void __launch_bounds__(ORT_BLOCK)
ort_trainer_clip_divisor_f32(const double* partials, int nparts, double max_norm,
                             double loss_scale, const double* scale_ptr, int skip_non_finite,
                             double* out) {
    __shared__ double shm[64];
    double s = 0.0;
    for (int k = threadIdx.x; k < nparts; k += blockDim.x) s += partials[k];
    double unused = 0.0;
    ort_block_sum2(s, unused, shm);
    if (threadIdx.x == 0) {
        const double norm = sqrt(s);
        double divisor = scale_ptr != nullptr ? *scale_ptr : loss_scale;
        if (norm > divisor * max_norm) divisor = norm / max_norm;
        if (skip_non_finite != 0 && !ort_isfinite(norm)) divisor = norm - norm;  // NaN: norm is inf or NaN
        out[0] = s;
        out[1] = norm;
        out[2] = divisor;
    }
}
