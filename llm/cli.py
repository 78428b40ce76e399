"""`zerollm <command>`: the command line. A user mistake prints one line and exits 2, no traceback."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from launch.local import relaunch_local, under_launcher
from llm.errors import EXIT_USER_ERROR, UserError

EPILOG = "Documentation: README.md. Errors in your input exit with code 2."


def _add_tokenizer(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("tokenizer", help="train a byte-level BPE tokenizer")
    tsub = p.add_subparsers(dest="action", required=True)
    t = tsub.add_parser("train", help="train a tokenizer on text files", epilog=EPILOG,
                        description="Train byte-level BPE (exact round trip, ChatML special tokens at ids 0-3) "
                                    "on .txt/.jsonl/.json files, streaming; writes tokenizer.json and "
                                    "tokenizer_config.json, loadable by transformers.AutoTokenizer.")
    t.add_argument("--input", nargs="+", required=True, metavar="PATH", help="files or directories to read")
    t.add_argument("--vocab-size", type=int, required=True, help="vocabulary size including special tokens")
    t.add_argument("--out", required=True, help="output directory")
    t.add_argument("--min-frequency", type=int, default=2, help="minimum pair frequency to merge (default 2)")


def _add_data(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("data", help="prepare tokenized HDF5 datasets")
    dsub = p.add_subparsers(dest="action", required=True)
    d = dsub.add_parser("prepare", help="tokenize files into HDF5", epilog=EPILOG,
                        description="Read .txt (documents separated by blank lines), .jsonl and .json files "
                                    "({'text'} records, conversations, alpaca, ...), tokenize them in parallel, "
                                    "append end-of-text after each document and write OUT/tokens.h5 with a "
                                    "train/val split and OUT/report.json. Malformed records are skipped and "
                                    "reported with file:line (or fatal with --strict).")
    d.add_argument("--kind", choices=["pretrain"], default="pretrain", help="what the data is for (default pretrain)")
    d.add_argument("--input", nargs="+", required=True, metavar="PATH", help="files or directories to read")
    d.add_argument("--tokenizer", required=True, help="tokenizer directory (from `zerollm tokenizer train`)")
    d.add_argument("--out", required=True, help="output directory")
    d.add_argument("--val-fraction", type=float, default=0.01, help="share of documents for validation (default 0.01)")
    d.add_argument("--workers", type=int, default=None, help="tokenizer processes (default: CPU count, at most 8)")
    d.add_argument("--strict", action="store_true", help="stop at the first malformed record instead of skipping it")
    d.add_argument("--seed", type=int, default=0, help="seed of the train/val split (default 0)")


def _add_run_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--recipe", required=True, help="packaged recipe name or YAML file")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a run-config key, e.g. --set train.lr=1e-3 (repeatable)")
    p.add_argument("--deepspeed", default=None, metavar="JSON",
                   help="DeepSpeed config (default ds_configs/<stage>.json); 'auto' values come from the run config")
    p.add_argument("--zero-stage", type=int, choices=[0, 1, 2, 3], default=None,
                   help="override zero_optimization.stage of the DeepSpeed config")
    p.add_argument("--nproc", type=int, default=1, help="ranks on this machine; >1 relaunches under the deepspeed launcher")


def _add_train(sub: argparse._SubParsersAction) -> None:
    from llm.config import recipe_names

    p = sub.add_parser("train", help="train a model under DeepSpeed")
    tsub = p.add_subparsers(dest="stage", required=True)
    t = tsub.add_parser("pretrain", help="pretrain on prepared data", epilog=f"Recipes: {', '.join(recipe_names())}. {EPILOG}",
                        description="Pretrain a decoder under DeepSpeed ZeRO. Writes RUN_DIR/config.yaml, "
                                    "RUN_DIR/ds_config.json, RUN_DIR/metrics.jsonl and RUN_DIR/checkpoints/. "
                                    "SIGTERM saves a checkpoint and exits 75; --resume auto continues exactly.")
    _add_run_options(t)
    t.add_argument("--data", required=True, help="directory from `zerollm data prepare`")
    t.add_argument("--out", required=True, help="run directory")
    t.add_argument("--resume", choices=["auto", "never"], default="never",
                   help="auto: continue from the newest complete checkpoint in --out, if any")
    t.add_argument("--wandb", choices=["off", "offline", "online"], default=None,
                   help="log to wandb as well (default: the recipe's wandb.mode, off)")


def _add_demo(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="the whole pipeline on a built-in corpus, in minutes on a CPU", epilog=EPILOG,
                       description="Generate a small learnable corpus (facts and arithmetic in English and Chinese), "
                                   "train a tokenizer, prepare data, pretrain the 'demo' recipe under DeepSpeed, "
                                   "show validation loss falling and print samples.")
    p.add_argument("--out", default="runs/demo", help="working directory (default runs/demo)")
    p.add_argument("--steps", type=int, default=None, help="training steps (default: the demo recipe's)")
    p.add_argument("--nproc", type=int, default=1, help="ranks (default 1)")


def _add_bench(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="benchmarks")
    bsub = p.add_subparsers(dest="what", required=True)
    b = bsub.add_parser("train", help="training throughput of a recipe on random tokens", epilog=EPILOG,
                        description="Run a short training job on random tokens and print tokens/s, "
                                    "loss-bearing tokens/s, MFU and peak memory (warm-up steps excluded).")
    _add_run_options(b)
    b.add_argument("--steps", type=int, default=10, help="measured steps (default 10)")
    b.add_argument("--warmup", type=int, default=2, help="steps excluded from the figures (default 2)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="zerollm", epilog=EPILOG,
                                     description="Train decoder-only language models end to end under DeepSpeed ZeRO.")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_tokenizer(sub)
    _add_data(sub)
    _add_train(sub)
    _add_demo(sub)
    _add_bench(sub)
    return parser


def cmd_tokenizer(args: argparse.Namespace) -> int:
    from llm.data.formats import Skipped, expand_inputs, read_pretrain_documents
    from llm.tokenizer import train_tokenizer

    files = expand_inputs(args.input)
    skipped = 0

    def texts():
        nonlocal skipped
        for doc in read_pretrain_documents(files):
            if isinstance(doc, Skipped):
                skipped += 1
            else:
                yield doc.text

    tok = train_tokenizer(texts(), args.vocab_size, Path(args.out), args.min_frequency)
    print(f"tokenizer: {tok.vocab_size} tokens, hash {tok.hash}, written to {args.out}"
          + (f" ({skipped} unusable records skipped)" if skipped else ""))
    return 0


def cmd_data(args: argparse.Namespace) -> int:
    from llm.data.prepare import prepare_pretrain

    report = prepare_pretrain(args.input, args.tokenizer, args.out, val_fraction=args.val_fraction,
                              workers=args.workers, strict=args.strict, seed=args.seed)
    print(report.summary())
    print(f"written to {args.out}")
    return 0


def _config_for(args: argparse.Namespace, extra: list[str]):
    from llm.config import build_config

    return build_config(args.recipe, [*args.overrides, *extra])


def cmd_train(args: argparse.Namespace) -> int:
    extra = [f"data.path={args.data}", f"train.stage={args.stage}"]
    if args.wandb:
        extra.append(f"wandb.mode={args.wandb}")
    cfg = _config_for(args, extra)
    if args.nproc > 1 and not under_launcher():
        return relaunch_local(args.nproc, args.argv)
    from llm.train.trainer import run

    return run(cfg, Path(args.out), args.deepspeed, resume=args.resume == "auto", zero_stage=args.zero_stage)


def cmd_demo(args: argparse.Namespace) -> int:
    from llm.demo import run_demo

    return run_demo(Path(args.out), steps=args.steps, nproc=args.nproc)


def cmd_bench(args: argparse.Namespace) -> int:
    from llm.bench import bench_train

    return bench_train(args)


COMMANDS = {"tokenizer": cmd_tokenizer, "data": cmd_data, "train": cmd_train, "demo": cmd_demo, "bench": cmd_bench}


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    args.argv = argv
    try:
        code = COMMANDS[args.command](args)
    except UserError as exc:
        print(f"zerollm: error: {exc}", file=sys.stderr)
        code = EXIT_USER_ERROR
    except KeyboardInterrupt:
        print("zerollm: interrupted", file=sys.stderr)
        code = 130
    sys.exit(code)
