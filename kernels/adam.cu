// Adam (ORT's AdamOptimizer) over all param groups in one launch. Per element, t = step:
//   g = grad / S;  m = alpha * m + (1 - alpha) * g;  v = beta * v + (1 - beta) * g^2
//   c1 = 1 - alpha^t, c2 = 1 - beta^t when do_bias_correction, else 1
//   mode 0: w -= lr * ((m / c1) / (sqrt(v / c2) + eps) + lambda * w)
//   mode 1: s = lr * sqrt(c2) / c1;  w' = w - s * m / (sqrt(v) + eps);  w = w' - lr * lambda * w'
// Oracle: _optim_reference.adam_reference. Traffic: reads g, w, m, v and writes w, m, v once
// (28 bytes/param).
#include "common.cuh"

// OrtGroup fields (packed by _kernels.group_table, mirrored in _kernels.GROUP_FIELDS)
#define ORT_ADAM_ALPHA 0             // f[0]
#define ORT_ADAM_ONE_MINUS_ALPHA 1   // f[1], rounded from double
#define ORT_ADAM_BETA 2              // f[2]
#define ORT_ADAM_ONE_MINUS_BETA 3    // f[3], rounded from double
#define ORT_ADAM_LAMBDA 4            // f[4]
#define ORT_ADAM_EPSILON 5           // f[5]
#define ORT_ADAM_ALPHA_D 0           // d[0], base of c1
#define ORT_ADAM_BETA_D 1            // d[1], base of c2
#define ORT_ADAM_BIAS_CORRECTION 0   // flags[0]
#define ORT_ADAM_DECAY_MODE 1        // flags[1], 0 or 1

struct OrtAdamOp {
    float* w;
    const float* g;
    float* m;
    float* v;
    double lr_d;
    float lr;
    float inv_s;
    ort_i64 t;
    // current group
    float alpha, oma, beta, omb, eps;
    float inv_c1, inv_c2;  // mode 0
    float step_size;       // mode 1: lr * sqrt(c2) / c1
    float decay;           // mode 0: lambda; mode 1: lr * lambda
    int mode;

    __device__ __forceinline__ void set_group(const OrtGroup& G) {
        alpha = G.f[ORT_ADAM_ALPHA];
        oma = G.f[ORT_ADAM_ONE_MINUS_ALPHA];
        beta = G.f[ORT_ADAM_BETA];
        omb = G.f[ORT_ADAM_ONE_MINUS_BETA];
        eps = G.f[ORT_ADAM_EPSILON];
        mode = G.flags[ORT_ADAM_DECAY_MODE];
        double c1 = 1.0, c2 = 1.0;
        if (G.flags[ORT_ADAM_BIAS_CORRECTION] != 0) {
            c1 = ort_bias_correction(G.d[ORT_ADAM_ALPHA_D], t);
            c2 = ort_bias_correction(G.d[ORT_ADAM_BETA_D], t);
        }
        inv_c1 = (float)(1.0 / c1);
        inv_c2 = (float)(1.0 / c2);
        step_size = (float)(lr_d * sqrt(c2) / c1);
        const float lambda = G.f[ORT_ADAM_LAMBDA];
        decay = mode == 0 ? lambda : (float)(lr_d * (double)lambda);
    }

    __device__ __forceinline__ void update(float& wv, float gv, float& mv, float& vv) const {
        gv = gv * inv_s;
        mv = alpha * mv + oma * gv;
        vv = beta * vv + omb * (gv * gv);
        if (mode == 0) {
            const float mhat = mv * inv_c1;
            const float vhat = vv * inv_c2;
            wv = wv - lr * (mhat / (sqrtf(vhat) + eps) + decay * wv);
        } else {
            const float wp = wv - (step_size * mv) / (sqrtf(vv) + eps);
            wv = wp - decay * wp;
        }
    }

    __device__ __forceinline__ void apply1(ort_i64 i) {
        float wv = w[i], mv = m[i], vv = v[i];
        update(wv, g[i], mv, vv);
        w[i] = wv;
        m[i] = mv;
        v[i] = vv;
    }

    __device__ __forceinline__ void apply4(ort_i64 i) {
        float4 W = *reinterpret_cast<const float4*>(w + i);
        const float4 G = *reinterpret_cast<const float4*>(g + i);
        float4 M = *reinterpret_cast<const float4*>(m + i);
        float4 V = *reinterpret_cast<const float4*>(v + i);
        update(W.x, G.x, M.x, V.x);
        update(W.y, G.y, M.y, V.y);
        update(W.z, G.z, M.z, V.z);
        update(W.w, G.w, M.w, V.w);
        *reinterpret_cast<float4*>(w + i) = W;
        *reinterpret_cast<float4*>(m + i) = M;
        *reinterpret_cast<float4*>(v + i) = V;
    }
};

// One Adam step (t = step, 1-based) over the whole flat buffer.
// divisor_ptr: device double S (may be null, then divisor_value; NaN: skip); counters, lr_table
// (may be null): the device counters and lr schedule of loss scaling (common.cuh), which then
// decide t and the lr.
extern "C" __global__ void __launch_bounds__(ORT_BLOCK)
ort_trainer_adam_step_f32(float* w, const float* g, float* m, float* v, const OrtGroup* groups,
                          int ngroups, ort_i64 n, double lr, ort_i64 step,
                          const double* divisor_ptr, double divisor_value,
                          const double* counters, const double* lr_table) {
    if (ort_skipped(divisor_ptr)) return;
    OrtAdamOp op;
    op.t = ort_update_index(step, counters);
    op.w = w;
    op.g = g;
    op.m = m;
    op.v = v;
    op.lr_d = ort_update_lr(lr, lr_table, op.t);
    op.lr = (float)op.lr_d;
    op.inv_s = ort_inv_divisor(divisor_ptr, divisor_value);
    op.alpha = op.oma = op.beta = op.omb = op.eps = 0.0f;
    op.inv_c1 = op.inv_c2 = op.step_size = op.decay = 0.0f;
    op.mode = 0;
    ort_grid_foreach(op, groups, ngroups, n, ort_aligned16(w, g, m, v));
}
