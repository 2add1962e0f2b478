// Loss-scaled training on the device, after each update's optimizer kernels, so that no update
// needs the host to know whether the gradients were finite (one thread, launched with one block):
//   finite = S is not NaN (clip.cu wrote NaN for non-finite gradients, and the step skipped);
//   counters[ORT_UPDATES_APPLIED] += finite;  counters[ORT_LAST_FINITE] = finite;
//   automatic (DynamicLossScaler.automatic_update): finite: stable += 1, and at up_scale_window
//   the scale doubles (at most max_scale) and stable = 0; not finite: the scale halves (at
//   least min_scale) and stable = 0. The fp32 graph input `graph_scale` gets the new scale.
// Oracle: ort_trainer.amp.DynamicLossScaler.update and ORTTrainer's host-side update.
#include "common.cuh"

extern "C" __global__ void
ort_trainer_amp_update(const double* divisor_ptr, double* counters, float* graph_scale,
                       ort_i64 up_scale_window, double min_scale, double max_scale, int automatic) {
    if (blockIdx.x != 0 || threadIdx.x != 0) return;
    const bool finite = !ort_skipped(divisor_ptr);
    double scale = counters[ORT_LOSS_SCALE];
    double stable = counters[ORT_STABLE_STEPS];
    if (finite) counters[ORT_UPDATES_APPLIED] += 1.0;
    counters[ORT_LAST_FINITE] = finite ? 1.0 : 0.0;
    if (automatic != 0) {
        if (finite) {
            stable += 1.0;
            if (stable >= (double)up_scale_window) {
                scale = 2.0 * scale < max_scale ? 2.0 * scale : max_scale;
                stable = 0.0;
            }
        } else {
            scale = scale / 2.0 > min_scale ? scale / 2.0 : min_scale;
            stable = 0.0;
        }
    }
    counters[ORT_STABLE_STEPS] = stable;
    counters[ORT_LOSS_SCALE] = scale;
    *graph_scale = (float)scale;
}
