"""Baseline for the GPU benchmark: the same job as `ailhd rebuild` (default setup) written with
torchaudio on the GPU, as the upstream Python pipeline does: read each 16-bit WAV with numpy, cut
the two-stage windows, torchaudio.transforms.MelSpectrogram(center=False) in float32 on the GPU
(power 1, HTK, no norm), 20*log10(max(x, 1e-10)), float16, one HDF5 file. Prints files/s for the
features alone and end to end (read + features + HDF5 write).

usage: torchaudio_baseline.py TREE OUT.h5 [BATCH]
"""
import os
import sys
import time

import h5py
import numpy as np
import torch
import torchaudio

SR, N, LW, LH, SW, SH, NFFT, HOP, NMELS = 4096, 40960, 1024, 1024, 512, 512, 512, 128, 64


def main():
    tree, out = sys.argv[1], sys.argv[2]
    batch = int(sys.argv[3]) if len(sys.argv) > 3 else 4096
    dev = torch.device("cuda")
    mel = torchaudio.transforms.MelSpectrogram(
        sample_rate=SR, n_fft=NFFT, hop_length=HOP, n_mels=NMELS, power=1.0, center=False,
        norm=None, mel_scale="htk", f_min=0.0, f_max=SR / 2).to(dev)
    # Warm-up (CUDA context, cuFFT plans) outside the timings, as ailhd's warm pipeline.
    mel(torch.zeros(8, SW, device=dev)); torch.cuda.synchronize()
    t0 = time.perf_counter()
    paths = sorted(os.path.join(d, f) for d, _, fs in os.walk(tree) for f in fs if f.lower().endswith(".wav"))
    nl, ns = 1 + (N - LW) // LH, 1 + (LW - SW) // SH
    tf = 1 + (SW - NFFT) // HOP
    feat_s = 0.0
    with h5py.File(out, "w") as f:
        ds = f.create_dataset("segments_mel", shape=(0, nl, ns, NMELS, tf), maxshape=(None, nl, ns, NMELS, tf),
                              dtype="f2", chunks=(64, nl, ns, NMELS, tf))
        for b0 in range(0, len(paths), batch):
            xs = np.zeros((min(batch, len(paths) - b0), N), dtype=np.int16)
            for j, p in enumerate(paths[b0:b0 + batch]):
                raw = np.fromfile(p, dtype="<i2", offset=44)[:N]
                xs[j, :len(raw)] = raw
            t1 = time.perf_counter()
            x = torch.from_numpy(xs).to(dev, non_blocking=True).float() / 32768.0
            w = x.unfold(1, LW, LH).unfold(2, SW, SH)  # [B, nl, ns, SW]
            m = mel(w.reshape(-1, SW))  # [B*nl*ns, n_mels, tf]
            db = 20.0 * torch.log10(torch.clamp(m, min=1e-10))
            rows = db.reshape(-1, nl, ns, NMELS, tf).half().cpu().numpy()
            feat_s += time.perf_counter() - t1
            n0 = ds.shape[0]
            ds.resize(n0 + len(rows), axis=0)
            ds[n0:] = rows
    total = time.perf_counter() - t0
    n = len(paths)
    print(f"torchaudio: {n} files, features {feat_s:.2f} s ({n / feat_s:.0f} files/s), "
          f"end to end {total:.2f} s ({n / total:.0f} files/s), GPU memory peak "
          f"{torch.cuda.max_memory_allocated() / 2**20:.0f} MiB")


if __name__ == "__main__":
    main()
