"""The kernels from Python: the lazily built C++/CUDA extension and its ``syncbn::`` operators
(:mod:`.build`, :mod:`.fakes`), the choice between it and the pure-PyTorch twin (:mod:`.dispatch`,
:mod:`.reference`), and the one registry of fused activations (:mod:`.activations`).

Imports torch only; nothing here communicates (that is :mod:`syncbn_lightning.distributed`).
"""
