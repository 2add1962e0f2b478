// Lamb (ORT's LambOptimizer) over all param groups, three launches per step, t = step:
//   direction: g = grad / S;  m' = alpha * m + (1 - alpha) * g;  v' = beta * v + (1 - beta) * g^2
//              c1, c2 = 1 - alpha^t, 1 - beta^t when do_bias_correction, else 1
//              d = lambda * w + (m' / c1) / (sqrt(v' / c2) + eps)
//              d finite: m, v = m', v';  otherwise d = 0 and m, v unchanged
//              per chunk: sum w^2 and d^2 (double), written to partials[2 * chunk + {0, 1}]
//   ratio:     per segment (tensor): ||w||^2, ||d||^2 from its chunks' partials (fixed
//              order, so deterministic); r = max(ratio_min, min(ratio_max, ||w|| / ||d||)),
//              1 if either norm is 0; lr_ratio[seg] = lr * r (double: it may not fit a float)
//   update:    w_new = w - (lr * r) * d, the product in double, stored only where finite
// Oracle: _optim_reference.lamb_reference. Traffic: 28 + 12 bytes/param (d goes through `dbuf`).
#include "common.cuh"

// OrtGroup fields (packed by _kernels.group_table, mirrored in _kernels.GROUP_FIELDS)
#define ORT_LAMB_ALPHA 0             // f[0]
#define ORT_LAMB_ONE_MINUS_ALPHA 1   // f[1], rounded from double
#define ORT_LAMB_BETA 2              // f[2]
#define ORT_LAMB_ONE_MINUS_BETA 3    // f[3], rounded from double
#define ORT_LAMB_LAMBDA 4            // f[4]
#define ORT_LAMB_EPSILON 5           // f[5]
#define ORT_LAMB_ALPHA_D 0           // d[0], base of c1
#define ORT_LAMB_BETA_D 1            // d[1], base of c2
#define ORT_LAMB_RATIO_MIN 2         // d[2]
#define ORT_LAMB_RATIO_MAX 3         // d[3]
#define ORT_LAMB_BIAS_CORRECTION 0   // flags[0]

struct OrtLambDirectionOp {
    const float* w;
    const float* g;
    float* m;
    float* v;
    float* dbuf;
    float inv_s;
    float alpha, oma, beta, omb, lambda, eps, inv_c1, inv_c2;
    double sw;  // this thread's sum of w^2
    double sd;  // this thread's sum of d^2

    __device__ __forceinline__ void set_group(const OrtGroup& G, ort_i64 t) {
        alpha = G.f[ORT_LAMB_ALPHA];
        oma = G.f[ORT_LAMB_ONE_MINUS_ALPHA];
        beta = G.f[ORT_LAMB_BETA];
        omb = G.f[ORT_LAMB_ONE_MINUS_BETA];
        lambda = G.f[ORT_LAMB_LAMBDA];
        eps = G.f[ORT_LAMB_EPSILON];
        double c1 = 1.0, c2 = 1.0;
        if (G.flags[ORT_LAMB_BIAS_CORRECTION] != 0) {
            c1 = ort_bias_correction(G.d[ORT_LAMB_ALPHA_D], t);
            c2 = ort_bias_correction(G.d[ORT_LAMB_BETA_D], t);
        }
        inv_c1 = (float)(1.0 / c1);
        inv_c2 = (float)(1.0 / c2);
    }

    // Returns d; updates mv, vv in place only when d is finite.
    __device__ __forceinline__ float direction(float wv, float gv, float& mv, float& vv) {
        gv = gv * inv_s;
        const float mn = alpha * mv + oma * gv;
        const float vn = beta * vv + omb * (gv * gv);
        float d = lambda * wv + (mn * inv_c1) / (sqrtf(vn * inv_c2) + eps);
        if (ort_isfinite(d)) {
            mv = mn;
            vv = vn;
        } else {
            d = 0.0f;
        }
        sw += ort_sq(wv);
        sd += ort_sq(d);
        return d;
    }

    __device__ __forceinline__ void apply1(ort_i64 i) {
        float mv = m[i], vv = v[i];
        dbuf[i] = direction(w[i], g[i], mv, vv);
        m[i] = mv;
        v[i] = vv;
    }

    __device__ __forceinline__ void apply4(ort_i64 i) {
        const float4 W = *reinterpret_cast<const float4*>(w + i);
        const float4 G = *reinterpret_cast<const float4*>(g + i);
        float4 M = *reinterpret_cast<const float4*>(m + i);
        float4 V = *reinterpret_cast<const float4*>(v + i);
        float4 D;
        D.x = direction(W.x, G.x, M.x, V.x);
        D.y = direction(W.y, G.y, M.y, V.y);
        D.z = direction(W.z, G.z, M.z, V.z);
        D.w = direction(W.w, G.w, M.w, V.w);
        *reinterpret_cast<float4*>(m + i) = M;
        *reinterpret_cast<float4*>(v + i) = V;
        *reinterpret_cast<float4*>(dbuf + i) = D;
    }
};

// Phase 1: moments, direction d (into dbuf) and per-chunk sums of squares of w and d.
// One block per chunk (grid-stride over chunks); partials: 2 * nchunks doubles.
extern "C" __global__ void __launch_bounds__(ORT_BLOCK)
ort_trainer_lamb_direction_f32(const float* w, const float* g, float* m, float* v, float* dbuf,
                               const OrtGroup* groups, const OrtChunk* chunks, int nchunks,
                               ort_i64 step, const double* divisor_ptr, double divisor_value,
                               const double* counters, double* partials) {
    __shared__ double shm[64];
    if (ort_skipped(divisor_ptr)) return;  // uniform over the grid: no barrier is left waiting
    const ort_i64 t = ort_update_index(step, counters);
    OrtLambDirectionOp op;
    op.w = w;
    op.g = g;
    op.m = m;
    op.v = v;
    op.dbuf = dbuf;
    op.inv_s = ort_inv_divisor(divisor_ptr, divisor_value);
    const bool vec = ort_aligned16(w, g, m, v) && ort_aligned16(dbuf);
    int current = -1;
    for (int c = blockIdx.x; c < nchunks; c += gridDim.x) {  // block-uniform loop
        const OrtChunk ch = chunks[c];
        if (ch.group != current) {
            op.set_group(groups[ch.group], t);
            current = ch.group;
        }
        op.sw = 0.0;
        op.sd = 0.0;
        ort_chunk_foreach(op, ch.start, ch.stop, vec);
        double sw = op.sw, sd = op.sd;
        ort_block_sum2(sw, sd, shm);
        if (threadIdx.x == 0) {
            partials[2 * (ort_i64)c] = sw;
            partials[2 * (ort_i64)c + 1] = sd;
        }
    }
}

// Phase 2: per segment, the norms from its chunks' partials and lr_ratio[seg] = lr * r.
// seg_chunk[seg] .. seg_chunk[seg + 1]: the segment's chunks. One block per segment.
// divisor_ptr, counters, lr_table (may be null): as in phase 1, the skip, t and the lr of t.
extern "C" __global__ void __launch_bounds__(ORT_BLOCK)
ort_trainer_lamb_ratio_f32(const double* partials, const OrtChunk* chunks, const int* seg_chunk,
                           const OrtGroup* groups, int nseg, double lr, ort_i64 step,
                           const double* divisor_ptr, const double* counters,
                           const double* lr_table, double* lr_ratio) {
    __shared__ double shm[64];
    if (ort_skipped(divisor_ptr)) return;
    lr = ort_update_lr(lr, lr_table, ort_update_index(step, counters));
    for (int seg = blockIdx.x; seg < nseg; seg += gridDim.x) {  // block-uniform loop
        const int c0 = seg_chunk[seg];
        const int c1 = seg_chunk[seg + 1];
        double sw = 0.0, sd = 0.0;
        for (int c = c0 + (int)threadIdx.x; c < c1; c += blockDim.x) {
            sw += partials[2 * (ort_i64)c];
            sd += partials[2 * (ort_i64)c + 1];
        }
        ort_block_sum2(sw, sd, shm);
        if (threadIdx.x == 0) {
            const OrtGroup& G = groups[chunks[c0].group];
            double r = 1.0;
            if (sw != 0.0 && sd != 0.0) {
                // max(ratio_min, min(ratio_max, x)) as the original: ratio_min wins if the
                // bounds cross; a NaN stays NaN (numpy.maximum / minimum propagate it).
                r = sqrt(sw / sd);
                if (r > G.d[ORT_LAMB_RATIO_MAX]) r = G.d[ORT_LAMB_RATIO_MAX];
                if (r < G.d[ORT_LAMB_RATIO_MIN]) r = G.d[ORT_LAMB_RATIO_MIN];
            }
            lr_ratio[seg] = lr * r;
        }
    }
}

struct OrtLambUpdateOp {
    float* w;
    const float* dbuf;
    double lrr;

    __device__ __forceinline__ float update(float wv, float d) const {
        const float u = wv - (float)(lrr * (double)d);
        return ort_isfinite(u) ? u : wv;
    }

    __device__ __forceinline__ void apply1(ort_i64 i) { w[i] = update(w[i], dbuf[i]); }

    __device__ __forceinline__ void apply4(ort_i64 i) {
        float4 W = *reinterpret_cast<const float4*>(w + i);
        const float4 D = *reinterpret_cast<const float4*>(dbuf + i);
        W.x = update(W.x, D.x);
        W.y = update(W.y, D.y);
        W.z = update(W.z, D.z);
        W.w = update(W.w, D.w);
        *reinterpret_cast<float4*>(w + i) = W;
    }
};

// Phase 3: w -= lr * r * d where the result is finite. One block per chunk (grid-stride).
extern "C" __global__ void __launch_bounds__(ORT_BLOCK)
ort_trainer_lamb_update_f32(float* w, const float* dbuf, const OrtChunk* chunks, int nchunks,
                            const double* divisor_ptr, const double* lr_ratio) {
    if (ort_skipped(divisor_ptr)) return;
    OrtLambUpdateOp op;
    op.w = w;
    op.dbuf = dbuf;
    op.lrr = 0.0;
    const bool vec = ort_aligned16(w, dbuf);
    for (int c = blockIdx.x; c < nchunks; c += gridDim.x) {
        const OrtChunk ch = chunks[c];
        op.lrr = lr_ratio[ch.seg];
        ort_chunk_foreach(op, ch.start, ch.stop, vec);
    }
}
