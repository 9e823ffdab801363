"""hvdkit's Horovod build helper: ``hvdkit build-horovod`` or ``python -m hvdkit.horovod_build``.

Detects the installed frameworks, compiler, CMake, MPI, CUDA and NCCL, applies only the
remedies this machine needs, and caches the wheel outside the checkout.
"""
