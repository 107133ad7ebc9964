"""The parsers of the commands that take a trained model out of aiayn: export, serve."""

from __future__ import annotations

import argparse

from aiayn.cli.flags_generate import add_workers_flag
from aiayn.cli.formatting import command_parser

#: CTranslate2's weight types (aiayn.deploy.export.CT2_QUANTIZATIONS; listed here so that
#: building the parser imports neither torch nor ctranslate2).
QUANTIZATIONS = (
    "int8",
    "int8_float32",
    "int8_float16",
    "int8_bfloat16",
    "int16",
    "float16",
    "bfloat16",
    "float32",
)


def add_export(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    p = command_parser(
        sub,
        "export",
        "write a checkpoint as a CTranslate2 or Hugging Face MarianMT model directory",
        """\
The directory holds the model, its sentencepiece model and vocabulary, and a README.md
with the few lines that translate with it; aiayn_export.json records the checkpoint and
its decoding settings. The directory itself makes the engine add the source's </s> and
never generate <s> or padding, so that greedy search there gives aiayn's greedy output
(`aiayn translate --beam 1`) token for token. Beam search is close, not the same (their
length penalty is |Y|^alpha, aiayn's is GNMT's): docs/deploy.md gives the measured
agreement.

ctranslate2: ctranslate2.Translator(DIR).translate_batch(pieces, beam_size=1,
min_decoding_length=0), with pieces from DIR/sentencepiece.model. marian:
MarianMTModel.from_pretrained(DIR) and MarianTokenizer.from_pretrained(DIR), then
model.generate(**tok(texts, return_tensors="pt", padding=True), num_beams=1). Each needs its
package (pip install 'aiayn[export]').

examples:
  aiayn export --checkpoint runs/tiny/averaged.pt --to ctranslate2 --out exports/ct2
  aiayn export --checkpoint runs/tiny/averaged.pt --to ctranslate2 \\
      --quantization int8 --out exports/ct2-int8
  aiayn export --checkpoint runs/tiny/averaged.pt --to marian --out exports/marian""",
    )
    p.add_argument(
        "--checkpoint",
        required=True,
        metavar="FILE.pt",
        help="the model to export (e.g. an average)",
    )
    p.add_argument(
        "--to",
        required=True,
        choices=["ctranslate2", "marian"],
        help="the engine: CTranslate2's model directory, or Hugging Face transformers' "
        "MarianMT (config.json, model.safetensors and the MarianTokenizer files)",
    )
    p.add_argument(
        "--out",
        required=True,
        metavar="DIR",
        help="the directory to write; created if missing, refused if it holds files "
        "(unless --force)",
    )
    p.add_argument(
        "--quantization",
        choices=QUANTIZATIONS,
        metavar="TYPE",
        help="ctranslate2 only: the stored weights' type, one of "
        f"{', '.join(QUANTIZATIONS)} (default: float32, the checkpoint's weights exactly; "
        "int8 is smaller and faster on CPUs, and its outputs can differ)",
    )
    p.add_argument(
        "--force",
        action="store_true",
        help="write into an --out that already holds files: files of the export's names "
        "are replaced, others are left as they are",
    )
    return p


def add_serve(
    sub: argparse._SubParsersAction[argparse.ArgumentParser],
) -> argparse.ArgumentParser:
    p = command_parser(
        sub,
        "serve",
        "translate over HTTP: a JSON API, batched, bounded",
        """\
Loads the checkpoint(s) (refusing a corrupt one before opening the port), then answers:
  POST /translate  {"text": "A man rides a bike." | [...], "beam": 4, "alpha": 0.6,
                    "nbest": 1}  (options optional: the checkpoint's by default)
                   -> {"translations": [{"text": ..., "score": ...}], ...}
  GET  /health     liveness and queue depth
  GET  /metrics    Prometheus: requests by code, latency, batch sizes, queue, tokens/s
  GET  /docs       the OpenAPI documentation (schema at /openapi.json)
Requests that arrive together are decoded together (--batch-wait-ms, --max-batch-tokens);
each output equals `aiayn translate`'s for the same sentence and options. A bad request
gets a 4xx with {"error": ...}; a full queue gets 503 with Retry-After. SIGTERM stops
listening, finishes the requests in flight and exits 0. Needs the `serve` extra
(pip install 'aiayn[serve]': FastAPI, uvicorn, prometheus-client).

examples:
  aiayn serve --checkpoint runs/en-de/checkpoint_avg.pt
  curl -s localhost:8000/translate -H 'Content-Type: application/json' \\
      -d '{"text": "A man rides a bike."}'
  aiayn serve --checkpoint a.pt --dtype int8 --workers 2 --port 8080""",
    )
    p.add_argument(
        "--checkpoint",
        required=True,
        nargs="+",
        action="extend",
        metavar="FILE.pt",
        help="a model; several (same vocabulary) decode as an ensemble",
    )
    p.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to listen on; 0.0.0.0 makes the server reachable from other machines",
    )
    p.add_argument("--port", type=int, default=8000, help="TCP port")
    p.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "fp32", "bf16", "int8"],
        help="inference precision, as for translate (auto: this machine's fastest, its "
        "int8 with 7-bit inputs without VNNI; AIAYN_INT8_ACTIVATIONS=7|8 sets the bits)",
    )
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1 ...")
    add_workers_flag(
        p,
        "batches decoded at once: on the CPU each in a forked process of one thread (as "
        "`translate --workers`), on a GPU each in a thread",
    )
    p.add_argument(
        "--beam", type=int, help="default beam size of a request (default: the checkpoint's)"
    )
    p.add_argument(
        "--alpha",
        type=float,
        help="default length penalty of a request (default: the checkpoint's)",
    )
    p.add_argument(
        "--max-len-a",
        type=float,
        metavar="A",
        help="output length at most A x input length + B (default: the checkpoint's)",
    )
    p.add_argument("--max-len-b", type=int, metavar="B", help="see --max-len-a")
    p.add_argument(
        "--max-batch-tokens",
        type=int,
        default=4000,
        metavar="TOKENS",
        help="source subwords decoded together at most",
    )
    p.add_argument(
        "--batch-wait-ms",
        type=float,
        default=5.0,
        metavar="MS",
        help="under load (a batch already decoding), how long a request waits for others "
        "to batch with; on an idle server a request is decoded at once",
    )
    p.add_argument(
        "--max-queue",
        type=int,
        default=256,
        metavar="SENTENCES",
        help="sentences waiting or decoding; a request beyond it gets 503 and Retry-After",
    )
    p.add_argument(
        "--max-texts", type=int, default=64, metavar="N", help="texts in one request at most"
    )
    p.add_argument(
        "--max-input-tokens",
        type=int,
        default=0,
        metavar="SUBWORDS",
        help="subwords in one text at most, longer ones get 413 (0: the model's limit, "
        "decode.max_input_len and its position table)",
    )
    p.add_argument(
        "--max-body-bytes",
        type=int,
        default=1 << 20,
        metavar="BYTES",
        help="request body size at most (413 beyond)",
    )
    p.add_argument(
        "--max-beam", type=int, default=16, metavar="K", help="largest beam a request may ask"
    )
    p.add_argument(
        "--graceful-timeout",
        type=int,
        default=30,
        metavar="SECONDS",
        help="after SIGTERM, how long requests in flight may take to finish",
    )
    p.add_argument(
        "--log-level",
        default="info",
        choices=["critical", "error", "warning", "info", "debug"],
        help="uvicorn's log level (access lines at info)",
    )
    return p
