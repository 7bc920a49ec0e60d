"""The CUDA kernels: one .cu per op family, fast and exact versions side by side (each file's header
lists them); .cuh device functions they share. Installed as the package kestrel_tui.kernels (setup.py
maps it), read by backends/cuda/runtime.py."""
