"""SIMT emulation of the CUDA kernels on the CPU (see build.py and the README)."""
