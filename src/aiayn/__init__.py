"""aiayn: the Transformer of "Attention Is All You Need" (Vaswani et al., 2017) on PyTorch."""

import os as _os

__version__ = "0.1.0"

#: Kernels oneDNN keeps compiled (its default: 1,024); see below.
ONEDNN_PRIMITIVE_CACHE_CAPACITY = 8192

# On the CPU, PyTorch's bf16 matrix products are oneDNN primitives, each compiled (JIT) for
# one shape and kept in a cache of 1,024. Length-bucketed training batches make ~4,400
# distinct products an epoch (the Multi30k recipe: 2048-token batches, 178 batch shapes),
# so with the default cache every step recompiled its kernels: 283 -> 186 ms a step with a
# larger one (tiny model, bf16, real batches, from the second epoch on), for ~0.6 GiB more
# memory. oneDNN reads the setting when it makes its first primitive, so it is set here, on
# import, unless the user set it (ONEDNN_ or the older DNNL_ name); a process that ran a
# bf16 product before importing aiayn keeps the default.
if not any(k in _os.environ for k in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY",
                                      "DNNL_PRIMITIVE_CACHE_CAPACITY")):
    _os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] = str(ONEDNN_PRIMITIVE_CACHE_CAPACITY)
