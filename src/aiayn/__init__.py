"""aiayn: the Transformer of "Attention Is All You Need" (Vaswani et al., 2017) on PyTorch.

The packages, in the order data flows through them (each imports only those above it):

    config, files     settings and presets; checked file I/O
    model             the architecture of section 3, and nothing else
    scoring           BLEU (and the paper's conventions)
    speed             the one seam: the speed paths the paper's code may ask for by name
    data              download, tokenizer, prepare, batching (section 5.1)
    checkpoints       the checkpoint file, run directories, averaging
    decoding          beam search, ensembles, translating files (section 6.1)
    training          the loop of section 5 and its guards
    fast              speed paths, above the paper's code; importing it registers them
                      with `speed` (the layers below run without it)
    experiments       recipes, benchmarks, curves        } these build runs, and turn
    analysis          Table 1, the attention figures     } the speed paths on by
    deploy            exports to other engines           } importing `fast`
    cli               the `aiayn` command

Importing aiayn changes nothing global: process settings (allocator, oneDNN's kernel
cache) are applied by the `aiayn` command's entry point.
"""

__version__ = "0.1.0"

#: The public Python API (docs/api.md), imported on first use: `import aiayn` stays light.
_API = ("Parser", "PairScore", "TrainResult", "Translation", "Translator", "train")
__all__ = ["__version__", *_API]


def __getattr__(name: str) -> object:
    if name in _API:
        from aiayn import api

        return getattr(api, name)
    raise AttributeError(f"module 'aiayn' has no attribute {name!r}")
