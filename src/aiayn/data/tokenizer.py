"""The shared subword vocabulary (section 5.1): byte-pair encoding over both languages.

The paper encodes WMT14 En-De with BPE and "a shared source-target vocabulary of about
37000 tokens"; a shared vocabulary is what lets section 3.4 tie the source embedding, the
target embedding and the pre-softmax projection into one matrix. We use sentencepiece's BPE
trainer on raw text (no pre-tokenisation), with the special ids fixed by config.py.

`prepare --vocab separate` learns one model per language instead (`PairTokenizer`), for
pairs in different scripts; then nothing ties the source embedding to the target's.

Training is deterministic: every sentence is used (no sampling, no shuffling), one thread,
and the model is written from memory, so the file records no temporary path. Training twice
on the same text gives byte-identical models, whose sha256 identifies the vocabulary in
manifests and checkpoints.
"""

from __future__ import annotations

import hashlib
import io
import logging
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import sentencepiece as spm

from aiayn.config import BOS_ID, EOS_ID, PAD_ID, UNK_ID
from aiayn.files import InputError, atomic_write, read_lines

logger = logging.getLogger(__name__)

_SPECIALS = {"pad_id": PAD_ID, "unk_id": UNK_ID, "bos_id": BOS_ID, "eos_id": EOS_ID}
_SKIP_ON_DECODE = frozenset({PAD_ID, BOS_ID, EOS_ID})


class Tokenizer:
    """A trained sentencepiece BPE model with aiayn's special ids (pad 0, unk 1, bos 2, eos 3).

    Build one with :meth:`train`, :meth:`load` or :meth:`from_bytes`; the serialized model
    (:meth:`to_bytes`) is the whole vocabulary, so checkpoints can carry it.
    """

    def __init__(self, model_bytes: bytes, *, origin: str = "<bytes>") -> None:
        """Wrap serialized model bytes; `origin` names them in error messages."""
        sp = spm.SentencePieceProcessor()
        try:
            sp.LoadFromSerializedProto(model_bytes)
        except (RuntimeError, OSError, TypeError) as e:
            raise InputError(f"{origin}: not a sentencepiece model ({e})") from None
        # A model trained elsewhere (sentencepiece's defaults are unk 0, bos 1, eos 2, no pad)
        # would shift every id the model embeds; refuse it instead of translating garbage.
        found = {
            "pad_id": sp.pad_id(),
            "unk_id": sp.unk_id(),
            "bos_id": sp.bos_id(),
            "eos_id": sp.eos_id(),
        }
        if found != _SPECIALS:
            raise InputError(f"{origin}: special ids {found} differ from aiayn's {_SPECIALS}")
        self._sp = sp
        self._bytes = bytes(model_bytes)
        self._sha256 = hashlib.sha256(self._bytes).hexdigest()

    # -- construction ---------------------------------------------------------------------

    @classmethod
    def train(
        cls,
        files: list[Path],
        vocab_size: int,
        out_path: Path | None,
        *,
        seed: int = 1,
        num_threads: int = 1,
        lowercase: bool = False,
        split_by_script: bool = True,
    ) -> Tokenizer:
        """Learn one BPE vocabulary from the lines of all `files` (plain or .gz).

        Lines are read with files.read_lines (split on b"\\n" only, strict UTF-8), so what
        the trainer sees is what data.py encodes.

        Args:
            files: text files, e.g. the source and the target side of the training set.
            vocab_size: total size including the four special pieces.
            out_path: where to write the model atomically; None keeps it in memory only.
            seed: seeds sentencepiece's generator (unused while all sentences are taken,
                set anyway so that no future default can make training random).
            num_threads: trainer threads; stored in the model, so keep it fixed for
                byte-identical results.
            lowercase: the model lowercases whatever it encodes (sentencepiece's
                nmt_nfkc_cf rule, stored in the model), so that a model trained on
                lowercased text lowercases its input at translation time too.
            split_by_script: sentencepiece's rule that a piece never spans two Unicode
                scripts (on by default). Off, a bracket and a letter can merge: parsing
                needs it, so that each token of a linearized tree, such as "(NP" or ")VP",
                becomes one piece instead of two.

        Returns:
            The trained tokenizer.
        """

        def sentences() -> Iterator[str]:
            for path in files:
                yield from read_lines(path)

        return cls.train_from_sentences(
            sentences(),
            vocab_size,
            out_path,
            seed=seed,
            num_threads=num_threads,
            lowercase=lowercase,
            split_by_script=split_by_script,
        )

    @classmethod
    def train_from_sentences(
        cls,
        sentences: Iterable[str],
        vocab_size: int,
        out_path: Path | None,
        *,
        seed: int = 1,
        num_threads: int = 1,
        lowercase: bool = False,
        split_by_script: bool = True,
        model_type: str = "bpe",
    ) -> Tokenizer:
        """Like :meth:`train`, from sentences in memory (data.py passes its cleaned pairs).

        `model_type` "unigram" learns sentencepiece's unigram language model instead of
        BPE: the closest sentencepiece has to the word-piece vocabulary of the paper's
        En-Fr model (section 5.1).
        """
        if vocab_size <= len(_SPECIALS):
            raise ValueError(f"vocab_size must be > {len(_SPECIALS)}, got {vocab_size}")
        if model_type not in ("bpe", "unigram"):
            raise ValueError(f"model_type must be 'bpe' or 'unigram', got {model_type!r}")
        writer = io.BytesIO()
        # only when asked, so that the default model's bytes (and hash) stay as they were
        case_rule: dict[str, Any] = {"normalization_rule_name": "nmt_nfkc_cf"} if lowercase else {}
        if not split_by_script:
            case_rule["split_by_unicode_script"] = False
        spm.set_random_generator_seed(seed)
        try:
            spm.SentencePieceTrainer.train(
                sentence_iterator=iter(sentences),
                model_writer=writer,
                model_type=model_type,
                vocab_size=vocab_size,
                character_coverage=1.0,
                # input_sentence_size=0 takes every sentence, so nothing is sampled and
                # the shuffle never runs: the model depends on the text alone.
                input_sentence_size=0,
                shuffle_input_sentence=False,
                num_threads=num_threads,
                minloglevel=2,
                **case_rule,
                pad_id=PAD_ID,
                unk_id=UNK_ID,
                bos_id=BOS_ID,
                eos_id=EOS_ID,
            )
        except RuntimeError as e:
            raise InputError(f"sentencepiece training failed: {e}") from None
        tok = cls(writer.getvalue(), origin="trained model")
        if out_path is not None:
            tok.save(out_path)
        logger.info(
            "trained %s vocabulary of %d pieces (sha256 %s)",
            "BPE" if model_type == "bpe" else model_type,
            tok.vocab_size,
            tok.sha256[:12],
        )
        return tok

    @classmethod
    def load(cls, path: str | Path) -> Tokenizer:
        """Read a model file written by :meth:`save` (or by sentencepiece, if its ids match)."""
        path = Path(path)
        if not path.is_file():
            raise InputError(f"{path}: no such sentencepiece model")
        return cls(path.read_bytes(), origin=str(path))

    @classmethod
    def from_bytes(cls, b: bytes) -> Tokenizer:
        """Rebuild a tokenizer from :meth:`to_bytes` output (e.g. stored in a checkpoint)."""
        return cls(b)

    def to_bytes(self) -> bytes:
        """The serialized model proto: the complete vocabulary and normaliser."""
        return self._bytes

    def save(self, path: str | Path) -> None:
        """Write the model atomically, so a killed process never leaves half a model."""
        with atomic_write(path) as f:
            f.write(self._bytes)

    # -- properties -----------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return int(self._sp.get_piece_size())

    @property
    def sha256(self) -> str:
        """Hex sha256 of :meth:`to_bytes`: the identity of this vocabulary."""
        return self._sha256

    # -- text <-> ids ---------------------------------------------------------------------

    def encode(self, text: str) -> list[int]:
        """Subword ids of `text`, without BOS or EOS (batching adds those)."""
        return list(self._sp.encode(text))

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """:meth:`encode` for many lines at once (sentencepiece's C++ loop, much faster)."""
        return [list(ids) for ids in self._sp.encode(texts)]

    def encode_pieces(self, text: str) -> list[str]:
        """The subword strings of `text` ("▁" marks a preceding space)."""
        return list(self._sp.encode(text, out_type=str))

    def decode(self, ids: list[int]) -> str:
        """Text of `ids`; pad, BOS and EOS are ignored, <unk> becomes " ⁇ "."""
        vocab = self.vocab_size
        kept = []
        for i in ids:
            i = int(i)
            if not 0 <= i < vocab:
                raise ValueError(f"token id {i} outside the vocabulary [0, {vocab})")
            if i not in _SKIP_ON_DECODE:
                kept.append(i)
        return str(self._sp.decode(kept))

    def normalize(self, text: str) -> str:
        """The text the model actually sees: NFKC (lowercased too if the vocabulary was
        trained with `lowercase`), whitespace runs collapsed and stripped.

        For text whose characters are all in the vocabulary,
        ``decode(encode(text)) == normalize(text)``.
        """
        # sentencepiece's normaliser marks spaces with "▁" and prepends one (the dummy prefix).
        spaced = str(self._sp.normalize(text)).replace("\u2581", " ")
        return spaced[1:] if spaced.startswith(" ") else spaced

    def id_to_piece(self, i: int) -> str:
        return str(self._sp.id_to_piece(i))

    def pieces(self) -> dict[str, int]:
        """Every ordinary piece (not a special, unused or byte piece) and its id."""
        sp = self._sp
        return {
            str(sp.id_to_piece(i)): i
            for i in range(self.vocab_size)
            if not (sp.is_control(i) or sp.is_unknown(i) or sp.is_unused(i) or sp.is_byte(i))
        }

    def bpe_merges(self) -> dict[tuple[int, int], tuple[int, float]]:
        """(a, b) -> (c, score of c) for every two pieces whose concatenation is a piece c.

        Sentencepiece's BPE encoder starts from characters and merges such pairs, the one
        with the best-scored c first (the leftmost on a tie), until none is left: with this
        table and :meth:`pieces`, data.BPEDropout redoes that, dropping merges at random.
        """
        pieces = self.pieces()
        table: dict[tuple[int, int], tuple[int, float]] = {}
        for piece, c in pieces.items():
            score = float(self._sp.get_score(c))
            for k in range(1, len(piece)):
                a, b = pieces.get(piece[:k]), pieces.get(piece[k:])
                if a is not None and b is not None:
                    table[(a, b)] = (c, score)
        return table

    def __repr__(self) -> str:
        return f"Tokenizer(vocab_size={self.vocab_size}, sha256={self.sha256[:12]})"


# --------------------------------------------------------------------------- separate vocabularies
#: The first bytes of a serialized pair of vocabularies (`PairTokenizer.to_bytes`).
PAIR_MAGIC = b"aiayn-vocab-pair-1\n"


class PairTokenizer:
    """Separate source and target vocabularies (`prepare --vocab separate`), for pairs in
    different scripts: a sentencepiece model per language, both of `vocab_size` pieces
    with aiayn's special ids. It stands where one `Tokenizer` stands: `encode` is the
    source's (what is translated), `decode` the target's (what comes out), `sha256` the
    pair's; the two are `source` and `target`. Source and target ids then mean different
    pieces, so the model ties no source embedding to the target's (`share_embeddings` off;
    the target embedding stays the pre-softmax projection: `share_target_embeddings`).

    Serialized (`to_bytes`, the file `spm.model` of a prepared directory, a checkpoint's
    "tokenizer") as PAIR_MAGIC, the source model's length (8 bytes, big-endian), the source
    model, then the target model.
    """

    def __init__(self, source: Tokenizer, target: Tokenizer) -> None:
        if source.vocab_size != target.vocab_size:
            raise InputError(
                f"source vocabulary of {source.vocab_size} pieces, target of "
                f"{target.vocab_size}: separate vocabularies must have one size"
            )
        self.source, self.target = source, target
        src = source.to_bytes()
        self._bytes = PAIR_MAGIC + len(src).to_bytes(8, "big") + src + target.to_bytes()
        self._sha256 = hashlib.sha256(self._bytes).hexdigest()

    @classmethod
    def from_bytes(cls, b: bytes, *, origin: str = "<bytes>") -> PairTokenizer:
        head = len(PAIR_MAGIC)
        if not b.startswith(PAIR_MAGIC) or len(b) < head + 8:
            raise InputError(f"{origin}: not a pair of vocabularies")
        n = int.from_bytes(b[head : head + 8], "big")
        src, tgt = b[head + 8 : head + 8 + n], b[head + 8 + n :]
        return cls(
            Tokenizer(src, origin=f"{origin} (source)"), Tokenizer(tgt, origin=f"{origin} (target)")
        )

    def to_bytes(self) -> bytes:
        return self._bytes

    def save(self, path: str | Path) -> None:
        with atomic_write(path) as f:
            f.write(self._bytes)

    @property
    def vocab_size(self) -> int:
        return self.source.vocab_size

    @property
    def sha256(self) -> str:
        return self._sha256

    def encode(self, text: str) -> list[int]:
        """Source subword ids (what the encoder reads)."""
        return self.source.encode(text)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return self.source.encode_batch(texts)

    def decode(self, ids: list[int]) -> str:
        """Target text of target ids (what the decoder wrote)."""
        return self.target.decode(ids)

    def __repr__(self) -> str:
        return f"PairTokenizer(vocab_size={self.vocab_size}, sha256={self.sha256[:12]})"


#: One vocabulary or a pair: what a prepared directory or a checkpoint holds.
Vocabulary = Tokenizer | PairTokenizer


def vocabulary_from_bytes(b: bytes, *, origin: str = "<bytes>") -> Vocabulary:
    """A shared `Tokenizer`, or a `PairTokenizer` if `b` is a serialized pair."""
    if b.startswith(PAIR_MAGIC):
        return PairTokenizer.from_bytes(b, origin=origin)
    return Tokenizer(b, origin=origin)


def load_vocabulary(path: str | Path) -> Vocabulary:
    """The vocabulary file `prepare` wrote (spm.model): one model, or a pair."""
    path = Path(path)
    if not path.is_file():
        raise InputError(f"{path}: no such sentencepiece model")
    return vocabulary_from_bytes(path.read_bytes(), origin=str(path))


def side_tokenizers(vocab: Vocabulary) -> tuple[Tokenizer, Tokenizer]:
    """(source, target) tokenizers: the one shared model twice, or the pair's two."""
    if isinstance(vocab, PairTokenizer):
        return vocab.source, vocab.target
    return vocab, vocab
