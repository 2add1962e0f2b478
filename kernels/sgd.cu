// SGD with torch.optim.SGD semantics, over all param groups in one launch.
//   g = grad / S;  if lambda: g += lambda * w
//   if momentum: buf = g (first step) else buf = momentum * buf + (1 - dampening) * g
//                g = g + momentum * buf (nesterov) else buf
//   w -= lr * g
// Oracle: _optim_reference.sgd_reference. Traffic: 12 bytes/param (20 with momentum).
#include "common.cuh"

// OrtGroup fields (packed by _kernels.group_table, mirrored in _kernels.GROUP_FIELDS)
#define ORT_SGD_MOMENTUM 0            // f[0]
#define ORT_SGD_ONE_MINUS_DAMPENING 1 // f[1], 1 - dampening rounded from double
#define ORT_SGD_LAMBDA 2              // f[2], weight decay (torch semantics)
#define ORT_SGD_NESTEROV 0            // flags[0]

struct OrtSgdOp {
    float* w;
    const float* g;
    float* buf;
    float lr;
    float inv_s;
    bool first;
    // current group
    float momentum;
    float omd;
    float lambda;
    bool nesterov;

    __device__ __forceinline__ void set_group(const OrtGroup& G) {
        momentum = G.f[ORT_SGD_MOMENTUM];
        omd = G.f[ORT_SGD_ONE_MINUS_DAMPENING];
        lambda = G.f[ORT_SGD_LAMBDA];
        nesterov = G.flags[ORT_SGD_NESTEROV] != 0;
    }

    // New weight; b is the momentum buffer (read unless first, written back by the caller).
    __device__ __forceinline__ float update(float wv, float gv, float& b) const {
        gv = gv * inv_s;
        if (lambda != 0.0f) gv = gv + lambda * wv;
        if (momentum != 0.0f) {
            b = first ? gv : momentum * b + omd * gv;
            gv = nesterov ? gv + momentum * b : b;
        }
        return wv - lr * gv;
    }

    __device__ __forceinline__ void apply1(ort_i64 i) {
        const bool has_buf = momentum != 0.0f;
        float b = (has_buf && !first) ? buf[i] : 0.0f;
        w[i] = update(w[i], g[i], b);
        if (has_buf) buf[i] = b;
    }

    __device__ __forceinline__ void apply4(ort_i64 i) {
        const bool has_buf = momentum != 0.0f;
        float4 W = *reinterpret_cast<const float4*>(w + i);
        const float4 G = *reinterpret_cast<const float4*>(g + i);
        float4 B = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        if (has_buf && !first) B = *reinterpret_cast<const float4*>(buf + i);
        W.x = update(W.x, G.x, B.x);
        W.y = update(W.y, G.y, B.y);
        W.z = update(W.z, G.z, B.z);
        W.w = update(W.w, G.w, B.w);
        *reinterpret_cast<float4*>(w + i) = W;
        if (has_buf) *reinterpret_cast<float4*>(buf + i) = B;
    }
};

// One SGD step over the whole flat buffer (n elements, ngroups groups).
// divisor_ptr: device double S (may be null, then divisor_value; NaN: skip); first: nonzero on
// the first step (the momentum buffer is then initialised to g and never read); counters,
// lr_table (may be null): the device counters and lr schedule of loss scaling (common.cuh), which
// then decide `first` and the lr.
extern "C" __global__ void __launch_bounds__(ORT_BLOCK)
ort_trainer_sgd_step_f32(float* w, const float* g, float* buf, const OrtGroup* groups, int ngroups,
                         ort_i64 n, double lr, const double* divisor_ptr, double divisor_value,
                         int first, const double* counters, const double* lr_table) {
    if (ort_skipped(divisor_ptr)) return;
    const ort_i64 t = ort_update_index(first != 0 ? 1 : 2, counters);
    OrtSgdOp op;
    op.w = w;
    op.g = g;
    op.buf = buf;
    op.lr = (float)ort_update_lr(lr, lr_table, t);
    op.inv_s = ort_inv_divisor(divisor_ptr, divisor_value);
    op.first = t == 1;
    op.momentum = 0.0f;
    op.omd = 1.0f;
    op.lambda = 0.0f;
    op.nesterov = false;
    ort_grid_foreach(op, groups, ngroups, n, ort_aligned16(w, g, buf));
}
