"""What `aiayn serve` decodes with: the server's limits and a request's options, and the
engines behind one protocol (`Backend`): aiayn's own model, or the same model exported to
CTranslate2 for the load benchmark."""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Protocol

from aiayn.config import DecodeConfig
from aiayn.decoding.sampling import SamplingOptions
from aiayn.decoding.translate import Decoder, Translation, _input_limit, translate_nbest

logger = logging.getLogger(__name__)


# ------------------------------------------------------------------------- settings
@dataclass(frozen=True)
class ServerLimits:
    """What one server accepts; beyond each limit a request gets a 4xx or 503, never a crash.

    max_input_tokens: 0 means the model's own limit (decode.max_input_len, and the
    position table); the CLI truncates longer lines, the server refuses them (413).
    """

    max_batch_tokens: int = 4000  # source subwords decoded together
    batch_wait_ms: float = 5.0  # under load, how long a batch's first request waits for company
    max_queue: int = 256  # sentences waiting or decoding; more -> 503 + Retry-After
    max_texts: int = 64  # texts in one request
    max_input_tokens: int = 0  # subwords in one text (0: the model's limit)
    max_body_bytes: int = 1 << 20  # request body
    max_beam: int = 16
    retry_after_s: int = 1

    def validate(self) -> None:
        for name in ("max_batch_tokens", "max_queue", "max_texts", "max_body_bytes", "max_beam"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.batch_wait_ms < 0 or self.max_input_tokens < 0 or self.retry_after_s < 0:
            raise ValueError("batch_wait_ms, max_input_tokens and retry_after_s must be >= 0")


#: The request fields that only sampling takes.
SAMPLING_FIELDS = ("temperature", "top_k", "top_p", "seed")


@dataclass(frozen=True)
class Options:
    """The decoding options a request may choose; requests batch only with equal options."""

    beam: int
    alpha: float
    nbest: int  # outputs per text: the n best, or with `sampling` the samples
    sampling: SamplingOptions | None = None  # draw instead of searching


# ------------------------------------------------------------------------- engines
#: `decode.max_tokens` that keeps any batch the batcher made in one decoding batch.
ONE_BATCH = 1 << 62


class Backend(Protocol):
    """What decodes: texts in, each text's n best translations out (best first)."""

    name: str
    input_limit: int  # longest source in subwords

    def count_tokens(self, text: str) -> int: ...

    def translate(
        self, texts: list[str], options: Options, line_numbers: list[int] | None = None
    ) -> list[list[Translation]]: ...


class AiaynBackend:
    """aiayn's own decoder: `translate_nbest`, exactly as `aiayn translate` runs it."""

    def __init__(
        self,
        model: Decoder,
        tokenizer: Any,
        decode: DecodeConfig,
        device: str = "cpu",
        name: str = "aiayn",
    ) -> None:
        self.model, self.tokenizer, self.decode, self.device = model, tokenizer, decode, device
        self.name = name
        self.input_limit = _input_limit(model, decode)

    def count_tokens(self, text: str) -> int:
        return len(self.tokenizer.encode(text))

    def translate(
        self, texts: list[str], options: Options, line_numbers: list[int] | None = None
    ) -> list[list[Translation]]:
        # the batcher sized the batch: one decoding batch for all of it, whatever its padding
        cfg = replace(
            self.decode,
            beam=options.beam,
            alpha=options.alpha,
            nbest=1 if options.sampling is not None else options.nbest,
            max_tokens=ONE_BATCH,
        )
        # with sampling, each text is seeded by its index in its own request (the batcher
        # joins requests with equal options): a request samples alike however it is batched
        results, _ = translate_nbest(
            self.model,
            self.tokenizer,
            texts,
            cfg,
            self.device,
            sampling=options.sampling,
            line_numbers=line_numbers,
        )
        return results


class CTranslate2Backend:
    """A model exported by `aiayn export --to ctranslate2`, decoded by CTranslate2's
    `Translator.translate_batch` as its users call it (one call per batch, the batch's
    longest length cap): the engine the load benchmark compares aiayn with.

    CTranslate2's length penalty is score / length**alpha, not GNMT's: beam outputs can
    differ from aiayn's (docs/deploy.md gives the agreement); greedy ones are equal.
    """

    def __init__(
        self,
        model_dir: str | Path,
        compute_type: str = "float32",
        inter_threads: int = 1,
        intra_threads: int = 0,
    ) -> None:
        import ctranslate2
        import sentencepiece as spm

        from aiayn.deploy.export import read_export_info, target_sentencepiece

        info = read_export_info(model_dir)
        known = {f.name for f in dataclasses.fields(DecodeConfig)}
        self.decode = DecodeConfig(**{k: v for k, v in info["decode"].items() if k in known})
        self.sp = spm.SentencePieceProcessor(
            model_file=str(Path(model_dir) / info["sentencepiece"])
        )
        self.sp_out = target_sentencepiece(model_dir, info) or self.sp  # separate vocabularies
        self.translator = ctranslate2.Translator(
            str(model_dir),
            device="cpu",
            compute_type=compute_type,
            inter_threads=inter_threads,
            intra_threads=intra_threads,
        )
        self.name = f"ctranslate2-{compute_type}"
        self.input_limit = min(self.decode.max_input_len, info["max_positions"] - 1)

    def count_tokens(self, text: str) -> int:
        return len(self.sp.encode(text))

    def translate(
        self, texts: list[str], options: Options, line_numbers: list[int] | None = None
    ) -> list[list[Translation]]:
        from aiayn.deploy.export import length_caps

        if options.sampling is not None:
            raise ValueError("the CTranslate2 backend does beam search only, not sampling")

        sources = [self.sp.encode(t, out_type=str) for t in texts]  # the model adds </s>
        d = self.decode
        caps = length_caps([len(s) for s in sources], d.max_len_a, d.max_len_b, None)
        results = self.translator.translate_batch(
            sources,
            beam_size=options.beam,
            num_hypotheses=options.nbest,
            length_penalty=options.alpha,
            max_decoding_length=max(caps),
            min_decoding_length=0,
            return_scores=True,
        )
        # one call for the batch, as CTranslate2's users make it; each output cut to its
        # sentence's own cap (for greedy search, exactly aiayn's output)
        return [
            [
                Translation(str(self.sp_out.decode(tokens[:cap])), float(score))
                for tokens, score in zip(r.hypotheses, r.scores, strict=True)
            ]
            for r, cap in zip(results, caps, strict=True)
        ]
