// GPU featuriser kernels: int16/float samples -> windowed frames -> (cuFFT R2C or D2Z, on the host side)
// -> |X|^power -> sparse mel -> dB -> per-recording top_db clamp -> float16 rows laid out
// [file][long][short][mel][t] (docs/design.md, "What a row is"). src/features/cuda/ embeds this file and
// compiles it with NVRTC once at start-up for the device's architecture.
//
// Frames and the FFT are float32 or float64 as the accuracy rule needs (src/features/mod.rs,
// `Precision`); everything after |X|^2 is float32; half precision appears only in the final
// store (the rule forbids float16/bfloat16 math). Every kernel but finalize_rows uses grid-stride loops, so any
// grid size is correct; finalize_rows needs exactly FINALIZE_THREADS threads per block.
//
// tests/gpu_parity.rs compiles this same file with g++ (AILHD_HOST_EMULATION defined, CUDA built-ins
// emulated) to check the index arithmetic against the reference fixtures on hosts without a GPU:
// keep the file free of CUDA headers and of device-only features outside the #ifndef below.

#ifndef AILHD_HOST_EMULATION
#define AILHD_DEVICE static __device__ __forceinline__

// Round-to-nearest-even float32 -> float16 bits: the same PTX instruction cuda_fp16.h's
// __float2half_rn emits. Inline PTX instead of the header because NVRTC does not always ship
// cuda_fp16.h, and a missing header would only show up on the GPU host.
AILHD_DEVICE unsigned short f32_to_f16_rn(float x) {
    unsigned short h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(x));
    return h;
}
#endif

typedef unsigned long long u64;

// Shapes and constants of one feature setup. Must match `Geometry` in src/features/cuda/tables.rs field
// for field (a unit test there compares the two). All fields are 4 bytes: no padding.
struct Geometry {
    int num_samples;      // samples per recording after pad/trim
    int num_long;
    int num_short;
    int t_frames;
    int long_hop;
    int short_hop;
    int hop_length;
    int n_fft;
    int n_freqs;          // n_fft / 2 + 1 (cuFFT R2C output per frame)
    int n_mels;
    int frames_per_file;  // num_long * num_short * t_frames
    int row_len;          // num_long * num_short * n_mels * t_frames
    float power;          // |X|^power
    float db_multiplier;  // 10 when power == 2, else 20
    float db_floor;       // AmplitudeToDB's amin (1e-10): max(x, db_floor) before the logarithm
    float top_db;         // used when use_top_db != 0
    int use_top_db;       // amplitude_to_db with top_db set: clamp at (row max) - top_db
};

// Threads per block of finalize_rows (its shared-memory reduction is sized by it).
#define FINALIZE_THREADS 256

// Start of frame `frame` (global index over the batch) in the batch's sample buffer.
// frame = ((file * num_long + l) * num_short + s) * t_frames + t.
AILHD_DEVICE u64 frame_start(const Geometry& g, u64 frame) {
    const u64 t = frame % (u64)g.t_frames;
    u64 rest = frame / (u64)g.t_frames;
    const u64 s = rest % (u64)g.num_short;
    rest /= (u64)g.num_short;
    const u64 l = rest % (u64)g.num_long;
    const u64 file = rest / (u64)g.num_long;
    return file * (u64)g.num_samples + l * (u64)g.long_hop + s * (u64)g.short_hop +
           t * (u64)g.hop_length;
}

// Kernel 1: frames[frame][i] = sample[start + i] * window[i], in the FFT's precision `Real`
// (float for R2C, double for D2Z: see "Precision" in src/features/mod.rs). int16 samples are
// scaled by 2^-15, exactly, so both input paths give the same frames for the same recording.
AILHD_DEVICE float sample_value(short s) { return (float)s * (1.0f / 32768.0f); }
AILHD_DEVICE float sample_value(float s) { return s; }

template <typename Sample, typename Real>
AILHD_DEVICE void frame_impl(const Geometry& g, const Sample* __restrict__ samples,
                             const Real* __restrict__ window, Real* __restrict__ frames,
                             int n_files) {
    const u64 total = (u64)n_files * (u64)g.frames_per_file * (u64)g.n_fft;
    const u64 stride = (u64)gridDim.x * blockDim.x;
    for (u64 idx = (u64)blockIdx.x * blockDim.x + threadIdx.x; idx < total; idx += stride) {
        const u64 i = idx % (u64)g.n_fft;
        const u64 frame = idx / (u64)g.n_fft;
        const float x = sample_value(samples[frame_start(g, frame) + i]);
        frames[idx] = (Real)x * window[i];
    }
}

// Kernel 2: one thread per (frame, mel). spectrum is cuFFT's R2C (float2) or D2Z (double2)
// output, interleaved re/im, n_freqs bins per frame. |X|^2 is formed in the FFT's precision and
// rounded once to float; everything after it is float, as on the CPU. The filterbank is CSR:
// filter m covers bins mel_start[m] .. mel_start[m] + (mel_offset[m+1] - mel_offset[m]) with
// weights mel_weights[mel_offset[m] ..]. Each bin's power is recomputed by the (at most two)
// filters that cover it: cheaper than a pass through global memory, and the same value both times.
template <typename Real>
AILHD_DEVICE void power_mel_db_impl(const Geometry& g, const Real* __restrict__ spectrum,
                                    const int* __restrict__ mel_start,
                                    const int* __restrict__ mel_offset,
                                    const float* __restrict__ mel_weights,
                                    float* __restrict__ mel_db, int n_files) {
    const u64 total = (u64)n_files * (u64)g.frames_per_file * (u64)g.n_mels;
    const u64 stride = (u64)gridDim.x * blockDim.x;
    for (u64 idx = (u64)blockIdx.x * blockDim.x + threadIdx.x; idx < total; idx += stride) {
        const u64 mel = idx % (u64)g.n_mels;
        const u64 frame = idx / (u64)g.n_mels;
        const Real* bins = spectrum + 2 * frame * (u64)g.n_freqs + 2 * (u64)mel_start[mel];
        const int k0 = mel_offset[mel];
        const int k1 = mel_offset[mel + 1];
        float acc = 0.0f;
        for (int k = k0; k < k1; ++k) {
            const Real re = bins[2 * (k - k0)];
            const Real im = bins[2 * (k - k0) + 1];
            const float p2 = (float)(re * re + im * im);
            float p;
            if (g.power == 2.0f) {
                p = p2;
            } else if (g.power == 1.0f) {
                p = sqrtf(p2);
            } else {
                p = powf(p2, 0.5f * g.power);
            }
            acc += mel_weights[k] * p;
        }
        // A select, not fmaxf, so that NaN (from a NaN sample) stays NaN as on the CPU.
        const float db = g.db_multiplier * log10f(acc < g.db_floor ? g.db_floor : acc);
        const u64 t = frame % (u64)g.t_frames;
        const u64 window_idx = frame / (u64)g.t_frames;  // file * num_long * num_short + l * num_short + s
        mel_db[(window_idx * (u64)g.n_mels + mel) * (u64)g.t_frames + t] = db;
    }
}

// The entry points, one per (input, precision): extern "C" names for the driver.
#define AILHD_FRAME_KERNEL(name, Sample, Real)                                                   \
    extern "C" __global__ void name(const Geometry g, const Sample* __restrict__ samples,        \
                                    const Real* __restrict__ window, Real* __restrict__ frames,  \
                                    int n_files) {                                               \
        frame_impl<Sample, Real>(g, samples, window, frames, n_files);                           \
    }
AILHD_FRAME_KERNEL(frame_pcm16_f32, short, float)
AILHD_FRAME_KERNEL(frame_f32_f32, float, float)
AILHD_FRAME_KERNEL(frame_pcm16_f64, short, double)
AILHD_FRAME_KERNEL(frame_f32_f64, float, double)

#define AILHD_MEL_KERNEL(name, Real)                                                             \
    extern "C" __global__ void name(const Geometry g, const Real* __restrict__ spectrum,         \
                                    const int* __restrict__ mel_start,                           \
                                    const int* __restrict__ mel_offset,                          \
                                    const float* __restrict__ mel_weights,                       \
                                    float* __restrict__ mel_db, int n_files) {                   \
        power_mel_db_impl<Real>(g, spectrum, mel_start, mel_offset, mel_weights, mel_db,         \
                                n_files);                                                        \
    }
AILHD_MEL_KERNEL(power_mel_db_f32, float)
AILHD_MEL_KERNEL(power_mel_db_f64, double)

// Kernel 3: one block per recording (grid-stride over recordings). With use_top_db, clamp from
// below at the recording's maximum - top_db (per recording, never per batch: a row must not depend
// on its batch). Then store float16. The maximum (fmaxf skips NaN, like the CPU's f32::max) is
// exact whatever the reduction order, so rows are deterministic.
extern "C" __global__ void finalize_rows(const Geometry g, const float* __restrict__ mel_db,
                                         unsigned short* __restrict__ rows, int n_files) {
    __shared__ float partial[FINALIZE_THREADS];
    for (u64 file = blockIdx.x; file < (u64)n_files; file += gridDim.x) {
        const float* row = mel_db + file * (u64)g.row_len;
        unsigned short* out = rows + file * (u64)g.row_len;
        float floor_db = -3.402823466e+38f;  // no clamp: below every finite value
        if (g.use_top_db) {
            float m = -3.402823466e+38f;
            for (int j = threadIdx.x; j < g.row_len; j += FINALIZE_THREADS) {
                m = fmaxf(m, row[j]);
            }
            partial[threadIdx.x] = m;
            __syncthreads();
            for (int half = FINALIZE_THREADS / 2; half > 0; half /= 2) {
                if ((int)threadIdx.x < half) {
                    partial[threadIdx.x] = fmaxf(partial[threadIdx.x], partial[threadIdx.x + half]);
                }
                __syncthreads();
            }
            floor_db = partial[0] - g.top_db;
            // Everyone must have read partial[0] before the next recording overwrites it.
            __syncthreads();
        }
        for (int j = threadIdx.x; j < g.row_len; j += FINALIZE_THREADS) {
            const float v = row[j];
            out[j] = f32_to_f16_rn(v < floor_db ? floor_db : v);  // NaN stays NaN
        }
    }
}
