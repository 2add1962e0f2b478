// The CUDA C++ subset of kernels/*.cu, on the CPU: a test bench for the kernels where no GPU is.
//
// fake_cupy.py compiles a kernel file with this header in front (g++, x86-64) and launches its
// `extern "C"` kernels through generated wrappers. Blocks run one after another; the threads of a
// block are fibers of one OS thread, switched only at barriers (__syncthreads, and the two warp
// barriers of every __shfl_down_sync), so a block's threads interleave at exactly the points
// CUDA lets them. What the emulation refuses (reported as an error of the launch): a barrier
// some threads never reach (deadlock, or exit), a partial shuffle mask, blockDim not a multiple
// of 32.
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include <functional>
#include <vector>

struct dim3 {
    unsigned x = 1, y = 1, z = 1;
};
struct alignas(16) float4 {
    float x, y, z, w;
};
inline float4 make_float4(float x, float y, float z, float w) { return float4{x, y, z, w}; }

dim3 threadIdx, blockIdx, blockDim, gridDim;

#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__ static  // blocks run one at a time: one copy per block, shared by its threads

extern "C" void ortemu_switch(void** save_sp, void* load_sp);
asm(R"(
    .text
    .globl ortemu_switch
    .type ortemu_switch, @function
ortemu_switch:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
    .size ortemu_switch, .-ortemu_switch
)");

namespace ortemu {

constexpr size_t kStackBytes = 64 * 1024;

struct Fiber {
    void* sp = nullptr;
    bool done = false;
    const unsigned long* wait_on = nullptr;  // a barrier generation this fiber waits to change
    unsigned long wait_gen = 0;
};

struct Barrier {
    unsigned long generation = 0;
    unsigned arrived = 0;
};

static std::vector<Fiber> fibers;
static std::vector<char> stacks;
static void* scheduler_sp = nullptr;
static unsigned current = 0;
static unsigned live = 0;
static const std::function<void()>* body = nullptr;
static Barrier block_barrier;
static std::vector<Barrier> warp_barriers;
static std::vector<uint64_t> lanes;  // one shuffle slot per thread
static char error[512];

static void fail(const char* message) {
    if (error[0] == 0) snprintf(error, sizeof(error), "%s", message);
}

static void yield_to_scheduler() { ortemu_switch(&fibers[current].sp, scheduler_sp); }

// The caller arrives at `barrier`, which `expected` threads must reach; the last one releases it.
static void arrive_and_wait(Barrier& barrier, unsigned expected) {
    const unsigned long generation = barrier.generation;
    if (++barrier.arrived >= expected) {
        barrier.arrived = 0;
        ++barrier.generation;
        return;
    }
    fibers[current].wait_on = &barrier.generation;
    fibers[current].wait_gen = generation;
    yield_to_scheduler();
}

static void fiber_main() {
    (*body)();
    fibers[current].done = true;
    --live;
    if (block_barrier.arrived > 0)
        fail("divergent __syncthreads: a thread exited while others wait at a barrier (deadlock or worse on a GPU)");
    yield_to_scheduler();
    __builtin_trap();  // a finished fiber is never resumed
}

static void* initial_stack(unsigned t) {
    // ortemu_switch pops six registers, then returns into fiber_main with the stack aligned as
    // after a call (rsp = 8 mod 16).
    char* top = stacks.data() + (size_t)(t + 1) * kStackBytes;
    top = (char*)((uintptr_t)top & ~(uintptr_t)15);
    void** sp = (void**)top;
    *--sp = nullptr;                    // fiber_main's return address, never used
    *--sp = (void*)&fiber_main;         // where ortemu_switch returns to
    for (int k = 0; k < 6; ++k) *--sp = nullptr;  // r15 r14 r13 r12 rbx rbp
    return sp;
}

// Runs one block: every thread as a fiber, round robin, each until it finishes or waits at a
// barrier that has not been released yet. Returns false on an error (deadlock, divergence).
static bool run_block(unsigned nthreads) {
    fibers.assign(nthreads, Fiber{});
    for (unsigned t = 0; t < nthreads; ++t) fibers[t].sp = initial_stack(t);
    live = nthreads;
    block_barrier = Barrier{};
    for (Barrier& b : warp_barriers) b = Barrier{};
    while (live > 0) {
        bool progress = false;
        for (unsigned t = 0; t < nthreads; ++t) {
            Fiber& f = fibers[t];
            if (f.done) continue;
            if (f.wait_on != nullptr) {
                if (*f.wait_on == f.wait_gen) continue;
                f.wait_on = nullptr;
            }
            current = t;
            threadIdx.x = t;
            ortemu_switch(&scheduler_sp, f.sp);
            progress = true;
            if (error[0] != 0) return false;
        }
        if (!progress) {
            fail("deadlock: threads of a block wait at a barrier that the others never reach");
            return false;
        }
    }
    return true;
}

}  // namespace ortemu

inline void __syncthreads() { ortemu::arrive_and_wait(ortemu::block_barrier, ortemu::live); }

template <class T>
inline T __shfl_down_sync(unsigned mask, T value, int delta) {
    static_assert(sizeof(T) <= 8, "shuffled values are at most 8 bytes");
    if (mask != 0xffffffffu) ortemu::fail("__shfl_down_sync with a partial mask is not emulated");
    const unsigned t = threadIdx.x, lane = t & 31, warp = t >> 5;
    memcpy(&ortemu::lanes[t], &value, sizeof(T));
    ortemu::arrive_and_wait(ortemu::warp_barriers[warp], 32);  // every lane has written
    T result = value;
    if (lane + delta < 32) memcpy(&result, &ortemu::lanes[t + delta], sizeof(T));
    ortemu::arrive_and_wait(ortemu::warp_barriers[warp], 32);  // every lane has read
    return result;
}

// Launches `kernel` (a call of the kernel with its arguments bound) on a grid of `grid` blocks
// of `block` threads. Returns nullptr, or the error.
static const char* ortemu_launch(unsigned grid, unsigned block, const std::function<void()>& kernel) {
    using namespace ortemu;
    error[0] = 0;
    if (block == 0 || block % 32 != 0 || block > 1024) {
        fail("blockDim.x must be a multiple of 32 in [32, 1024] (warps are emulated whole)");
        return error;
    }
    if (stacks.size() < (size_t)block * kStackBytes) stacks.resize((size_t)block * kStackBytes);
    warp_barriers.assign(block / 32, Barrier{});
    lanes.assign(block, 0);
    body = &kernel;
    blockDim = dim3{block, 1, 1};
    gridDim = dim3{grid, 1, 1};
    for (unsigned b = 0; b < grid && error[0] == 0; ++b) {
        blockIdx.x = b;
        if (!run_block(block)) break;
    }
    return error[0] ? error : nullptr;
}
